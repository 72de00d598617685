"""``fault_tolerance="replicas"``: with data parallelism, replicas that carry on when one fails.

When a stage of replica r fails during a training step (it raises, dies, stops heart-beating or
is stuck past ``step_timeout``), the driver does not end the run:

1. it stops the failed process and tells the other replicas' stages (LOST) to sum the gradients
   without replica r from the step's gradient round on (the oldest step outstanding: the
   failed process's step, or an earlier one): a stage waiting for r's buckets of that round (or
   a later one) stops waiting at once. The round before may still be summing at the first
   stages: it still takes r's buckets of it from r's stages that deliver them. Replica r's own
   stages that still run are told too (LOST naming their replica): one that has not sent its
   buckets of that round and waits while a dead stage of r is downstream of it gives the round
   up and exits (:mod:`pipeq.parallel.membership`). So nobody waits for a time-out. Each survivor ACKs the LOST once past
   that round, naming the rounds it summed with r (:class:`~pipeq.control.degraded.DegradedSteps`
   records, per step and stage, who was left out); r's other processes are stopped then (or
   after ``step_timeout``, else ``heartbeat_timeout``, when one of them hangs: its round is
   summed without it, with a warning);
2. each surviving stage sums its gradients in a torch process group rebuilt without replica r,
   agreeing with the other survivors of its stage on whether the round in flight counted r
   (:mod:`pipeq.parallel.membership`), and scales the sum by the whole batch's loss weight over
   theirs (:func:`pipeq.parallel.data.survivor_scale`). Every microbatch's loss is weighted
   by its share of the whole batch, so the step's update is the one a batch made of the
   completed replicas' samples only gives: the mean loss over those samples. The loss reported
   for the step is that mean too (the survivors' weighted losses, scaled alike);
3. at the end of the step of the failure (in a stream: once the steps in flight are done),
   replica r is started again: fresh processes, wired
   to their neighbours and to the other replicas, then loaded with a healthy replica's live
   state (weights and buffers, optimizer, lr schedulers, loss scaler: the state the survivors
   hold after the step; each stage keeps its own random streams, seeded as at the run's start).
   The next step runs with every replica again.

The run never stops and never rolls back. The steps that had fewer replicas are recorded
(``runner.degraded_steps``, and where: ``runner.degraded_stages``; ``pipeq launch`` writes
``"replicas"`` in the metrics line of the step of the failure).

A failure of the last healthy replica, a failure while a replica is being rebuilt, and a failure
outside a training step (an evaluation, a save) still end the run, as without this setting. A
lost replica's samples of the step are not trained on (nor those of later steps already sent to
it, in a stream); the sums are made per stage: a stage of the lost replica that had already
delivered its gradients for the step when another of its stages failed is counted for that stage,
and a stage of it that died before delivering its gradients of an earlier step (one whose loss
was in: the first stages finish a step last) is left out of that step at that stage. A failure
at a step's start causes neither.
A process holding several stages (virtual stages) fails as a whole: every stage it holds is
dropped for the step and rebuilt with it; so does a tensor-parallel stage's process: the
replica's shards are dropped and rebuilt together. With ``sharding="hsdp"`` a replica is lost
with its shard group (its replicate slice: the others cannot gather its pieces), which is rebuilt
from another group's copy. Supported on one host, with schedules that finish every batch before
the next (not asynchronous 1F1B): see :mod:`pipeq.compat`.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from pipeq.control.processes import stop_processes
from pipeq.control.waiting import LOST_REPLICA_DRAIN_S
from pipeq.errors import PipelineError
from pipeq.wire import control, shm
from pipeq.wire.control import Ack, GetSnapshot, Lost, Ready, Rejoin, Restore
from pipeq.wire.errors import PeerUnreachable
from pipeq.wire.lanes import lane_path
from pipeq.wire.messages import Kind, Message

if TYPE_CHECKING:
    from pipeq.control.config import RunConfig
    from pipeq.control.startup import StageProcesses

__all__ = ["ReplicaLoss"]


@dataclass
class _Parting:
    """A dropped replica whose processes that did not fail are still running: until every
    survivor has ACKed its LOST (request ``request``), summed its rounds before ``from_round``."""

    from_round: int
    request: int
    deadline: float
    dead: set[int]  # its stages whose process is dead or stopped
    acked: dict[int, set[int]] = field(default_factory=dict)  # survivor that ACKed -> rounds it summed with r
    last_round: int = 0  # the last gradient round sent to it (from_round on: summed with it only where ACKed so)


class ReplicaLoss:
    """The driver's side: drops a failed replica (the supervisor's ``absorb``) and rebuilds it.

    ``busy()`` says whether a training step is outstanding: only then is a failure absorbed;
    ``rounds()`` is the gradient round of the oldest step outstanding (the first a dropped replica
    misses) and the last one sent; ``request_id()`` numbers a LOST, which the survivors ACK."""

    def __init__(self, processes: "StageProcesses", busy: Callable[[], bool], rounds: Callable[[], tuple[int, int]],
                 request_id: Callable[[], int], shard_group: int = 1) -> None:
        self.p = processes
        self.group = shard_group  # the replicas lost and rebuilt together (a replicate slice)
        self.busy, self.rounds_out, self.request_id = busy, rounds, request_id
        self.down: dict[int, PipelineError] = {}  # replica -> the failure that dropped it
        self.failures: list[PipelineError] = []  # every failure absorbed, in order
        self.parting: dict[int, _Parting] = {}  # dropped replicas whose other processes still run
        #: gradient round -> stage -> the replicas it left out, for the rounds before a loss's
        #: first (a stage whose lost copy had not delivered) and the rounds from it on that a
        #: stage had summed before the loss came (``(replica, False)``: kept in, not left out)
        self.rounds: dict[int, dict[int, dict[int, bool]]] = {}
        self.rebuilds = 0  # replicas started again so far (their groups meet under new names)
        processes.absorb = self.absorb

    def live(self) -> list[int]:
        """The replicas running now."""
        return [r for r in range(self.p.replicas) if r not in self.down]

    def slice_of(self, r: int) -> list[int]:
        """Replica r and the replicas lost and rebuilt with it (its replicate slice)."""
        first = r // self.group * self.group
        return list(range(first, first + self.group))

    def leads_of(self, r: int) -> list[int]:
        """The processes the driver commands of replica r's slice (each stage's shard 0)."""
        n = self.p.n_stages
        return [rr * n + k for rr in self.slice_of(r) for k in range(n)]

    def processes_of(self, r: int) -> list[int]:
        """Every process of replica r's slice, the shards of tensor-parallel stages included."""
        return [g for lead in self.leads_of(r) for g in self.p.numbering.group(lead)]

    def absorb(self, g: int, err: PipelineError) -> bool:
        """Process g has failed: drop its replica (its slice) and carry on (True), when a training
        step is outstanding and another slice is healthy; else False (the run ends)."""
        r = self.p.numbering.replica(g)
        if not self.busy() or r in self.down or len(self.live()) <= self.group:
            return False
        self._drop(r, g, err)
        return True

    def _drop(self, r: int, g: int, err: PipelineError) -> None:
        p, sup = self.p, self.p.sup
        assert sup is not None
        for lost in self.slice_of(r):
            self.down[lost] = err
        self.failures.append(err)
        sup.ignore(self.processes_of(r))
        sup.watch = self.watch
        grace = sup.step_timeout or sup.heartbeat_timeout
        first, last = self.rounds_out()
        part = self.parting[r] = _Parting(first, self.request_id(), time.monotonic() + grace, set(), last_round=last)
        sup.awaited.add((Kind.ACK, part.request))  # kept as they come, whoever is waiting then
        self._stop(r, part, {g} | {h for h in self._running(r) if p.procs[h].exitcode is not None})
        print(f"pipeq: {_where(err)}: {err.message}; the other replicas finish the step without replica {r}, "
              "which is rebuilt for the next step", file=sys.stderr)

    def _running(self, r: int) -> list[int]:
        """Replica r's processes not stopped yet."""
        return [h for h in self.processes_of(r) if h in self.p.procs]

    def _survivors(self) -> list[int]:
        return sorted({g for s in self.live() for g in self.processes_of(s)})

    def _stop(self, r: int, part: _Parting, processes: set[int]) -> None:
        """Stop ``processes`` of dropped replica r, and tell the survivors that have not ACKed yet
        (LOST) which of its stages are dead now."""
        p, sup = self.p, self.p.sup
        assert sup is not None and sup.server is not None
        stop_processes([p.procs.pop(h) for h in sorted(processes) if h in p.procs])
        part.dead |= {p.numbering.stage(h) for h in processes}
        lost = control.message(Lost(replica=r, from_round=part.from_round, dead=sorted(part.dead)), part.request)
        try:
            sup.server.send_many([(g, lost) for g in self._survivors() if g not in part.acked])
        except PeerUnreachable as exc:  # a survivor is gone too: that one ends the run
            raise sup.fail(sup.error("its control socket is gone", exc.process))
        for h in self._running(r):  # its own stages part: one that cannot finish its round gives it up
            try:
                sup.server.send_many([(h, lost)])
            except PeerUnreachable:  # (dying too: watch() sees it)
                pass

    def watch(self) -> None:
        """(At each of the supervisor's health checks.) A dropped replica's other processes are
        stopped once every survivor ACKed its LOST; one that died meanwhile, and every one after
        the grace, are stopped before (the survivors are told)."""
        sup = self.p.sup
        assert sup is not None
        for r, part in list(self.parting.items()):
            for g, msg in sup.kept.take(Kind.ACK, part.request):
                part.acked[g] = set(control.read(msg, Ack).with_lost or ())
            late = [g for g in self._survivors() if g not in part.acked]
            if not late:
                stop_processes([self.p.procs.pop(h) for h in self._running(r)])
                sup.awaited.discard((Kind.ACK, part.request))
                self._note_rounds(r, part)
                del self.parting[r]
                continue
            died = {h for h in self._running(r) if self.p.procs[h].exitcode is not None}
            if time.monotonic() > part.deadline:
                part.deadline = float("inf")
                died = set(self._running(r))
                print(f"pipeq: replica {r}'s processes {sorted(died)} had not sent the gradients that processes "
                      f"{late} wait for (gradient round {part.from_round - 1}) in time: stopped, that round is "
                      "summed without them there", file=sys.stderr)
            if died:
                self._stop(r, part, died)

    def _note_rounds(self, r: int, part: _Parting) -> None:
        """Every survivor ACKed: note, per stage, the round before the loss's first when that stage
        left replica r out of it, and a later round it had summed with r before the LOST came."""
        stage = self.p.numbering.stage
        for g, with_lost in part.acked.items():
            for lost in self.slice_of(r):
                if part.from_round > 1 and part.from_round - 1 not in with_lost:
                    self.rounds.setdefault(part.from_round - 1, {}).setdefault(stage(g), {})[lost] = True
                # the rounds from the loss's first on that r was sent: left out unless the ACK says summed (a
                # step whose loss r had sent counts r at the driver, yet a stage may have left it out)
                for x in set(range(part.from_round, part.last_round + 1)) | (with_lost - {part.from_round - 1}):
                    self.rounds.setdefault(x, {}).setdefault(stage(g), {})[lost] = x not in with_lost

    def _part(self, r: int) -> None:
        """Wait until replica r's processes are all stopped (every survivor ACKed its LOST)."""
        sup = self.p.sup
        assert sup is not None
        end = sup.begin_wait() + 2 * (sup.step_timeout or sup.heartbeat_timeout) + 5.0
        while r in self.parting:
            if time.monotonic() > end:
                late = sorted(set(self._survivors()) - set(self.parting[r].acked))
                raise sup.fail(PipelineError(f"processes {late} never summed the gradients of the steps before "
                                             f"replica {r} was lost (no ACK to its LOST)"))
            sup.drain_pending()
            sup.check_health()  # (watches the parting)
            time.sleep(0.01)

    def rebuild(self, rounds: int, request_id: Callable[[], int]) -> None:
        """Start every lost replica again from a healthy one's state (nothing may be in flight);
        ``rounds``: the gradient rounds every replica has made so far (the training steps sent)."""
        for r in sorted(self.down):
            if r not in self.down:  # (rebuilt with its slice already)
                continue
            self._part(r)
            self._rebuild(r, rounds, request_id)
            for lost in self.slice_of(r):
                del self.down[lost]

    def _rebuild(self, r: int, rounds: int, request_id: Callable[[], int]) -> None:
        p, sup = self.p, self.p.sup
        assert sup is not None
        mine = self.processes_of(r)
        end = time.monotonic() + LOST_REPLICA_DRAIN_S
        while time.monotonic() < end:
            sup.drain_pending()
            time.sleep(0.02)
        if p.ipc_dir is not None:  # their shared-memory segments and lanes: the new processes make their own
            for g in mine:
                for direction in "FB":
                    shm.remove_segments(f"{shm.run_prefix(p.ipc_dir)}-{direction}{g}")
                for address in (p.ready[g].forward, p.ready[g].backward):
                    path = lane_path(address)
                    if path is not None and os.path.exists(path):
                        os.unlink(path)
        self.rebuilds += 1
        p.spawn(mine, generation=self.rebuilds)
        for g in mine:  # they count again (a death is a failure), judged for heartbeats once READY,
            sup.ignored.discard(g)  # as at the run's start: until then start_timeout is the limit
            sup.last_beat[g] = float("inf")
        replies = sup.collect(Kind.READY, dict.fromkeys(mine, 1), timeout=p.start_timeout,
                              what=f"replica {r}'s restart")
        now = time.monotonic()
        for g in mine:  # READY: judged for heartbeats from now on
            sup.last_beat[g] = now
        for g in mine:
            p.ready[g] = control.read(replies[g][0], Ready)
        healthy = self.live()
        leads = self.leads_of(r)
        others = [g for s in healthy for g in range(s * p.n_stages, (s + 1) * p.n_stages)]
        req = request_id()
        # the rebuilt slice makes the replicas' group with the others (its PEERS: a rejoin), the
        # others with it (REJOIN; a tensor-parallel lead shares it with its shards)
        msgs: list[tuple[int, Message]] = [(g, m) for g, m in p.peers(p.ready, req, rejoin_round=rounds)
                                           if g in leads]
        msgs += [(g, control.message(Rejoin(replica=r, round=rounds), req)) for g in others]
        sup.send_all(msgs)
        sup.collect(Kind.ACK, dict.fromkeys(leads + others, 1), step=req, timeout=p.start_timeout,
                    what=f"replica {r}'s rejoining")
        self._copy_state(healthy, r, request_id)

    def _copy_state(self, healthy: list[int], r: int, request_id: Callable[[], int]) -> None:
        """Each stage of replica r's rebuilt slice loads the live state of the same stage of a
        healthy slice: weights, optimizer, schedulers, scaler; not its RNG. (A slice's stages are
        read together: a sharded stage's state is gathered from its pieces.)"""
        sup = self.p.sup
        assert sup is not None
        n = self.p.n_stages
        source = self.leads_of(healthy[0])
        req = request_id()
        sup.send_all([(g, control.message(GetSnapshot(), req)) for g in source])
        got = sup.collect(Kind.SNAPSHOT, dict.fromkeys(source, 1), step=req, what="a healthy replica's state")
        req = request_id()
        msgs = []
        for h in self.leads_of(r):
            snap: dict[str, Any] = control.state_of(got[source[h % n]][0])
            snap.pop("rng", None)  # each replica's own random streams (dropout masks differ)
            msgs.append((h, control.state_message(Restore, req, snap, f"stage {h % n}'s state")))
        sup.send_all(msgs)
        sup.collect(Kind.ACK, dict.fromkeys(self.leads_of(r), 1), step=req, what="the rebuilt replica's state")


def _where(err: PipelineError) -> str:
    """Where a failure happened, as its error names it."""
    parts = [f"replica {err.replica}"] if err.replica is not None else []
    if err.stage is not None:
        parts.append(f"stage {err.stage}")
    return ", ".join(parts) or "a stage"
