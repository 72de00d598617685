"""Multi-host restarts: a lost node is waited for, then rejoins, or its stages are re-placed.

With ``--max-restarts`` on a multi-host run, node 0 hosts the rendezvous store for the whole run
(not one start of the stages: :class:`Elastic`), and every start of the stages is a new
*generation* n of the run (:attr:`pipeq.Rendezvous.generation`): node 0's
entries for it are signed under ``g<n>/``, and the signed entry "generation" points at it::

    a start fails (any stage: a raise, a death, a lost node); its stages are all stopped
    node 0:   "generation" = {generation: n + 1, rejoin_timeout: s, nodes: the nodes taking part}
    agents:   each live agent (told EXIT abort) and any agent started anew with --node-rank r
              sees it and says "g<n+1>/agent/r" = {node: r, generation: n + 1}
    node 0:   waits up to rejoin_timeout for every node of the run to say so, then (decide):
                every node there       -> the same placement again   ("node 1 rejoined")
                lost nodes, >= min     -> placement_over the nodes left ("re-placing stages ..."),
                                        which are the run's nodes from then on (a node re-placed
                                        that comes back later is told the run goes on without it)
                fewer than min_nodes   -> the run ends, naming the lost nodes and what to do
    node 0:   starts generation n + 1 (its entries under g<n+1>/); training resumes from the
              newest checkpoint (checkpoints name the flat model's parameters: any placement loads them)

The rejoin timeout (job key ``rejoin_timeout``) defaults to 60 s: enough for a process on a live
host to be started again (by hand, torchrun's ``--max-restarts`` or a batch system: an interpreter
importing torch and an agent, ~5-10 s), short beside the minutes of training a checkpoint
interval holds; a job whose lost hosts must first be replaced sets it longer.

An agent only joins a generation whose entries are there (node 0 removes them once every stage
is READY), so a late or stale agent waits for the next start instead of joining a running one;
an entry of another generation is signed for another full key and never verifies. Node 0
writes "generation" again every half second (:class:`~pipeq.control.rendezvous.Republisher`),
so a forged or deleted one does not stall a join.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from pipeq.control import rendezvous as rdzv
from pipeq.control.rendezvous import Rendezvous

__all__ = ["Decision", "decide", "Elastic", "pointer", "WAIT", "GO", "REPLACE", "GIVE_UP"]

WAIT, GO, REPLACE, GIVE_UP = "wait", "go", "re-place", "give up"
# seconds the live agents have to say they are there before a node is said lost (an agent told
# the start failed gives its stages up to 2 s to exit first); at most half the rejoin timeout
_GRACE = 3.0
_POLL = 0.1


@dataclass(frozen=True)
class Decision:
    """What node 0 does after a failed start: ``action`` (:data:`WAIT`, :data:`GO`,
    :data:`REPLACE`, :data:`GIVE_UP`), the nodes of the next start, and the nodes lost."""

    action: str
    nodes: tuple[int, ...]
    lost: tuple[int, ...] = ()
    rejoined: tuple[int, ...] = ()  # nodes said lost that came back in time


def decide(alive: Sequence[int], present: Iterable[int], min_nodes: int, timed_out: bool) -> Decision:
    """The decision once the nodes ``present`` (besides node 0) said they are there for the next
    start, of the nodes ``alive`` in the last one; ``timed_out``: the rejoin timeout has passed."""
    there = set(present)
    missing = tuple(r for r in alive if r != 0 and r not in there)
    if not missing:
        return Decision(GO, tuple(alive))
    if not timed_out:
        return Decision(WAIT, tuple(alive), missing)
    left = tuple(r for r in alive if r not in missing)
    return Decision(REPLACE if len(left) >= min_nodes else GIVE_UP, left, missing)


def pointer(store: Any, rz: Rendezvous) -> dict | None:
    """Node 0's "generation" entry (``{"generation": n, "rejoin_timeout": s, "nodes": [...]}``:
    the nodes that take part) if a valid one
    is there, else None. ``store`` is the run's store at generation 0's prefix."""
    state, value = rz.at(0).read(store, rdzv.GENERATION)
    if state != rdzv.VALID or not isinstance(value, dict) or type(value.get("generation")) is not int:
        return None
    return value


def _nodes_text(nodes: Sequence[int]) -> str:
    return f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {list(nodes)}"


class Elastic:
    """Node 0's side of a multi-host run with restarts: the store hosted for the whole run, the
    generation, the nodes that take part, and :meth:`regroup` after a failed start."""

    def __init__(self, rz: Rendezvous, *, rejoin_timeout: float, min_nodes: int | None, start_timeout: float,
                 log: Callable[[str], None], clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        min_nodes = rz.nnodes if min_nodes is None else min_nodes
        if not 1 <= min_nodes <= rz.nnodes:
            raise ValueError(f"min_nodes = {min_nodes}, but the run has {rz.nnodes} node(s): give 1 to {rz.nnodes}")
        if not rejoin_timeout > 0:
            raise ValueError(f"rejoin_timeout must be more than 0 seconds, got {rejoin_timeout}")
        self.rz = rz
        self.rejoin_timeout = float(rejoin_timeout)
        self.min_nodes = min_nodes
        self.start_timeout = start_timeout
        self.log = log
        self.clock, self.sleep = clock, sleep
        self.generation = 0
        self.alive: list[int] = list(range(rz.nnodes))
        self.store: Any = None  # node 0's (hosting) connection to the run's store, generation 0's prefix
        self._republisher: rdzv.Republisher | None = None

    @classmethod
    def of(cls, job: Any, rz: Rendezvous | None, log: Callable[[str], None]) -> "Elastic | None":
        """The job's (None for one host, or without max_restarts: a failure ends the run)."""
        if rz is None or not job.max_restarts:
            return None
        return cls(rz, rejoin_timeout=job.rejoin_timeout, min_nodes=job.min_nodes, start_timeout=job.start_timeout,
                   log=log)

    # -- the run's store ---------------------------------------------------------------------------------
    def open(self) -> None:
        """Host the run's store (unless torchrun's agent hosts it) and point the agents at generation 0."""
        self.store = self.rz.at(0).store(self.start_timeout)
        self._point()

    def close(self) -> None:
        """Stop pointing (the run is over); the store closes with the last reference to it."""
        if self._republisher is not None:
            self._republisher.stop()
            self._republisher = None
        self.store = None  # the store's port closes with the run

    def _point(self) -> None:
        """Say which generation the agents are to join (and keep saying it)."""
        entry = {"generation": self.generation, "rejoin_timeout": self.rejoin_timeout, "nodes": self.alive}
        signed = {rdzv.GENERATION: self.rz.at(0).sign(rdzv.GENERATION, entry)}
        if self._republisher is not None:
            self._republisher.stop()
        self.store.set(rdzv.GENERATION, signed[rdzv.GENERATION])
        self._republisher = rdzv.Republisher(self.rz.at(0), signed, timeout=min(self.start_timeout, 10.0)).start()

    def rendezvous(self) -> Rendezvous:
        """The rendezvous of the next start: its generation, its nodes, the store a client's."""
        nodes = tuple(self.alive) if len(self.alive) < self.rz.nnodes else None
        return self.rz.at(self.generation, nodes=nodes, agent_store=True)

    # -- after a failed start ------------------------------------------------------------------------------
    def regroup(self, n_processes: int | None = None, placement: Any = None,
                place: Callable[[Sequence[int] | None], list[list[int]]] | None = None) -> Decision:
        """A new generation, waited for: every node of the last start that says it is there
        within rejoin_timeout takes part again; what happens to the others, :func:`decide`
        says (and this logs). To name the stages re-placed: ``place(alive)``, the processes each
        node holds when only the nodes ``alive`` take part (the driver's own placement,
        :func:`pipeq.control.processes.place_leads`), else ``n_processes`` placed by
        ``placement``, one stage per process."""
        self.generation += 1
        self._point()
        scoped = self.rz.at(self.generation)
        store = scoped.on(self.store)
        t0 = self.clock()
        warned: tuple[int, ...] = ()
        while True:
            present = [r for r in self.alive if r and self._there(scoped, store, r)]
            waited = self.clock() - t0
            decision = decide(self.alive, present, self.min_nodes, waited >= self.rejoin_timeout)
            if decision.action != WAIT:
                break
            if not warned and waited >= min(_GRACE, self.rejoin_timeout / 2):
                warned = decision.lost
                self.log(f"{_nodes_text(warned)} lost; waiting up to {self.rejoin_timeout:.0f} s for "
                         f"{'it' if len(warned) == 1 else 'them'} to rejoin (pipeq launch ... --node-rank "
                         f"{warned[0]} started again, on any host)")
            self.sleep(_POLL)
        if decision.action == GO and warned:
            decision = dataclasses.replace(decision, rejoined=warned)
        if place is None and n_processes is not None:
            count = n_processes
            place = lambda alive: rdzv.placement_over(count, self.rz.nnodes, alive, placement)  # noqa: E731
        self._said(decision, place)
        if decision.action == REPLACE:
            self.alive = list(decision.nodes)
            self._point()  # the nodes that take part from now on
        return decision

    def _there(self, scoped: Rendezvous, store: Any, node: int) -> bool:
        key = f"agent/{node}"
        try:
            state, value = scoped.read(store, key)
        except Exception:  # a store hiccup: not there yet
            return False
        return (state == rdzv.VALID and isinstance(value, dict) and value.get("node") == node
                and value.get("generation") == self.generation)

    def _said(self, decision: Decision, place: Callable[[Sequence[int] | None], list[list[int]]] | None) -> None:
        lost, t = decision.lost, self.rejoin_timeout
        if decision.action == GO:
            if decision.rejoined:
                self.log(f"{_nodes_text(decision.rejoined)} rejoined")
            return
        if decision.action == GIVE_UP:
            self.log(f"{_nodes_text(lost)} did not rejoin within {t:.0f} s, and the {len(decision.nodes)} node(s) "
                     f"left are fewer than min_nodes = {self.min_nodes}: the run ends. Start "
                     f"{_nodes_text(lost)} again (pipeq launch ... --node-rank {lost[0]}) with --resume on node 0, "
                     f"or allow fewer nodes (--min-nodes {len(decision.nodes)})")
            return
        moved = self._moved(decision.nodes, place)
        what = f"stages {moved}" if moved else f"{_nodes_text(lost)}'s stages"
        self.log(f"{_nodes_text(lost)} did not rejoin within {t:.0f} s; re-placing {what} on "
                 f"{_nodes_text(decision.nodes)} (min_nodes = {self.min_nodes})")

    def _moved(self, nodes: Sequence[int], place: Callable[[Sequence[int] | None], list[list[int]]] | None,
               ) -> list[int]:
        """The processes whose node changes (empty if they cannot be told)."""
        if place is None:
            return []
        try:
            old, new = place(self.alive), place(nodes)
        except ValueError:
            return []
        where = {k: r for r, ks in enumerate(old) for k in ks}
        return sorted(k for r, ks in enumerate(new) for k in ks if where.get(k) != r)
