"""Process mode's start-up and teardown: the stage processes, node 0's rendezvous entries, the wiring.

:class:`StageProcesses` starts one worker process per stage process (multiprocessing ``spawn`` or
``forkserver``: each stage's :class:`~pipeq.runtime.executors.StageSpec` is handed over at process
start, never over a socket), publishes node 0's rendezvous entries for the other nodes' agents
(multi-host), waits for each process to report READY with its bound addresses, and tells every
one its neighbours' addresses (with data parallelism, its stage's other replicas'; with tied
weights, its replica's stages' tie links, once their ties are checked to agree)::

    start:   spawn stages -> READY (addresses) from each -> PEERS to each [-> ACK from each: the
             replicas hold replica 0's weights (data parallelism)]
    stop:    STOP to each -> ACK from each (nothing in flight) -> [traces] -> EXIT to each

A start-up that times out says which node or stage never came and what most likely kept it.
:meth:`StageProcesses.teardown` stops every process and removes the ipc directory, whatever
happened before; workers also die with the driver (a pidfd watch, or PR_SET_PDEATHSIG).
"""

from __future__ import annotations

from pipeq.control.stage_handle import StageHandle
from pipeq.control.waiting import EXIT_S
import dataclasses
import threading
import time
from typing import Any, Callable, Sequence

import torch

from pipeq.control import rendezvous as rdzv
from pipeq.control.processes import (Numbering, RunSetup, job_identity, place_leads, process_context,
                                     start_workers, stop_processes, worker_configs)
from pipeq.control.rendezvous import Rendezvous
from pipeq.control.supervisor import Supervisor
from pipeq.control.trace_collector import TraceRecorder
from pipeq.stage.spec import StageBuilder
from pipeq.stage.tie_groups import tie_mismatch
from pipeq.wire import control, shm
from pipeq.wire.control import Exit, Peers, Ready, Stop
from pipeq.wire.keys import JobSecret
from pipeq.wire.messages import Kind, Message
from pipeq.wire.control_link import AGENT, STAGE, ControlServer
from pipeq.wire.security import WireAuth
from pipeq.wire.sockets import BindTo, make_ipc_dir, remove_ipc_dir

__all__ = ["StageProcesses", "peers_of", "WiringError"]


class StageProcesses:
    """A run's stage processes and the driver's control channel to them, from start to teardown.

    ``payloads[g]`` is what lead process g is built from (see :class:`~pipeq.control.driver.ProcessBackend`);
    ``placement`` the leads each node runs (multi-host, with ``rendezvous``). After :meth:`start`,
    ``ready[g]`` is process g's READY (the leads first, see :class:`~pipeq.control.processes.Numbering`).
    """

    def __init__(
        self, payloads: Sequence["bytes | StageBuilder"], setup: RunSetup,
        numbering: Numbering, *, rendezvous: Rendezvous | None, recorder: TraceRecorder | None,
    ) -> None:
        config = setup.config
        wire, fault = config.wire, config.fault
        self.payloads = list(payloads)
        self.schedule = config.schedule
        self.setup = setup
        self.numbering = numbering
        self.n_stages, self.replicas = numbering.n_stages, numbering.replicas
        self.n_processes = numbering.leads  # the processes the driver commands: each stage's shard 0
        self.n_all = numbering.total  # every process, the other shards included
        self.transport = "tcp" if rendezvous is not None else wire.transport
        self.host = rendezvous.bind if rendezvous is not None else wire.host
        self.start_method = config.placement.start_method
        self.heartbeat_timeout = fault.heartbeat_timeout
        self.step_timeout = fault.step_timeout  # None: a stage may compute one action for as long as it likes
        self.start_timeout = fault.start_timeout
        self.stop_timeout = fault.stop_timeout
        self.rendezvous = rendezvous
        placement = config.placement.placement
        self.placement = ([self._with_shards(node) for node in place_leads(
                              numbering, self.schedule, rendezvous.nnodes, rendezvous.nodes, placement)]
                          if rendezvous is not None else [list(range(self.n_all))])
        self.recorder = recorder
        self.store: Any = None
        self._republisher: rdzv.Republisher | None = None
        self.procs: dict[int, StageHandle] = {}
        self.server: ControlServer | None = None
        self.sup: Supervisor | None = None
        self.ipc_dir: str | None = None
        self.tp_dir: str | None = None  # where each stage's shards meet (tensor parallelism over tcp)
        self.ready: list[Ready] = []
        # fault_tolerance="replicas": the supervisor's absorb (pipeq.control.replica_loss)
        self.absorb: Callable[[int, Any], bool] | None = None
        self._bind: BindTo | None = None
        self._auth: WireAuth | None = None
        self._base_seed: int | None = None

    def _with_shards(self, leads: Sequence[int]) -> list[int]:
        """A node's processes: its leads and their other shards (a stage's shards share a host)."""
        return sorted(g for lead in leads for g in self.numbering.group(lead))

    # -- start-up --------------------------------------------------------------------------------------
    def start(self, request_id: Callable[[], int]) -> None:
        """Start every process and wire them up (``request_id`` numbers the commands on the way);
        a failure tears everything down before it is raised."""
        try:
            self._start(request_id)
        except BaseException:
            self.teardown()
            raise

    def _start(self, request_id: Callable[[], int]) -> None:
        bind, auth = self._open()
        self._bind, self._auth = bind, auth
        self.spawn()
        assert self.sup is not None and self.server is not None
        replies = self.sup.collect(Kind.READY, dict.fromkeys(range(self.n_all), 1),
                                   timeout=self.start_timeout, what="start", on_timeout=self.start_hint)
        self._stop_republishing()  # every node has read our entries: nothing reads them any more
        _unpublish(self.store)  # so an agent that comes later waits for a start it can join (a restart's)
        self.sup.expect_heartbeats()
        ready = [control.read(replies[g][0], Ready) for g in range(self.n_all)]  # checked as it came
        joined = request_id() if self.replicas > 1 else 0
        self.sup.send_all(self.peers(ready, joined))  # a stage gone since READY fails the run, named
        if self.replicas > 1:  # every replica has replica 0's weights (ACK) before the first step
            self.sup.collect(Kind.ACK, dict.fromkeys(range(self.n_processes), 1), step=joined,
                             timeout=self.start_timeout, what="replicas' start", on_timeout=self.replicas_hint)
        self.ready = ready
        if self.recorder is not None:
            self.recorder.measure_clocks(self.sup, request_id)

    def _open(self) -> tuple[BindTo, WireAuth | None]:
        """The control channel and its supervisor (and node 0's rendezvous entries): where the
        stages bind, and the job's secret over tcp."""
        rz = self.rendezvous
        if rz is not None:
            self.store = rz.store(self.start_timeout)
        if self.transport == "ipc":
            self.ipc_dir = make_ipc_dir()
            bind, auth = BindTo.ipc(self.ipc_dir), None
        else:  # tcp: the job's secret (multi-host), or one of our own (one host)
            secret = rz.secret if rz is not None and rz.secret is not None else JobSecret.generate()
            bind, auth = BindTo.tcp(self.host), WireAuth(secret, self.setup.config.wire.tcp_security)
        if self.numbering.shards > 1 or self.replicas > 1:  # where each stage's processes meet (pipeq.parallel.mesh)
            self.tp_dir = self.ipc_dir if self.ipc_dir is not None else make_ipc_dir()
        self.server = ControlServer(bind, auth)
        self.sup = Supervisor(self.server, self.procs, n_stages=self.n_stages, n_processes=self.n_all,
                              numbering=self.numbering, n_nodes=len(self.placement),
                              heartbeat_timeout=self.heartbeat_timeout, step_timeout=self.step_timeout,
                              teardown=self.teardown)
        self.sup.absorb = self.absorb
        if rz is not None:  # tell the other nodes where to find us and what each of them runs
            self._publish(rz)
        return bind, auth

    def spawn(self, processes: Sequence[int] | None = None, generation: int = 0) -> None:
        """Start this node's processes (or ``processes`` of them again: a lost replica's,
        fault_tolerance="replicas", with the seeds they had, started for the ``generation``-th time)."""
        assert self.server is not None and self._bind is not None
        bind, auth = self._bind, self._auth
        ctx = process_context(self.start_method, compiles=bool(self.setup.config.numerics.compile))
        # stage seeds come from the caller's RNG: torch.manual_seed before the runner repeats a run
        if self._base_seed is None:
            self._base_seed = int(torch.randint(0, 2**62, ()).item())
        base_seed = self._base_seed

        def seed_of(g: int) -> int:
            payload = self.payloads[g]
            return payload.seed_for(g % self.n_stages) if isinstance(payload, StageBuilder) else base_seed + g

        configs = worker_configs(
            self.placement[0] if processes is None else processes, self.n_stages, self.replicas, self.setup,
            control_addr=self.server.address, bind=bind, seed_of=seed_of, rendezvous=self.rendezvous,
            die_with_parent=threading.current_thread() is threading.main_thread(), auth=auth,
            tp_dir=self.tp_dir, generation=generation,
        )
        if processes is not None:  # started again: an injected fault (PIPEQ_FAULT) fired in the first start only
            configs = [dataclasses.replace(c, fault=None) for c in configs]
        self.procs.update(start_workers(ctx, configs, lambda g: self.payloads[self.numbering.lead(g)]))

    def peers(self, ready: list[Ready], joined: int, rejoin_round: int | None = None) -> list[tuple[int, Message]]:
        """Each lead's PEERS (:func:`peers_of`); a READY that cannot be wired fails the run, naming its stage."""
        try:
            return peers_of(self.numbering, ready, joined, rejoin_round)
        except WiringError as exc:
            assert self.sup is not None
            raise self.sup.fail(self.sup.error(exc.reason, exc.g)) from None

    def _publish(self, rz: Rendezvous) -> None:
        """Write node 0's signed entries (control last: agents read it first) and keep them
        there until every stage is READY (see :class:`pipeq.control.rendezvous.Republisher`)."""
        entries: dict[str, object] = {
            "placement": self.placement,
            "job": job_identity(self.payloads[0], self.schedule, self.setup.numerics, self.setup.tp_plans),
            "options": {"trace": self.recorder is not None, "replicas": self.replicas,
                        "tcp_security": self.setup.config.wire.tcp_security, "shards": self.numbering.shards},
            "control": self.server.address if self.server is not None else None,
        }
        signed = {key: rz.sign(key, value) for key, value in entries.items()}
        for key, raw in signed.items():
            self.store.set(key, raw)
        self._republisher = rdzv.Republisher(rz, signed, timeout=min(self.start_timeout, 10.0)).start()

    def _stop_republishing(self) -> None:
        if self._republisher is not None:
            self._republisher.stop()
            self._republisher = None

    # -- stopping --------------------------------------------------------------------------------------
    def stop(self, request_id: Callable[[], int], cut_short: bool, failed: bool = False) -> None:
        """Stop every worker and remove the ipc files; ``failed``: the driver ends the run on an
        error of its own (see :meth:`teardown`).

        Two phases: STOP lets each stage finish what it was sent and answer ACK (so an error in
        the last step still reaches the caller, and no message is in flight any more); EXIT
        then ends the processes. Stragglers are killed. ``cut_short``: a command's per-stage
        sends were interrupted (by Ctrl-C): the stages that got it cannot finish it without the
        others, so STOP would wait for stop_timeout in vain; they are torn down at once.
        """
        sup = self.sup
        if self.server is None or sup is None or sup.failure is not None or cut_short:
            self.teardown(failed)
            return
        merged = None
        try:
            req = request_id()
            everyone = [g for g in range(self.n_processes) if g not in sup.ignored]  # (a dropped replica's: gone)
            sup.send_all([(g, control.message(Stop(), req)) for g in everyone])
            sup.collect(Kind.ACK, dict.fromkeys(everyone, 1), step=req, timeout=self.stop_timeout, what="stop")
            if self.recorder is not None:
                merged = self.recorder.fetch(sup, request_id, [r.host for r in self.ready[:self.n_processes]])
            sup.send_all([(g, control.message(Exit(), req)) for g in everyone])
            deadline = time.monotonic() + EXIT_S
            for p in self.procs.values():
                p.join(max(0.0, deadline - time.monotonic()))
        finally:  # whatever happened (Ctrl-C included), no process or ipc file outlives stop()
            self.teardown(failed)
        if merged is not None and self.recorder is not None:
            self.recorder.write(merged)

    def teardown(self, failed: bool = False) -> None:
        """Stop every process (telling remote ones and the node agents to go), close the control
        channel, remove the ipc files. The agents are told whether the run failed (a stage's
        failure, or ``failed``: the driver's own error, such as a full disk): then they exit
        non-zero too, unless node 0 starts the run again."""
        self._stop_republishing()
        if self.server is not None and self.rendezvous is not None:
            # Remote stages and agents: tell them to go (their agents also see us vanish).
            abort = control.message(Exit(abort=failed or (self.sup is not None and self.sup.failure is not None)))
            for g in range(self.n_all):
                if g not in self.procs:
                    self.server.send_best_effort(STAGE, g, abort)
            for node in range(1, len(self.placement)):
                self.server.send_best_effort(AGENT, node, abort)
        stop_processes(list(self.procs.values()))
        self.procs.clear()
        if self.server is not None:
            self.server.close(linger_ms=500 if self.rendezvous is not None else 0)
            self.server = None
        if self.ipc_dir is not None:  # segments no stage got to unlink (a stage killed early)
            shm.remove_segments(shm.run_prefix(self.ipc_dir))
        remove_ipc_dir(self.ipc_dir)
        if self.tp_dir is not None and self.tp_dir != self.ipc_dir:
            remove_ipc_dir(self.tp_dir)
        self.ipc_dir = self.tp_dir = None
        # node 0 hosts the rendezvous store: its port closes with the last reference (TCPStore has
        # no close), here rather than whenever the garbage collector reaches this driver
        self.store = None

    # -- hints for a start-up that timed out -------------------------------------------------------------
    def start_hint(self, missing: set[int]) -> str:
        """Multi-host start-up: which missing stages reached the rendezvous, and where they run.

        A node whose entries ("agent/r", "stage/g") are there but not signed with this node's
        secret is named: it was most likely started with another secret."""
        rz = self.rendezvous
        if self.store is None or rz is None:
            return ""
        hints = []
        for node, stages in enumerate(self.placement):
            lost = [k for k in stages if k in missing]
            if not lost:
                continue
            found = {k: self._entry_state(rz, f"stage/{k}") for k in lost}
            agent = self._entry_state(rz, f"agent/{node}") if node > 0 else rdzv.MISSING
            seen = [k for k in lost if found[k] == rdzv.VALID]
            foreign = [f"stage/{k}" for k in lost if found[k] == rdzv.FOREIGN]
            if agent == rdzv.FOREIGN:
                foreign.insert(0, f"agent/{node}")
            if seen:
                hints.append(f"stage(s) {seen} (node {node}) registered at the rendezvous but never "
                             f"reached the control channel {self.server.address if self.server else ''}: "
                             f"is that port reachable from node {node}?")
            if foreign:
                hints.append(f"node {node} uses another secret: its entries {foreign} at the rendezvous "
                             f"{rz.master_addr}:{rz.master_port} are not signed with this node's; pass "
                             "the same --secret-file (or PIPEQ_SECRET) on every node")
            elif len(seen) < len(lost) and agent == rdzv.VALID:
                hints.append(f"node {node}'s agent reached the rendezvous but its stage(s) "
                             f"{[k for k in lost if k not in seen]} never registered: see node {node}'s log")
            elif len(seen) < len(lost):
                hints.append(f"stage(s) {[k for k in lost if k not in seen]} (node {node}) never "
                             f"registered at the rendezvous {rz.master_addr}:{rz.master_port}: is "
                             f"node {node} started (pipeq launch ... --node-rank {node})?")
        return "; ".join(hints)

    def replicas_hint(self, missing: set[int]) -> str:
        """Start-up with replicas: who is still waiting for (or sending) replica 0's weights."""
        stages = sorted({g % self.n_stages for g in missing})
        hint = f"stage(s) {stages} of the replicas did not make their group and exchange replica 0's weights"
        if self.rendezvous is not None:
            hint += ("; can each node reach the others' gloo (or NCCL) ports on the interface its stages bind "
                     "to (a firewall between the hosts)?")
        return hint

    def _entry_state(self, rz: Rendezvous, key: str) -> str:
        try:
            return rz.read(self.store, key)[0]
        except Exception:  # the store is gone: no hint from it
            return rdzv.MISSING


def _unpublish(store: Any) -> None:
    """Remove node 0's start entries from ``store`` (None: no store; best effort: whoever comes
    later finds nothing to join)."""
    if store is None:
        return
    for key in ("control", "placement", "job", "options"):
        try:
            store.delete_key(key)
        except Exception:  # the store is going away: nothing to join there either
            return


class WiringError(Exception):
    """Process ``g``'s READY cannot be wired: ``reason`` says why."""

    def __init__(self, reason: str, g: int) -> None:
        super().__init__(reason)
        self.reason, self.g = reason, g


def peers_of(num: Numbering, ready: Sequence[Ready], joined: int,
             rejoin_round: int | None = None) -> list[tuple[int, Message]]:
    """Each lead's PEERS, from every process's READY (``ready[g]``): its neighbours within the
    replica and its replica's tie links, by shard (once the stages' ties are checked to agree:
    each tie named alike by every stage holding a copy); ``rejoin_round``: for a rebuilt replica
    (see :class:`~pipeq.wire.control.Peers`). :class:`WiringError` names a READY that cannot be wired."""
    n = num.n_stages
    wrong = tie_mismatch([ready[k].layout.get("tie_stages") or {} for k in range(n)])
    if wrong is not None:
        raise WiringError(f"its tied weights do not match the other stages': {wrong[1]}", wrong[0])
    out = []
    for g in range(num.leads):
        k, r = g % n, g // n
        ties = [[ready[num.group(r * n + j)[s]].tie_link for j in range(n)] for s in range(num.shards)]
        peers = Peers(next_forward=ready[g + 1].forward if k + 1 < n else None,
                      prev_backward=ready[g - 1].backward if k > 0 else None,
                      tie_links=ties[0] if ready[g].tie_link is not None else None,
                      tie_shards=ties if ready[g].tie_link is not None and num.shards > 1 else None,
                      rejoin_round=rejoin_round)
        out.append((g, control.message(peers, joined)))
    return out
