"""Process mode's control plane: starts one worker process per stage and commands them.

The driver owns the control channel's server end. It starts the workers (multiprocessing
``spawn`` or ``forkserver``: each stage's :class:`~pipeq.executors.StageSpec` is handed over at
process start, never over a socket), waits for each to report READY with its bound addresses,
tells every worker its neighbours' addresses (and, with data parallelism, its stage's other
replicas'), and then sends commands and collects replies.
Every wait is watched by a :class:`~pipeq.supervisor.Supervisor` (errors, deaths, heartbeats);
a failure stops every worker and removes the ipc directory before it is raised. Workers die
with the driver (a pidfd watch, or PR_SET_PDEATHSIG).

    start:   spawn stages -> READY (addresses) from each -> PEERS to each [-> ACK from each: the
             replicas hold replica 0's weights (data parallelism)]
    train:   TRAIN to each stage (x to stage 0, target to the loss stages) -> LOSS from the last
    close:   STOP to each -> ACK from each (nothing in flight) -> [traces] -> EXIT to each
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from typing import Any, Sequence

import torch

from pipeq.stage import microbatch
from pipeq.wire import shm
from pipeq.control import rendezvous as rdzv
from pipeq.control.batching import Shard
from pipeq.errors import PipelineError
from pipeq.stage.spec import StageBuilder
from pipeq.wire.messages import Kind, Message, tree_message, tree_of
from pipeq.control.processes import (Numbering, StageSettings, job_identity, process_context, start_worker,
                        stop_processes, worker_configs)
from pipeq.control.rendezvous import Rendezvous
from pipeq.stage.executor import Tensors
from pipeq.control.supervisor import Supervisor
from pipeq.control.trace_collector import TraceRecorder
from pipeq.wire.keys import JobSecret
from pipeq.wire.control_link import AGENT, STAGE, ControlServer
from pipeq.wire.security import WireAuth
from pipeq.wire.sockets import BindTo, make_ipc_dir, remove_ipc_dir

class ProcessBackend:
    """Runs the stages as processes: all on this host, or (``rendezvous``) spread over nodes.

    ``payloads[g]`` is what process g (replica g // N's stage g % N) is built from: a pickled
    :class:`~pipeq.executors.StageSpec`, or a :class:`~pipeq.executors.StageBuilder` (required
    for stages on other nodes, which their node's agent starts and which never receive pickles).
    ``loss_stages`` get the batch's target; ``output_stage`` returns predict's output.

    With ``settings.tensor_parallel = T > 1`` each stage runs on T processes (see
    :class:`~pipeq.processes.Numbering`): the driver commands shard 0 of each stage, which shares
    every command with its other shards (:mod:`pipeq.shardlink`); it starts and watches them all.
    """

    def __init__(
        self,
        payloads: Sequence["bytes | StageBuilder"],
        schedule: Any,
        settings: StageSettings,
        *,
        replicas: int = 1,
        loss_stages: Sequence[int],
        output_stage: int,
        microbatches: int,
        transport: str = "ipc",
        host: str = "127.0.0.1",
        start_method: str = "spawn",
        heartbeat_timeout: float = 15.0,
        step_timeout: float | None = None,
        start_timeout: float = 120.0,
        stop_timeout: float = 60.0,
        rendezvous: Rendezvous | None = None,
        placement: Sequence[Sequence[int]] | None = None,
        trace_path: str | None = None,
    ) -> None:
        self.payloads = list(payloads)
        self.schedule = schedule
        self.settings = settings
        self.replicas = replicas
        self.n_processes = len(payloads)  # the processes the driver commands: each stage's shard 0
        self.n_stages = self.n_processes // replicas
        self.numbering = Numbering(self.n_stages, replicas, settings.tensor_parallel)
        self.n_all = self.numbering.total  # every process, the other shards included
        self.loss_stages = set(loss_stages)
        self.output_stage = output_stage
        self.transport = "tcp" if rendezvous is not None else transport
        self.host = rendezvous.bind if rendezvous is not None else host
        self.start_method = start_method
        self.heartbeat_timeout = heartbeat_timeout
        self.step_timeout = step_timeout  # None: a stage may compute one action for as long as it likes
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.rendezvous = rendezvous
        self.placement = ([self._with_shards(node) for node in rdzv.placement(self.n_processes, rendezvous.nnodes,
                                                                                placement)]
                          if rendezvous is not None else [list(range(self.n_all))])
        self.recorder = (TraceRecorder(trace_path, schedule, self.n_stages, microbatches, replicas)
                         if trace_path is not None else None)
        self.store: Any = None
        self._republisher: rdzv.Republisher | None = None
        self.procs: dict[int, mp.process.BaseProcess] = {}
        self.server: ControlServer | None = None
        self.sup: Supervisor | None = None
        self.ipc_dir: str | None = None
        self.tp_dir: str | None = None  # where each stage's shards meet (tensor parallelism over tcp)
        self.worker_info: list[dict[str, Any]] = []
        self._request_id = 0
        self._submitted: dict[int, tuple[int, int, int]] = {}  # step -> (sent at ns, replicas, microbatches)
        self._cut_short = False  # a command's sends were interrupted part-way (see _send_all)
        self.step_lrs: dict[int, float | None] = {}  # step -> its learning rate, until the runner takes it

    def _with_shards(self, leads: Sequence[int]) -> list[int]:
        """A node's processes: its leads and their other shards (a stage's shards share a host)."""
        return sorted(g for lead in leads for g in self.numbering.group(lead))

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self._teardown()
            raise

    def _start(self) -> None:
        rz = self.rendezvous
        if rz is not None:
            self.store = rz.store(self.start_timeout)
        if self.transport == "ipc":
            self.ipc_dir = make_ipc_dir()
            bind, auth = BindTo.ipc(self.ipc_dir), None
        else:  # tcp: the job's secret (multi-host), or one of our own (one host)
            secret = rz.secret if rz is not None and rz.secret is not None else JobSecret.generate()
            bind, auth = BindTo.tcp(self.host), WireAuth(secret, self.settings.tcp_security)
        if self.numbering.shards > 1:
            self.tp_dir = self.ipc_dir if self.ipc_dir is not None else make_ipc_dir()
        self.server = ControlServer(bind, auth)
        self.sup = Supervisor(self.server, self.procs, n_stages=self.n_stages, n_processes=self.n_all,
                              numbering=self.numbering,
                              n_nodes=len(self.placement), heartbeat_timeout=self.heartbeat_timeout,
                              step_timeout=self.step_timeout, teardown=self._teardown)
        if rz is not None:  # tell the other nodes where to find us and what each of them runs
            self._publish(rz)
        ctx = process_context(self.start_method)
        # stage seeds come from the caller's RNG: torch.manual_seed before the runner repeats a run
        base_seed = int(torch.randint(0, 2**62, ()).item())

        def seed_of(g: int) -> int:
            payload = self.payloads[g]
            return payload.seed_for(g % self.n_stages) if isinstance(payload, StageBuilder) else base_seed + g

        configs = worker_configs(
            self.placement[0], self.n_stages, self.replicas, self.schedule, self.settings,
            control_addr=self.server.address, bind=bind, seed_of=seed_of, rendezvous=rz,
            die_with_parent=threading.current_thread() is threading.main_thread(), auth=auth,
            tp_dir=self.tp_dir,
        )
        for cfg in configs:
            self.procs[cfg.process] = start_worker(ctx, cfg, self.payloads[self.numbering.lead(cfg.process)])
        replies = self.sup.collect(Kind.READY, dict.fromkeys(range(self.n_all), 1),
                                   timeout=self.start_timeout, what="start", on_timeout=self._start_hint)
        self._stop_republishing()  # every node has read our entries: nothing reads them any more
        self.sup.expect_heartbeats()
        ready = {g: msgs[0].extra for g, msgs in replies.items()}
        peers = []
        joined = self._next_request_id() if self.replicas > 1 else 0
        for g in range(self.n_processes):  # neighbours within the replica
            k = g % self.n_stages
            extra: dict[str, Any] = {}
            if k + 1 < self.n_stages:
                extra["next_forward"] = ready[g + 1]["forward"]
            if k > 0:
                extra["prev_backward"] = ready[g - 1]["backward"]
            if self.replicas > 1 and self.numbering.shards > 1:  # every shard's replicas, by shard
                groups = [self.numbering.group(r * self.n_stages + k) for r in range(self.replicas)]
                extra["replica_shards"] = [[ready[group[s]]["replica_link"] for group in groups]
                                           for s in range(self.numbering.shards)]
            elif self.replicas > 1:  # the same stage's replicas, by replica (gradients, start-up weights)
                extra["replicas"] = [ready[r * self.n_stages + k]["replica_link"] for r in range(self.replicas)]
            peers.append((g, Message(Kind.PEERS, joined, extra=extra)))
        self.server.send_many(peers)
        if self.replicas > 1:  # every replica has replica 0's weights (ACK) before the first step
            self.sup.collect(Kind.ACK, dict.fromkeys(range(self.n_processes), 1), step=joined,
                             timeout=self.start_timeout, what="replicas' start", on_timeout=self._replicas_hint)
        self.worker_info = [ready[g] for g in range(self.n_all)]  # the leads first (Numbering)
        if self.recorder is not None:
            self.recorder.measure_clocks(self.sup, self._next_request_id)

    def _publish(self, rz: Rendezvous) -> None:
        """Write node 0's signed entries (control last: agents read it first) and keep them
        there until every stage is READY (see :class:`pipeq.rendezvous.Republisher`)."""
        entries: dict[str, object] = {
            "placement": self.placement,
            "job": job_identity(self.payloads[0], self.schedule, self.settings.numerics, self.settings.tp_plans),
            "options": {"trace": self.recorder is not None, "replicas": self.replicas,
                        "tcp_security": self.settings.tcp_security, "shards": self.numbering.shards},
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

    def close(self) -> None:
        """Stop every worker and remove the ipc files.

        Two phases: STOP lets each stage finish what it was sent and answer ACK (so an error in
        the last step still reaches the caller, and no message is in flight any more); EXIT
        then ends the processes. Stragglers are killed.
        """
        sup = self.sup
        if self.server is None or sup is None or sup.failure is not None or self._cut_short:
            # (a command cut short between its per-stage sends, by Ctrl-C: the stages that got it
            # cannot finish it without the others, so STOP would wait for stop_timeout in vain)
            self._teardown()
            return
        merged = None
        try:
            req = self._next_request_id()
            everyone = range(self.n_processes)
            sup.send_all([(g, Message(Kind.STOP, req)) for g in everyone])
            sup.collect(Kind.ACK, dict.fromkeys(everyone, 1), step=req, timeout=self.stop_timeout, what="stop")
            if self.recorder is not None:
                merged = self.recorder.fetch(sup, self._next_request_id,
                                             [str(info.get("host", "")) for info in
                                              self.worker_info[:self.n_processes]])
            sup.send_all([(g, Message(Kind.EXIT, req)) for g in everyone])
            deadline = time.monotonic() + 5.0
            for p in self.procs.values():
                p.join(max(0.0, deadline - time.monotonic()))
        finally:  # whatever happened (Ctrl-C included), no process or ipc file outlives close()
            self._teardown()
        if merged is not None and self.recorder is not None:
            self.recorder.write(merged)

    def _teardown(self) -> None:
        self._stop_republishing()
        if self.server is not None and self.rendezvous is not None:
            # Remote stages and agents: tell them to go (their agents also see us vanish).
            abort = Message(Kind.EXIT, extra={"abort": self.sup is not None and self.sup.failure is not None})
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

    def _start_hint(self, missing: set[int]) -> str:
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

    def _replicas_hint(self, missing: set[int]) -> str:
        """Start-up with replicas: who is still waiting for (or sending) replica 0's weights."""
        stages = sorted({g % self.n_stages for g in missing})
        hint = f"stage(s) {stages} of the replicas did not exchange replica 0's weights"
        if self.rendezvous is not None:
            hint += ("; is every stage process's replicas port (READY's 'replica_link') reachable from "
                     "the nodes of the same stage's other replicas?")
        return hint

    def _entry_state(self, rz: Rendezvous, key: str) -> str:
        try:
            return rz.read(self.store, key)[0]
        except Exception:  # the store is gone: no hint from it
            return rdzv.MISSING

    def _send_all(self, sup: Supervisor, messages: list[tuple[int, Message]]) -> None:
        """``sup.send_all``, noting a command whose per-stage sends were cut short by
        KeyboardInterrupt (or SystemExit) between them: see :meth:`close`. (An exception leaves
        no such command: a message that cannot be encoded fails before the first send, a stage
        that cannot be reached fails the run.)"""
        self._cut_short = True
        try:
            sup.send_all(messages)
        except Exception:
            self._cut_short = False
            raise
        self._cut_short = False

    def _next_request_id(self) -> int:
        self._request_id -= 1  # control requests count down, steps count up: never equal
        return self._request_id

    def _usable(self) -> Supervisor:
        if self.sup is not None:
            self.sup.check_usable()
        if self.server is None or self.sup is None:
            raise PipelineError("the pipeline is not running; use 'with runner:' or runner.start()")
        return self.sup

    def _ask_each(self, kind: Kind, reply: Kind, what: str, processes: Sequence[int]) -> dict[int, Message]:
        """Send ``kind`` to each of ``processes`` and collect one ``reply`` from each."""
        sup = self._usable()
        req = self._next_request_id()
        self._send_all(sup, [(g, Message(kind, req)) for g in processes])
        got = sup.collect(reply, dict.fromkeys(processes, 1), step=req, what=what)
        return {g: msgs[0] for g, msgs in got.items()}

    # -- commands --------------------------------------------------------------------------
    @property
    def failing(self) -> bool:
        """A stage has failed in a step still ahead of the caller (see Supervisor.deferred)."""
        return self.sup is not None and self.sup.deferred is not None

    def submit(self, step: int, shards: list[Shard], x: Any, target: Any, stream: bool = False) -> None:
        """Send one training step: replica r trains on the r-th shard of the batch. It does not
        wait: each stage starts the step as soon as it is done with the ones sent before. With
        ``stream``, a schedule that need not drain between batches (asynchronous 1F1B) does not;
        :meth:`drain` ends the stream."""
        sup = self._usable()
        sup.drain_pending()
        if sup.deferred is not None:  # a stage failed in an earlier step: this one cannot run;
            self._submitted[step] = (0, len(shards), len(shards[0][0]))  # result() raises the error
            return
        msgs = []
        offset = 0
        for r, (sizes, weights, aux_weights) in enumerate(shards):
            n = sum(sizes)
            xs, x_tree = microbatch.pack(microbatch.narrow(x, offset, n))
            ts, t_tree = microbatch.pack(microbatch.narrow(target, offset, n))
            offset += n
            extra: dict[str, Any] = {"sizes": sizes, "weights": weights}
            if aux_weights is not None:
                extra["aux_weights"] = aux_weights
            if stream:
                extra["stream"] = True
            for k in range(self.n_stages):
                tensors, more = _batch_part(xs if k == 0 else None, x_tree,
                                            ts if k in self.loss_stages else None, t_tree)
                msgs.append((r * self.n_stages + k, Message(Kind.TRAIN, step, 0, tensors, {**extra, **more})))
        t0 = time.perf_counter_ns()
        self._send_all(sup, msgs)
        sup.awaited.add((Kind.LOSS, step))
        self._submitted[step] = (t0, len(shards), len(shards[0][0]))

    def result(self, step: int) -> float:
        """Wait for a submitted step's loss (the whole batch's)."""
        sup = self._usable()
        t0, n_shards, microbatches = self._submitted.pop(step)
        lasts = {r * self.n_stages + self.n_stages - 1: 1 for r in range(n_shards)}
        replies = sup.collect(Kind.LOSS, lasts, step=step, what=f"step {step}")
        if self.recorder is not None:
            self.recorder.span(step, True, t0, microbatches)
        lr = replies[self.n_stages - 1][0].extra.get("lr")  # replica 0's: every replica's is the same
        self.step_lrs[step] = lr if type(lr) is float else None
        # each replica's loss is already weighted by its share of the batch: they add up
        return sum(float(replies[g][0].extra["loss"]) for g in lasts)

    def train(self, step: int, shards: list[Shard], x: Any, target: Any) -> float:
        self.submit(step, shards, x, target)
        return self.result(step)

    def drain(self) -> None:
        """End a stream: every stage finishes its leftover work (asynchronous 1F1B's last backwards)."""
        self._ask_each(Kind.DRAIN, Kind.ACK, "drain", range(self.n_processes))

    def predict(self, step: int, sizes: list[int], x: torch.Tensor) -> list[Tensors]:
        sup = self._usable()
        xs, x_tree = microbatch.pack(x)
        t0 = time.perf_counter_ns()
        msgs = []
        for k in range(self.n_stages):
            tensors, more = _batch_part(xs if k == 0 else None, x_tree, None, None)
            msgs.append((k, Message(Kind.PREDICT, step, 0, tensors, {"sizes": sizes, **more})))
        self._send_all(sup, msgs)
        out = self.output_stage
        msgs = sup.collect(Kind.OUTPUT, {out: len(sizes)}, step=step, what=f"predict {step}")[out]
        if self.recorder is not None:
            self.recorder.span(step, False, t0, len(sizes))
        msgs.sort(key=lambda m: m.microbatch)
        return [microbatch.Packed.of(m.tensors, m.extra.get("tree")) for m in msgs]

    def stats(self, reset: bool = False) -> list[dict[str, Any]]:
        """Every stage's :meth:`~pipeq.stage.StageExecutor.stats` (replica 0's)."""
        sup = self._usable()
        req = self._next_request_id()
        stages = range(self.n_stages)
        self._send_all(sup, [(k, Message(Kind.GET_STATS, req, extra={"reset": reset})) for k in stages])
        got = sup.collect(Kind.STATS, dict.fromkeys(stages, 1), step=req, what="stats")
        return [dict(got[k][0].extra) for k in stages]

    def get_state(self) -> list[tuple[list[str], list[torch.Tensor]]]:
        got = self._ask_each(Kind.GET_STATE, Kind.STATE, "state_dict", range(self.n_stages))
        return [(list(got[k].extra["names"]), list(got[k].tensors)) for k in range(self.n_stages)]

    def set_state(self, per_stage: list[tuple[list[str], list[torch.Tensor]]]) -> None:
        sup = self._usable()
        req = self._next_request_id()
        self._send_all(sup, [(r * self.n_stages + k, Message(Kind.SET_STATE, req, 0, tensors, {"names": names}))
                      for r in range(self.replicas) for k, (names, tensors) in enumerate(per_stage)])
        sup.collect(Kind.ACK, dict.fromkeys(range(self.n_processes), 1), step=req, what="load_state_dict")

    def get_snapshots(self) -> list[dict[str, Any]]:
        """Every stage's snapshot (see :meth:`StageExecutor.snapshot`), tensors included."""
        got = self._ask_each(Kind.GET_SNAPSHOT, Kind.SNAPSHOT, "save", range(self.n_stages))
        out = []
        for k in range(self.n_stages):
            try:
                out.append(tree_of(got[k], "snapshot"))
            except (ValueError, KeyError) as exc:  # CodecError is a ValueError
                sup = self._usable()
                raise sup.fail(sup.error(f"malformed snapshot: {exc}", k))
        return out

    def restore(self, snapshots: list[dict[str, Any]]) -> None:
        sup = self._usable()
        req = self._next_request_id()
        msgs = []
        for k, snap in enumerate(snapshots):
            msg = tree_message(Kind.RESTORE, req, "snapshot", snap, f"stage {k}'s snapshot")
            msgs += [(r * self.n_stages + k, msg) for r in range(self.replicas)]  # every replica
        self._send_all(sup, msgs)
        sup.collect(Kind.ACK, dict.fromkeys(range(self.n_processes), 1), step=req, what="load")

    def layouts(self) -> list[dict[str, Any]]:
        return [info["layout"] for info in self.worker_info[:self.n_stages]]

    def scheduler_step(self, metric: float | None) -> None:
        """Step every process's lr schedulers once (every replica's: they stay alike)."""
        sup = self._usable()
        req = self._next_request_id()
        self._send_all(sup, [(g, Message(Kind.STEP_SCHEDULER, req, extra={"metric": metric}))
                             for g in range(self.n_processes)])
        sup.collect(Kind.ACK, dict.fromkeys(range(self.n_processes), 1), step=req, what="scheduler_step")

    def learning_rates(self) -> list[list[float]]:
        """Each stage's learning rates (replica 0's), per parameter group."""
        got = self._ask_each(Kind.GET_LR, Kind.LR, "learning_rates", range(self.n_stages))
        out = []
        for k in range(self.n_stages):
            lrs = got[k].extra.get("lrs")
            if type(lrs) is not list or any(type(v) is not float for v in lrs):
                sup = self._usable()
                raise sup.fail(sup.error(f"malformed learning rates: {lrs!r}", k))
            out.append(lrs)
        return out

def _batch_part(xs: list[torch.Tensor] | None, x_tree: Any, ts: list[torch.Tensor] | None,
                t_tree: Any) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """What one stage's TRAIN / PREDICT carries of a batch: x's tensors (stage 0), the target's
    (the stages that compute a loss), and their trees when they are not a lone tensor."""
    tensors: list[torch.Tensor] = []
    extra: dict[str, Any] = {}
    if xs is not None:  # (without x the stage reads no x tensors: nx defaults to 0, 1 with a lone x)
        tensors += xs
        if x_tree is not None:
            extra["x"] = x_tree
            extra["nx"] = len(xs)
    if ts is not None:
        tensors += ts
        if t_tree is not None:
            extra["target"] = t_tree
    return tensors, extra
