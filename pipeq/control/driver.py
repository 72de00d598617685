"""Process mode's control plane: the driver commands one worker process per stage.

The driver owns the control channel's server end. :class:`~pipeq.control.startup.StageProcesses`
starts the workers and wires them to each other (and tears them down); :class:`ProcessBackend`
then sends the commands of the control protocol (:mod:`pipeq.wire.control`) and collects the
replies. Every wait is watched by a :class:`~pipeq.control.supervisor.Supervisor` (errors,
deaths, heartbeats); a failure stops every worker and removes the ipc directory before it is
raised.

    train:   TRAIN to each stage (x to stage 0, target to the loss stages, each stage's inputs to
             it) -> LOSS from the last
    predict: PREDICT to each stage (x to stage 0, each stage's inputs) -> OUTPUT per microbatch
             from the output stage
    state:   GET_STATE / SET_STATE, GET_SNAPSHOT / RESTORE, GET_LR, STEP_SCHEDULER, GET_STATS

With ``fault_tolerance="replicas"`` a replica whose stage fails in a training step is dropped,
the step finishes on the others and the replica is rebuilt before the next command
(:mod:`pipeq.control.replica_loss`); :attr:`ProcessBackend.degraded` records those steps.
"""

from __future__ import annotations

import dataclasses
import math
from pipeq.control.stage_handle import StageHandle
import time
from typing import Any, NamedTuple, Sequence

import torch

from pipeq.stage import microbatch
from pipeq.control.batching import Shard
from pipeq.control.stage_inputs import StageInputs
from pipeq.errors import PipelineError
from pipeq.stage.spec import StageBuilder
from pipeq.wire import control
from pipeq.wire.control import (GetStats, Loss, Lrs, Output, Predict, Restore, SetState, State, Stats,
                                StepScheduler, Train)
from pipeq.wire.messages import Kind, Message
from pipeq.control.processes import Numbering, RunSetup
from pipeq.control.rendezvous import Rendezvous
from pipeq.control.degraded import DegradedSteps
from pipeq.control.replica_loss import ReplicaLoss
from pipeq.parallel.data import survivor_scale
from pipeq.stage.executor import Tensors
from pipeq.control.startup import StageProcesses
from pipeq.control import snapshots
from pipeq.control.supervisor import Supervisor
from pipeq.control.trace_collector import TraceRecorder
from pipeq.wire.control_link import ControlServer

__all__ = ["ProcessBackend"]


class ProcessBackend:
    """Runs the stages as processes: all on this host, or (``rendezvous``) spread over nodes; a
    :class:`~pipeq.runtime.backend.Backend`.

    ``payloads[g]`` is what process g (replica g // N's stage g % N) is built from: a pickled
    :class:`~pipeq.runtime.executors.StageSpec`, or a :class:`~pipeq.runtime.executors.StageBuilder`
    (required for stages on other nodes, which their node's agent starts and which never receive
    pickles). ``setup`` is the run's configuration (:class:`~pipeq.control.config.RunConfig`) with
    what was checked against its stages (:class:`~pipeq.control.processes.RunSetup`): what every
    stage process is told is derived from it.

    With ``tensor_parallel = T > 1`` each stage runs on T processes (see
    :class:`~pipeq.control.processes.Numbering`): the driver commands shard 0 of each stage, which
    shares every command with its other shards (:mod:`pipeq.wire.shard_link`); it starts and
    watches them all.
    """

    def __init__(self, payloads: Sequence["bytes | StageBuilder"], setup: RunSetup, *,
                 rendezvous: Rendezvous | None = None) -> None:
        config = setup.config
        self.replicas = replicas = config.placement.data_parallel
        self.n_processes = len(payloads)  # the processes the driver commands: each stage's shard 0
        self.n_stages = n = self.n_processes // replicas
        self.numbering = Numbering(n, replicas, setup.shards)
        self.loss_stages = set(config.schedule.loss_stages(n))  # get the batch's target
        self.output_stage = config.schedule.output_stage(n)  # returns predict's output
        trace = config.trace_path
        self.recorder = (TraceRecorder(trace, config.schedule, n, config.microbatches, replicas)
                         if trace is not None else None)
        self.processes = StageProcesses(payloads, setup, self.numbering, rendezvous=rendezvous,
                                        recorder=self.recorder)
        self._request_id = 0
        # step -> (sent at ns, replicas, microbatches, each replica's loss-weight share, the replicas sent to)
        self._submitted: dict[int, tuple[int, int, int, list[float], list[int]]] = {}
        self._rounds = 0  # training steps sent: every replica's gradient rounds so far
        self._sending = False  # a TRAIN is being sent (a failure then is a training step's)
        self._done: dict[int, float] = {}  # losses collected before a rebuild, until result() asks
        self.replica_loss = (ReplicaLoss(self.processes, lambda: bool(self._submitted) or self._sending,
                                         lambda: (self._rounds - len(self._submitted) + 1, self._rounds), self._next_request_id,
                                         config.placement.shard_group)
                             if config.fault.fault_tolerance == "replicas" else None)
        #: fault_tolerance="replicas": the training steps a lost replica degraded, and where (else none)
        self.degraded = DegradedSteps(replicas, n, self.replica_loss.rounds if self.replica_loss else {})
        self._cut_short = False  # a command's sends were interrupted part-way (see _send_all)
        self.step_lrs: dict[int, float | None] = {}  # step -> its learning rate, until the runner takes it
        # asked a state or a prediction: replica 0's stages; with sharded replicas its whole shard group
        # (the stage's pieces are gathered: a collective, pipeq.stage.state)
        self.readers = range(config.placement.shard_group * n)
        self.snapshot_requests = snapshots.SnapshotRequests(n, len(self.readers))  # taken as they complete

    # -- lifecycle (pipeq.control.startup) ----------------------------------------------------------
    def start(self) -> None:
        """Start the stage processes and wire them up (see :meth:`StageProcesses.start`)."""
        self.processes.start(self._next_request_id)

    def close(self, failed: bool = False) -> None:
        """Stop every worker and remove the ipc files (see :meth:`StageProcesses.stop`)."""
        self.processes.stop(self._next_request_id, self._cut_short, failed)

    def _teardown(self) -> None:
        self.processes.teardown()

    def _start_hint(self, missing: set[int]) -> str:
        return self.processes.start_hint(missing)

    # the processes' state, under the names the runner and the tests know
    sup: "Supervisor | None" = property(lambda self: self.processes.sup)  # type: ignore[assignment]
    server: "ControlServer | None" = property(lambda self: self.processes.server)  # type: ignore[assignment]
    procs: "dict[int, StageHandle]" = property(lambda self: self.processes.procs)  # type: ignore[assignment]
    ipc_dir: "str | None" = property(lambda self: self.processes.ipc_dir)  # type: ignore[assignment]
    placement: "list[list[int]]" = property(lambda self: self.processes.placement)  # type: ignore[assignment]

    @property
    def store(self) -> Any:
        return self.processes.store

    @store.setter
    def store(self, store: Any) -> None:
        self.processes.store = store

    @property
    def worker_info(self) -> list[dict[str, Any]]:
        """Each process's READY, as plain data (the leads first)."""
        return [control.encode(ready) for ready in self.processes.ready]

    def _send_all(self, sup: Supervisor, messages: list[tuple[int, Message]]) -> None:
        """``sup.send_all``, noting a command whose per-stage sends KeyboardInterrupt (or SystemExit) cut short (see
        :meth:`close`; an exception leaves none: encoding fails before the first send, an unreachable stage fails the run)."""
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
        loss = self.replica_loss
        if loss is not None and loss.down and not self._submitted:  # nothing in flight: rebuild now
            loss.rebuild(self._rounds, self._next_request_id)
        return self.sup

    def _rebuild_lost(self) -> None:
        """A replica was lost: finish the steps in flight (losses kept for result()), then rebuild it."""
        loss = self.replica_loss
        if loss is not None and loss.down:
            for step in sorted(self._submitted):
                self._done[step] = self._result(step)
            self._usable()

    def ask_each(self, kind: Kind, reply: Kind, what: str, processes: Sequence[int]) -> dict[int, Message]:
        """Send ``kind`` to each of ``processes`` (process g: replica g // N's stage g % N) and
        collect one ``reply`` from each; ``what`` names the request in a failure."""
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

    def submit(self, step: int, shards: list[Shard], x: Any, target: Any, stream: bool = False,
               inputs: StageInputs | None = None) -> None:
        """Send one training step: replica r trains on the r-th shard of the batch (and of each
        stage's ``inputs``). It does not wait: each stage starts the step as soon as it is done
        with the ones sent before. With ``stream``, a schedule that need not drain between
        batches (asynchronous 1F1B) does not; :meth:`drain` ends the stream."""
        self._rebuild_lost()
        sup = self._usable()
        self._sending = True  # an ERROR read now is the step before's (its first stages finish it last)
        sup.drain_pending()  # (what it raises ends the run)
        self._sending = False
        shares = [math.fsum(weights) for _, weights, _ in shards]
        live = self.replica_loss.live() if self.replica_loss is not None else list(range(len(shards)))
        if sup.deferred is not None:  # a stage failed in an earlier step: this one cannot run;
            self._submitted[step] = (0, len(shards), len(shards[0][0]), shares, live)  # result() raises the error
            return
        msgs = []
        offset = first = 0  # the replica's first sample, and its first microbatch
        split = isinstance(x, microbatch.Microbatches)  # given as its microbatches: cut by microbatch
        for r, (sizes, weights, aux_weights) in enumerate(shards):
            n, count = sum(sizes), len(sizes)
            xs, x_tree = microbatch.pack(microbatch.shard(x, offset, n, first, count))
            ts, t_tree = microbatch.pack(microbatch.shard(target, offset, n, first, count))
            mine = _packed(inputs, offset, n, first, count)
            offset, first = offset + n, first + count
            if r not in live:
                continue  # lost (while other steps were in flight): its samples are not trained on
            for k in range(self.n_stages):
                part = _batch_part(xs if k == 0 else None, x_tree, ts if k in self.loss_stages else None, t_tree,
                                   mine[k] if mine is not None else None)
                train = Train(sizes=sizes, weights=weights, aux_weights=aux_weights, stream=stream, x=part.x,
                              nx=part.nx, inputs=part.inputs, ninputs=part.ninputs, target=part.target,
                              shares=shares if self.replica_loss is not None else None, split=split)
                msgs.append((r * self.n_stages + k, control.message(train, step, 0, part.tensors)))
        t0 = time.perf_counter_ns()
        self._sending = True
        try:
            self._send_all(sup, msgs)
        finally:
            self._sending = False
        self._rounds += 1
        self.degraded.sent(self._rounds, step)
        sup.awaited.add((Kind.LOSS, step))
        self._submitted[step] = (t0, len(shards), len(shards[0][0]), shares, live)

    def result(self, step: int) -> float:
        """Wait for a submitted step's loss (the whole batch's; with replicas lost in the step,
        the mean over the samples of the replicas that completed it)."""
        if step in self._done:
            return self._done.pop(step)
        loss = self._result(step)
        if self.replica_loss and self.replica_loss.down:  # rebuilt now if nothing is in flight: this step pays
            self._usable()
        return loss

    def _result(self, step: int) -> float:
        sup = self._usable()
        t0, n_shards, microbatches, shares, live = self._submitted[step]
        lasts = {r * self.n_stages + self.n_stages - 1: 1 for r in live}
        try:
            replies = sup.collect(Kind.LOSS, lasts, step=step, what=f"step {step}")
        finally:
            del self._submitted[step]
        if self.recorder is not None:
            self.recorder.span(step, True, t0, microbatches)
        # checked as they came; a replica dropped during the step sent none
        losses = {g: control.read(msgs[0], Loss) for g, msgs in replies.items() if msgs}
        self.step_lrs[step] = losses[min(losses)].lr  # the first replica's: every replica's is the same
        # each replica's loss is already weighted by its share of the batch: they add up
        total = sum(losses[g].loss for g in sorted(losses))
        if len(losses) < n_shards:  # the mean over the completed replicas' samples
            done = sorted(g // self.n_stages for g in losses)
            self.degraded.finished(step, done)
            total *= survivor_scale(shares, done, n_shards)
        return total

    def train(self, step: int, shards: list[Shard], x: Any, target: Any, stream: bool = False,
              inputs: StageInputs | None = None) -> float:
        self.submit(step, shards, x, target, stream, inputs)
        return self.result(step)

    def drain(self) -> None:
        """End a stream: every stage finishes its leftover work (asynchronous 1F1B's last backwards)."""
        self.ask_each(Kind.DRAIN, Kind.ACK, "drain", range(self.n_processes))

    def predict(self, step: int, sizes: list[int], x: Any, inputs: StageInputs | None = None) -> list[Tensors]:
        sup = self._usable()
        xs, x_tree = microbatch.pack(x)
        mine = _packed(inputs, 0, sum(sizes), 0, len(sizes))
        t0 = time.perf_counter_ns()
        split, n, out = isinstance(x, microbatch.Microbatches), self.n_stages, self.output_stage
        self._send_all(sup, [(g, _predict(step, sizes, xs, x_tree, mine, g % n, split)) for g in self.readers])
        outs = {g: len(sizes) for g in self.readers if g % n == out}  # sharded replicas': replica 0's is taken
        outputs = sup.collect(Kind.OUTPUT, outs, step=step, what=f"predict {step}")[out]
        if self.recorder is not None:
            self.recorder.span(step, False, t0, len(sizes))
        outputs.sort(key=lambda m: m.microbatch)
        return [microbatch.Packed.of(m.tensors, control.read(m, Output).tree) for m in outputs]

    def stats(self, reset: bool = False, memory: bool = False) -> list[dict[str, Any]]:
        """Every stage's stats and bytes (replica 0's; ``memory``: every replica's, see the Backend)."""
        sup = self._usable()
        req = self._next_request_id()
        stages = range(self.n_processes if memory else self.n_stages)
        self._send_all(sup, [(k, control.message(GetStats(reset=reset, measure=memory), req)) for k in stages])
        got = sup.collect(Kind.STATS, dict.fromkeys(stages, 1), step=req, what="stats")
        return [dataclasses.asdict(control.read(got[k][0], Stats)) for k in stages]

    def get_state(self) -> list[tuple[list[str], list[torch.Tensor]]]:
        got = self.ask_each(Kind.GET_STATE, Kind.STATE, "state_dict", self.readers)
        return [(list(control.read(got[k], State).names), list(got[k].tensors)) for k in range(self.n_stages)]

    def set_state(self, per_stage: list[tuple[list[str], list[torch.Tensor]]]) -> None:
        sup = self._usable()
        req = self._next_request_id()
        self._send_all(sup, [(r * self.n_stages + k, control.message(SetState(names=list(names)), req, 0, tensors))
                             for r in range(self.replicas) for k, (names, tensors) in enumerate(per_stage)])
        sup.collect(Kind.ACK, dict.fromkeys(range(self.n_processes), 1), step=req, what="load_state_dict")

    def get_snapshots(self) -> list[dict[str, Any]]:
        """Every stage's snapshot (see :meth:`StageExecutor.snapshot`), tensors included."""
        got = self.ask_each(Kind.GET_SNAPSHOT, Kind.SNAPSHOT, "save", self.readers)
        out = []
        for k in range(self.n_stages):
            try:
                out.append(control.state_of(got[k]))
            except ValueError as exc:  # a CodecError: a tensor reference out of range
                sup = self._usable()
                raise sup.fail(sup.error(f"malformed snapshot: {exc}", k))
        return out

    def request_snapshots(self, step: int) -> None:
        """Ask every stage for its snapshot, behind the commands sent (the answers are kept by
        :class:`~pipeq.control.snapshots.SnapshotRequests`)."""
        sup = self._usable()
        self._send_all(sup, self.snapshot_requests.ask(sup, self._next_request_id(), step))

    def take_snapshots(self) -> list[tuple[int, list[dict[str, Any]]]]:
        """The snapshots complete so far, as (step, per stage); never waits."""
        return self.snapshot_requests.take(self.sup)

    def restore(self, snapshots: list[dict[str, Any]]) -> None:
        sup = self._usable()
        req = self._next_request_id()
        msgs = []
        for k, snap in enumerate(snapshots):
            msg = control.state_message(Restore, req, snap, f"stage {k}'s snapshot")
            msgs += [(r * self.n_stages + k, msg) for r in range(self.replicas)]  # every replica
        self._send_all(sup, msgs)
        sup.collect(Kind.ACK, dict.fromkeys(range(self.n_processes), 1), step=req, what="load")

    def layouts(self) -> list[dict[str, Any]]:
        return [ready.layout for ready in self.processes.ready[:self.n_stages]]

    def declared_inputs(self) -> list[tuple[str, ...]]:
        """The inputs each stage declares (:class:`pipeq.StageInfo`), as its READY said."""
        return [tuple(ready.inputs or ()) for ready in self.processes.ready[:self.n_stages]]

    def scheduler_step(self, metric: float | None) -> None:
        """Step every process's lr schedulers once (every replica's: they stay alike)."""
        sup = self._usable()
        req = self._next_request_id()
        self._send_all(sup, [(g, control.message(StepScheduler(metric=metric), req)) for g in range(self.n_processes)])
        sup.collect(Kind.ACK, dict.fromkeys(range(self.n_processes), 1), step=req, what="scheduler_step")

    def learning_rates(self) -> list[list[float]]:
        """Each stage's learning rates (replica 0's), per parameter group."""
        got = self.ask_each(Kind.GET_LR, Kind.LR, "learning_rates", range(self.n_stages))
        return [control.read(got[k], Lrs).lrs for k in range(self.n_stages)]  # checked as they came


class _Part(NamedTuple):
    """What one stage's TRAIN / PREDICT carries of a batch: x's tensors (stage 0), the stage's
    inputs' and the target's (the stages that compute a loss), in that order, and their trees
    when they are not a lone tensor (the inputs' always: a dict)."""

    tensors: list[torch.Tensor]
    x: Any = None
    nx: int | None = None  # x's tensors, first in ``tensors`` (without it: 1 at stage 0, else 0)
    target: Any = None
    inputs: Any = None
    ninputs: int | None = None  # the inputs' tensors, after x's


def _predict(step: int, sizes: list[int], xs: list[torch.Tensor], x_tree: Any, mine: Any, k: int,
             split: bool) -> Message:
    """Stage ``k``'s PREDICT of a batch (x's tensors ``xs``, the stages' inputs ``mine``)."""
    part = _batch_part(xs if k == 0 else None, x_tree, None, None, mine[k] if mine is not None else None)
    predict = Predict(sizes=sizes, x=part.x, nx=part.nx, inputs=part.inputs, ninputs=part.ninputs, split=split)
    return control.message(predict, step, 0, part.tensors)


def _batch_part(xs: list[torch.Tensor] | None, x_tree: Any, ts: list[torch.Tensor] | None, t_tree: Any,
                packed_inputs: tuple[list[torch.Tensor], Any] | None = None) -> _Part:
    tensors: list[torch.Tensor] = []
    x = nx = target = inputs = ninputs = None
    if xs is not None:
        tensors += xs
        if x_tree is not None:
            x, nx = x_tree, len(xs)
    if packed_inputs is not None:
        tensors += packed_inputs[0]
        inputs, ninputs = packed_inputs[1], len(packed_inputs[0])
    if ts is not None:
        tensors += ts
        target = t_tree
    return _Part(tensors, x, nx, target, inputs, ninputs)


def _packed(inputs: StageInputs | None, start: int, length: int, first: int = 0,
            count: int | None = None) -> list[tuple[list[torch.Tensor], Any] | None] | None:
    """Each stage's inputs, samples ``start .. start + length`` (microbatches ``first .. first +
    count`` of a batch given as its microbatches, None: to the last): a replica's shard, packed
    for the wire; None without any."""
    if inputs is None:
        return None
    return [microbatch.pack(microbatch.shard(mine, start, length, first, count)) if mine is not None else None
            for mine in inputs]
