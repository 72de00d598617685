"""The stage worker: one process per stage, pinned to its device, running an event loop.

The loop waits for a command on the control channel and carries it out:

    PEERS      connect the forward/backward channels to the neighbours' addresses (with tied
               weights: to the stages sharing them; with replicas: connect to the same stage's
               other replicas, start from replica 0's weights, reply ACK)
    TRAIN      run the schedule's actions for one batch (x rides along to stage 0, the target
               to the stages that compute a loss, its stage inputs to each stage that takes
               some: pipeq.runtime.batch_command); the last stage replies LOSS
    DRAIN      finish a stream's leftover work (asynchronous 1F1B's last backwards), reply ACK
    PREDICT    run forward-only actions; the output stage replies OUTPUT per microbatch
    GET_STATE  reply STATE (the stage module's state_dict tensors)
    SET_STATE  load them, reply ACK
    GET_SNAPSHOT  reply SNAPSHOT (parameters, optimizer and scheduler state, RNG: checkpoints)
    RESTORE    load a snapshot, reply ACK
    CLOCK      reply TIME with this process's clock (aligning traces)
    GET_TRACE  reply TRACE: the actions recorded since the last GET_TRACE (pipeq.trace)
    GET_STATS  reply STATS: peak memory (``reset``: start a new peak), skipped steps
    STEP_SCHEDULER  step the lr schedulers once (with the metric it carries), reply ACK
    GET_LR     reply LR (the learning rate of every parameter group)
    LOST       a replica is lost (fault_tolerance="replicas"): gradients are summed without it from
               the round it names on (a stage waiting for that replica's gradients takes it from the
               queue at once); reply ACK once the rounds before are summed
    REJOIN     the lost replica is rebuilt: reconnect to it, reply ACK
    STOP       (after every earlier command is done) reply ACK: all this stage's traffic is over
    EXIT       leave the loop

While a compute action (forward, backward, optimizer step) runs, the loop notes which one and
since when (the interpreter calls :meth:`EventLoop._note` as it starts one; cleared when the stage turns to its messages or its
next command): the heartbeat thread reports it (:meth:`EventLoop.doing`), so that the driver can
name a stage stuck in its own computation (``step_timeout``) rather than its waiting neighbours.

Every command is decoded with its payload's checks (:mod:`pipeq.wire.control`) before it is
carried out. Any exception is reported to the driver as ERROR (message and traceback) before the
process exits. The event loop is the only code in a worker that touches the transport; the schedule's
actions run in :func:`pipeq.runtime.interpreter.execute`, which asks the loop for every message.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pickle
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from pipeq.stage import microbatch
from pipeq import schedules
from pipeq.wire import shm
from pipeq.trace import format as trace
from pipeq.runtime import os_process
from pipeq.runtime.batch_command import batch_parts
from pipeq.runtime.faults import Fault, inject
from pipeq.runtime.executors import make_executor
from pipeq.runtime.interpreter import EMIT, TIES, StagePlan, execute
from pipeq.runtime.links import PeerLinks
from pipeq.stage.numerics import Numerics
from pipeq.wire import control
from pipeq.wire.control import (Ack, Clock, Drain, ErrorReply, Exit, GetLr, GetSnapshot, GetState, GetStats,
                                GetTrace, HeartbeatInfo, Loss, Lost, Lrs, Output, Payload, Peers, Predict, Ready,
                                Rejoin, Restore,
                                SetState, Snapshot, State, Stats, StepScheduler, Stop, Time, Train, TraceRows)
from pipeq.wire.messages import Message
from pipeq.schedules import Op
from pipeq.wire.shm import ShmConfig
from pipeq.stage.executor import StageExecutor
from pipeq.stage.info import info_of
from pipeq.stage.spec import StageBuilder, StageSpec
from pipeq.wire.control_link import Heartbeat
from pipeq.wire.errors import Stopped
from pipeq.wire.security import WireAuth
from pipeq.wire.sockets import BindTo, remove_ipc_dir, tune_process_allocator
from pipeq.wire.stage_link import StageTransport
from pipeq.errors import error_line, format_remote

__all__ = ["WorkerConfig", "EventLoop", "worker_entry", "select_device"]


@dataclass
class WorkerConfig:
    """Everything a stage process needs to know to start (plain data, see pipeq.control.processes)."""

    stage: int
    n_stages: int
    schedule: str | Callable[[int, int], list]  # a registered name or a schedule function/object
    control_addr: str
    bind: BindTo  # where this process binds its inbound sockets
    process: int  # its number among the run's processes (pipeq.control.processes.Numbering)
    device: str = "cpu"
    cores: list[int] = field(default_factory=list)
    threads: int = 1
    queue_capacity: int = 64
    max_frame_bytes: int = 256 << 20  # inbound data frames above this are refused
    auth: WireAuth | None = None  # tcp: the job's secret (handed over at start, never sent)
    heartbeat_interval: float = 1.0
    spin_s: float = 0.0
    die_with_parent: bool = True
    driver_pid: int = 0  # the process this one dies with: the driver, or its node's agent
    seed: int = 0
    # multi-host: the rendezvous store (host, port, key prefix) where this stage publishes its
    # endpoints; None on one host
    store: tuple[str, int, str] | None = None
    trace: bool = False  # record every action (pipeq.trace)
    # data parallelism: this process is replica ``replica`` of ``replicas`` of its stage
    replica: int = 0
    replicas: int = 1
    numerics: Numerics = field(default_factory=Numerics)  # precision, clipping, checks (pipeq.stage.numerics)
    shm_slots: int = 4  # ipc: shared-memory slots per data channel (pipeq.wire.shm); 0: ZeroMQ frames only
    # tensor parallelism: this process is shard ``shard`` of its stage's ``shards``; they meet in
    # the FileStore ``tp_store`` (in a private directory of this host; pipeq.parallel.tensor)
    shard: int = 0
    shards: int = 1
    tp_store: str | None = None
    tp_plan: Any = None  # how the stage's module is split over its shards (pipeq.parallel.tensor)
    fault: Fault | None = None  # a failure to inject on purpose (PIPEQ_FAULT: pipeq.runtime.faults)

    def shm(self) -> ShmConfig | None:
        """This process's shared-memory payloads: on one host (ipc), where the host has them."""
        if self.bind.scheme != "ipc" or self.shm_slots < 1 or not shm.available():
            return None
        return ShmConfig(shm.run_prefix(self.bind.ipc_dir), self.shm_slots, max_bytes=self.max_frame_bytes)


def _orphaned(cfg: WorkerConfig) -> None:
    """The driver is gone (killed, most likely): clean up what it cannot any more, and exit."""
    if cfg.bind.scheme == "ipc":
        shm.remove_segments(shm.run_prefix(cfg.bind.ipc_dir))
    remove_ipc_dir(cfg.bind.ipc_dir)
    os._exit(3)


def select_device(cfg: WorkerConfig) -> torch.device:
    """This stage's device; a CUDA device becomes the process's current one."""
    device = torch.device(cfg.device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


class EventLoop:
    """Serves the driver's commands on one stage process until EXIT."""

    def __init__(self, cfg: WorkerConfig, transport: StageTransport, executor: StageExecutor,
                 links: PeerLinks | None = None) -> None:
        self.cfg = cfg
        self.transport = transport
        self.executor = executor
        self.links = links  # data parallelism, tied weights: this stage's links to its replicas, tie peers
        self.step: int | None = None  # the TRAIN/PREDICT step being run (named in an ERROR)
        self.plan = StagePlan(cfg.schedule, cfg.stage, cfg.n_stages)
        self.trace: collections.deque[tuple[int, ...]] | None = (
            collections.deque(maxlen=trace.MAX_ROWS) if cfg.trace else None
        )
        self._rec = self.trace.append if self.trace is not None else None  # (the deque lives as long)
        # the compute action under way: (trace code, microbatch, monotonic start), None between
        # actions (waiting for a message or a command); read by the heartbeat thread
        self.current: tuple[int, int, float] | None = None
        self._keys: Any = None  # the running batch's microbatch -> (step, microbatch), see run
        if links is not None and links.replicas is not None:  # waiting for the replicas is no compute
            links.replicas.sync.note_wait = self._waiting
        self._paused: tuple[int, int, float] | None = None

    def _waiting(self, waits: bool) -> None:
        """The optimizer step waits for the other replicas' gradients (True), or goes on (False)."""
        if waits:
            self._paused, self.current = self.current, None
        elif self._paused is not None:
            code, j, _ = self._paused
            self._paused, self.current = None, (code, j, time.monotonic())

    def _note(self, code: int, j: int) -> None:
        """The interpreter starts compute action ``code`` on microbatch ``j``."""
        self.current = (code, j, time.monotonic())

    def doing(self) -> HeartbeatInfo:
        """The compute action under way and for how long (the heartbeat thread's report); an
        empty report while the stage is not computing (waiting for input, or for a command)."""
        cur = self.current
        if cur is None:
            return HeartbeatInfo()
        code, j, since = cur
        step = self.step or 0
        if code == trace.OPT_STEP:
            name = f"STEP(step {step})"
        else:
            keys = self._keys
            s, mb = keys.get(j, (step, j)) if keys is not None else (step, j)
            name = f"{trace.OPS[code][0]}(step {s}, microbatch {mb})"
        return HeartbeatInfo(doing=name, seconds=round(time.monotonic() - since, 3))

    def serve(self) -> None:
        """Carry out the driver's commands until EXIT."""
        transport = self.transport
        while True:
            msg = transport.next_control(1000)
            if msg is None:
                continue
            cmd = control.decode(msg)  # a malformed command raises: the driver gets it as ERROR
            if isinstance(cmd, Exit):
                return
            answer = self.answer(cmd, msg)
            if answer is not None:
                transport.send_control(answer)

    def answer(self, cmd: Payload, msg: Message) -> Message | None:
        """Carry out command ``cmd`` (which ``msg`` carries); the reply to send, if any."""
        ex, step = self.executor, msg.step
        if isinstance(cmd, (Train, Predict)):
            self.run_batch(cmd, msg)  # the last stage replies LOSS itself
            return None
        if isinstance(cmd, Drain):
            self.run(self.plan.drain(), self.step or 0, self.plan.keys)
        elif isinstance(cmd, GetState):
            names, tensors = ex.state_tensors()
            return control.message(State(names=names), step, 0, tensors)
        elif isinstance(cmd, SetState):
            ex.load_state(cmd.names, msg.tensors)
        elif isinstance(cmd, GetSnapshot):
            return control.state_message(Snapshot, step, ex.snapshot(), f"stage {self.cfg.stage}'s snapshot")
        elif isinstance(cmd, Restore):
            ex.restore(control.state_of(msg))
        elif isinstance(cmd, GetStats):
            return control.message(Stats(**ex.stats(reset=cmd.reset), shm_waits=self.transport.shm_waits), step)
        elif isinstance(cmd, StepScheduler):
            ex.scheduler_step(cmd.metric)
        elif isinstance(cmd, GetLr):
            return control.message(Lrs(lrs=ex.learning_rates()), step)
        elif isinstance(cmd, Clock):
            return control.message(Time(ns=time.perf_counter_ns()), step)
        elif isinstance(cmd, GetTrace):
            rows = list(self.trace or ())
            if self.trace is not None:
                self.trace.clear()
            return control.message(TraceRows(truncated=len(rows) == trace.MAX_ROWS), step, 0,
                                   [trace.rows_to_tensor(rows)])
        elif isinstance(cmd, Peers):
            self.transport.connect(cmd.next_forward, cmd.prev_backward)
            if self.links is None or not self.links.join(cmd):
                return None  # (with replicas, the driver waits for their ACK)
        elif isinstance(cmd, Lost) and self.links is not None:
            self.links.replica_lost(cmd, step)  # (its ACK, if any, is the link's to send)
            return None
        elif isinstance(cmd, Rejoin) and self.links is not None:
            self.links.replica_back(cmd.replica, cmd.address, cmd.round)
        elif not isinstance(cmd, Stop):
            raise RuntimeError(f"stage {self.cfg.stage}: unexpected command {msg.kind.name}")
        return control.message(Ack(), step)

    def run_batch(self, cmd: Train | Predict, msg: Message) -> None:
        """Run the schedule's actions for one batch, answering the interpreter's requests."""
        ex = self.executor
        training = isinstance(cmd, Train)
        step = self.step = msg.step
        if training and self.links is not None:
            self.links.note_train(cmd.shares)  # type: ignore[union-attr]
        if training and self.cfg.fault is not None:
            inject(self.cfg.fault, self.cfg.stage, step, self.cfg.replica, self._note)
        x, target, inputs = batch_parts(cmd, msg.tensors, self.cfg.stage, ex.is_first, ex.needs_target and training)
        weights, aux_weights, stream = ((cmd.weights, cmd.aux_weights, cmd.stream) if isinstance(cmd, Train)
                                        else (None, None, False))
        actions, keys = self.plan.begin(ex, step, cmd.sizes, training, x, target, weights, aux_weights, stream=stream,
                                        inputs=inputs)
        lr = ex.learning_rate() if ex.is_last and training else None  # the one this batch trains with
        self.run(actions, step, keys)
        if ex.is_last and training:
            self.transport.send_control(control.message(Loss(loss=ex.mean_loss(), lr=lr), step))

    def run(self, actions: list[schedules.Action], step: int, keys: Any) -> None:
        """Run ``actions``, answering the interpreter's requests with the transport. Messages are
        keyed (step, microbatch); in a stream, ``keys`` gives each microbatch number's key."""
        self._keys = keys
        gen = execute(self.executor, actions, self.trace, keys, self._note)
        value: Any = None
        try:
            while True:
                req = gen.send(value)
                self.current = None  # no compute action under way: messages
                value = self.carry_out(req, step, keys)
        except StopIteration:
            pass
        finally:
            self.current = None

    def carry_out(self, req: tuple[Any, ...], step: int, keys: Any) -> Any:
        """One request of the interpreter (see :mod:`pipeq.runtime.interpreter`), carried out
        with this stage's transport; what the interpreter gets back (a receive's tensors)."""
        transport, rec = self.transport, self._rec
        op = req[0]
        t0 = time.perf_counter_ns() if rec else 0
        s, j = keys[req[1]] if keys is not None else (step, req[1])
        if op is Op.RECV_ACT:
            got = transport.wait_data(transport.forward_queue, s, j)
            tree = control.data_tree(got)
            value = got.tensors if tree is None else microbatch.Packed.of(got.tensors, tree)
            if rec:
                rec((trace.WAIT_ACT, s, j, t0, time.perf_counter_ns(), _nbytes(value)))
            return value
        if op is Op.RECV_GRAD:
            value = transport.wait_data(transport.backward_queue, s, j).tensors
            if rec:
                rec((trace.WAIT_GRAD, s, j, t0, time.perf_counter_ns(), _nbytes(value)))
            return value
        if op is Op.SEND_ACT:
            transport.send_activation(s, j, req[2], microbatch.spec_of(req[2]))
            code = trace.SEND_ACT
        elif op is Op.SEND_GRAD:
            transport.send_gradient(s, j, req[2])
            code = trace.SEND_GRAD
        elif op is EMIT:
            transport.send_control(control.message(Output(tree=microbatch.spec_of(req[2])), s, j, req[2]))
            code = trace.EMIT
        elif op is TIES:
            if self.links is None:
                raise RuntimeError(f"stage {self.cfg.stage}: tied gradients to exchange, but no tie link")
            return self.links.exchange_ties(req[3], req[2])
        else:  # pragma: no cover - the interpreter makes no other request
            raise RuntimeError(f"stage {self.cfg.stage}: unknown request {op!r}")
        if rec:
            rec((code, s, j, t0, time.perf_counter_ns(), _nbytes(req[2])))
        return None


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _build(cfg: WorkerConfig, payload: "bytes | StageBuilder") -> StageSpec:
    """The stage's spec: unpickled from the bytes the driver handed this process at start (never
    from a socket), or built here by a recipe."""
    spec = pickle.loads(payload) if isinstance(payload, bytes) else payload.build(cfg.stage, cfg.n_stages)
    if not isinstance(spec, StageSpec):
        raise TypeError(f"stage {cfg.stage} was handed a {type(spec).__name__}, not a StageSpec")
    return spec


def _shard(cfg: WorkerConfig, spec: StageSpec, transport: StageTransport,
           device: torch.device) -> tuple[StageSpec, Any]:
    """Tensor parallelism: join the stage's other shards (pipeq.parallel.tensor), split the module as
    the stage's plan says, and wrap the transport: shard 0 shares what it receives, the others
    follow it (pipeq.wire.shard_link)."""
    from pipeq.parallel import tensor as tensorpar
    from pipeq.stage.transfer import pinned_copies
    from pipeq.wire.shard_link import MAX_FRAMES, FollowerTransport, LeadTransport, ShardLink

    if cfg.tp_store is None:
        raise RuntimeError(f"stage {cfg.stage}, shard {cfg.shard}: no tp_store to meet the other shards in")
    mesh, group = tensorpar.join(cfg.tp_store, cfg.shard, cfg.shards, device)
    tensorpar.check_stage(cfg.stage, spec.module, cfg.tp_plan, cfg.shards)
    module = tensorpar.parallelize(spec.module.to(device), cfg.tp_plan, mesh)
    spec = dataclasses.replace(spec, module=module)
    # shard 0 shares the CUDA tensors it receives (CUDA IPC) as host copies, through pinned memory
    link = ShardLink(group, cfg.shard, cfg.shards, f"stage {cfg.stage}, shard {cfg.shard}",
                     max_bytes=MAX_FRAMES * cfg.max_frame_bytes, host_copies=pinned_copies)
    return spec, (LeadTransport(transport, link) if cfg.shard == 0 else FollowerTransport(transport, link))


def _publish(cfg: WorkerConfig, info: dict[str, Any]) -> None:
    """Multi-host: publish this process's endpoints in the rendezvous store as ``stage/<g>``
    (JSON, signed with the job's secret under the entry's full key, as pipeq.control.rendezvous reads it;
    no pickles). Node 0 only reads it for its start-up hints."""
    if cfg.store is None:
        return
    if cfg.auth is None:
        raise RuntimeError(f"stage {cfg.stage}: a multi-host stage needs the job's secret")
    import datetime

    from torch.distributed import PrefixStore, TCPStore

    host, port, prefix = cfg.store
    key = f"stage/{cfg.process}"
    store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60),
                     wait_for_workers=False)
    PrefixStore(prefix, store).set(key, cfg.auth.secret.sign(prefix + key, info))


def worker_entry(cfg: WorkerConfig, payload: "bytes | StageBuilder") -> None:
    """Entry point of a stage process (started by the runner, or by a node agent).

    ``payload`` is either a pickled :class:`~pipeq.stage.spec.StageSpec` that the runner handed
    to this process at start, or a :class:`~pipeq.stage.spec.StageBuilder` that builds it here
    from importable names (multi-host: nothing but plain data crosses hosts). Never anything
    received over a socket. It is built only once the control channel is up, so that a failure
    to build the stage is reported with its reason.
    """
    _prepare_process(cfg)
    transport = StageTransport(cfg.process, cfg.control_addr, bind=cfg.bind,
                               queue_capacity=cfg.queue_capacity, spin_s=cfg.spin_s, auth=cfg.auth,
                               max_frame_bytes=cfg.max_frame_bytes, shm=cfg.shm(),
                               device=torch.device(cfg.device))
    clean = _serve(cfg, payload, transport)
    # Skip the interpreter's teardown (a second or more with torch loaded): sockets are closed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if clean else 1)


def _prepare_process(cfg: WorkerConfig) -> None:
    """Before any socket: die with the driver, leave Ctrl-C to it, name the process, tighten its
    timers and pin it to its cores."""
    if cfg.die_with_parent and not os_process.can_watch(cfg.driver_pid):
        # No pidfd to watch the driver with: let the kernel kill us with it (no clean-up then).
        os_process.die_with_parent()
    # Ctrl-C, and a SIGTERM to the whole process group (kill -TERM -PGID, a batch system's
    # cancel), reach the stages too: the driver decides how its stages stop (it finishes the
    # steps in flight and checkpoints first), and kills what does not stop when told.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os_process.set_name(f"pipeq-stage{cfg.stage}" + (f"r{cfg.replica}" if cfg.replicas > 1 else "")
              + (f"t{cfg.shard}" if cfg.shards > 1 else ""))
    os_process.tight_timers()
    tune_process_allocator()
    # Pin first: threads started later (ZeroMQ's I/O thread, torch's pool) inherit the affinity.
    os_process.pin_cpu(cfg.cores, cfg.threads)


def _serve(cfg: WorkerConfig, payload: "bytes | StageBuilder", transport: StageTransport) -> bool:
    """Build the stage, report READY and serve the driver's commands until EXIT; False after a
    failure, which the driver is told of (ERROR) first."""
    heartbeat = None
    loop: EventLoop | None = None
    links: PeerLinks | None = None
    try:
        # From here on the driver is watched: if it dies, this stage cleans up and exits.
        heartbeat = Heartbeat(
            transport.ctx, cfg.control_addr, cfg.process, cfg.heartbeat_interval,
            cfg.driver_pid or os.getppid(), lambda: _orphaned(cfg), auth=cfg.auth,
            status=lambda: control.encode(loop.doing()) if loop is not None else None,
        )
        executor, serving = _make_stage(cfg, payload, transport)
        links = PeerLinks(transport, cfg.bind, executor, stage=cfg.stage, replica=cfg.replica, replicas=cfg.replicas,
                          shard=cfg.shard, shards=cfg.shards)
        _report_ready(cfg, transport, executor, links)
        loop = EventLoop(cfg, serving, executor, links)
        loop.serve()
        return True
    except Stopped:
        return True
    except BaseException as exc:  # report everything, KeyboardInterrupt included
        _report_error(transport, exc, loop)
        return False
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        if links is not None:
            links.close(linger_ms=200)  # their sockets share the transport's context: first
        transport.close(linger_ms=200)


def _make_stage(cfg: WorkerConfig, payload: "bytes | StageBuilder",
                transport: StageTransport) -> tuple[StageExecutor, Any]:
    """The stage's executor on its device, and what the event loop reads and sends through (the
    transport, or with tensor parallelism its wrapper for this shard)."""
    device = select_device(cfg)
    torch.manual_seed(cfg.seed)  # each stage its own stream (dropout masks differ by stage)
    spec = _build(cfg, payload)
    serving: Any = transport
    if cfg.shards > 1:  # the stage's shards meet, split the module, and shard 0 leads
        spec, serving = _shard(cfg, spec, transport, device)
    executor = make_executor(cfg.schedule, cfg.stage, cfg.n_stages, spec, device,
                             cfg.numerics, sharded=cfg.shards > 1)
    executor.keep_on_device = transport.device_payloads  # CUDA IPC to the neighbours
    return executor, serving


def _report_ready(cfg: WorkerConfig, transport: StageTransport, executor: StageExecutor,
                  links: PeerLinks) -> None:
    """Publish this process's endpoints (multi-host) and tell the driver it is READY."""
    ready = Ready(**transport.addresses, pid=os.getpid(), device=str(executor.device), replica=cfg.replica,
                  stage=cfg.stage, shard=cfg.shard, threads=torch.get_num_threads(), host=os.uname().nodename,
                  cores=sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [],
                  # the driver's PEERS hands them to the other replicas and the tie peers
                  **links.addresses(), inputs=list(info_of(executor.module).inputs) or None,
                  layout=executor.layout())
    entry = control.encode(ready)
    del entry["layout"]  # the rendezvous entry: where the process is, for node 0's start-up hints
    _publish(cfg, entry)
    transport.send_control(control.message(ready))


def _report_error(transport: StageTransport, exc: BaseException, loop: EventLoop | None) -> None:
    """Tell the driver why this stage fails, with the traceback (if the driver is still there)."""
    try:
        transport.send_control(control.message(ErrorReply(
            message=error_line(exc), traceback=format_remote(exc),
            step=loop.step if loop is not None else None,
            at=time.monotonic())))  # which of a stage's shards failed first (pipeq.control.supervisor)
    except Exception:
        pass
