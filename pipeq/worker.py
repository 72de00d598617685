"""The stage worker: one process per stage, pinned to its device, running an event loop.

The loop waits for a command on the control channel and carries it out:

    PEERS      connect the forward/backward channels to the neighbours' addresses
    STEP       run the schedule's actions for one training step (x rides along to stage 0,
               the target to the last stage); the last stage replies LOSS
    PREDICT    run forward-only actions; the last stage replies OUTPUT per microbatch
    GET_STATE  reply STATE (the stage module's state_dict tensors)
    SET_STATE  load them, reply ACK
    GET_SNAPSHOT  reply SNAPSHOT (parameters, optimizer and scheduler state, RNG: checkpoints)
    RESTORE    load a snapshot, reply ACK
    CLOCK      reply TIME with this process's clock (aligning traces)
    GET_TRACE  reply TRACE: the actions recorded since the last GET_TRACE (pipeq.trace)
    STOP       (after every earlier command is done) reply ACK: all this stage's traffic is over
    EXIT       leave the loop

Any exception is reported to the runner as ERROR (message and traceback) before the process
exits. The event loop is the only code in a worker that touches the transport.
"""

from __future__ import annotations

import collections
import ctypes
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import schedules, trace
from .codec import Kind, Message, pack_tree, unpack_tree
from .interpreter import OUTPUT, execute
from .schedules import Op
from .executors import make_executor
from .stage import StageExecutor
from .transport import Heartbeat, StageTransport, Stopped, remove_ipc_dir, tune_process_allocator


@dataclass
class WorkerConfig:
    """Everything a stage process needs to know to start (plain data, set by the runner)."""

    stage: int
    n_stages: int
    schedule: str | Callable[[int, int], list]  # a registered name or a schedule function
    control_addr: str
    transport: str = "ipc"
    where: str = ""  # ipc directory, or the tcp host/address to bind
    device: str = "cpu"
    cores: list[int] = field(default_factory=list)
    threads: int = 1
    queue_capacity: int = 64
    heartbeat_interval: float = 1.0
    spin_s: float = 0.0
    die_with_parent: bool = True
    driver_pid: int = 0
    seed: int = 0
    # multi-host: the rendezvous store (host, port, key prefix) where this stage publishes its
    # endpoints; None on one host
    store: tuple[str, int, str] | None = None
    trace: bool = False  # record every action (pipeq.trace)
    # data parallelism: this process is replica ``replica`` of ``replicas`` of its stage; its
    # index among all the run's processes is ``process`` (r * n_stages + stage); the gradients'
    # process group meets at ``dp_store`` (host, port, key prefix)
    replica: int = 0
    replicas: int = 1
    process: int = -1
    dp_store: tuple[str, int, str] | None = None

    @property
    def ident(self) -> int:
        """This process's id on the control channel and in socket names."""
        return self.stage if self.process < 0 else self.process


class StageBuilder:
    """What a stage process builds its stage from, instead of pickled modules (see pipeq.job)."""

    def build(self, stage: int, n_stages: int) -> tuple[Any, Any, Any, Any]:
        """(module, loss_fn or None unless last stage, optimizer factory, lr scheduler factory)."""
        raise NotImplementedError

    def seed_for(self, stage: int) -> int:
        """The seed of stage ``stage``'s torch RNG (dropout...), the same on every host."""
        return stage

    def describe(self) -> dict[str, Any]:
        """Plain data that two hosts compare to make sure they build the same job."""
        return {}


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the process that started us exits (no orphans)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not glibc/Linux: the heartbeat thread's parent watch still applies
        pass


def _set_name(name: str) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME: shows in ps -o comm, top
    except OSError:
        pass


def _can_watch(pid: int) -> bool:
    """Whether this kernel gives pidfds, with which the heartbeat thread sees the driver exit."""
    try:
        os.close(os.pidfd_open(pid or os.getppid()))  # type: ignore[attr-defined]
        return True
    except (AttributeError, OSError):
        return False


def _orphaned(cfg: WorkerConfig) -> None:
    """The driver is gone (killed, most likely): clean up what it cannot any more, and exit."""
    if cfg.transport == "ipc":
        remove_ipc_dir(cfg.where)
    os._exit(3)


def pin_cpu(cfg: WorkerConfig) -> None:
    """Pin this process to its share of the CPU cores and set its torch thread count."""
    if cfg.cores and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cfg.cores)
        except OSError:
            pass
    torch.set_num_threads(max(1, cfg.threads))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (e.g. torch used before we got here)
        pass


def select_device(cfg: WorkerConfig) -> torch.device:
    """This stage's device; a CUDA device becomes the process's current one."""
    device = torch.device(cfg.device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


class EventLoop:
    def __init__(self, cfg: WorkerConfig, transport: StageTransport, executor: StageExecutor) -> None:
        self.cfg = cfg
        self.t = transport
        self.ex = executor
        self._actions: dict[tuple[int, bool], list[schedules.Action]] = {}
        self.trace: collections.deque[tuple[int, ...]] | None = (
            collections.deque(maxlen=trace.MAX_ROWS) if cfg.trace else None
        )

    def actions(self, m: int, training: bool) -> list[schedules.Action]:
        key = (m, training)
        acts = self._actions.get(key)
        if acts is None:
            acts = schedules.build(self.cfg.schedule, self.cfg.n_stages, m, training=training)[self.cfg.stage]
            self._actions[key] = acts
        return acts

    def serve(self) -> None:
        t = self.t
        while True:
            msg = t.next_control(1000)
            if msg is None:
                continue
            kind = msg.kind
            if kind is Kind.STEP or kind is Kind.PREDICT:
                self.run_step(msg, training=kind is Kind.STEP)
            elif kind is Kind.GET_STATE:
                names, tensors = self.ex.state_tensors()
                t.send_control(Kind.STATE, msg.step, tensors=tensors, extra={"names": names})
            elif kind is Kind.SET_STATE:
                self.ex.load_state(msg.extra["names"], msg.tensors)
                t.send_control(Kind.ACK, msg.step)
            elif kind is Kind.GET_SNAPSHOT:
                tensors: list[torch.Tensor] = []
                tree = pack_tree(self.ex.snapshot(), tensors, f"stage {self.cfg.stage}'s snapshot")
                t.send_control(Kind.SNAPSHOT, msg.step, tensors=tensors, extra={"snapshot": tree})
            elif kind is Kind.RESTORE:
                self.ex.restore(unpack_tree(msg.extra["snapshot"], msg.tensors))
                t.send_control(Kind.ACK, msg.step)
            elif kind is Kind.CLOCK:
                t.send_control(Kind.TIME, msg.step, extra={"ns": time.perf_counter_ns()})
            elif kind is Kind.GET_TRACE:
                rows = list(self.trace or ())
                if self.trace is not None:
                    self.trace.clear()
                t.send_control(Kind.TRACE, msg.step, tensors=[trace.rows_to_tensor(rows)],
                               extra={"truncated": len(rows) == trace.MAX_ROWS})
            elif kind is Kind.PEERS:
                t.connect(msg.extra.get("next_forward"), msg.extra.get("prev_backward"))
            elif kind is Kind.STOP:
                t.send_control(Kind.ACK, msg.step)
            elif kind is Kind.EXIT:
                return
            else:
                raise RuntimeError(f"stage {self.cfg.stage}: unexpected command {kind.name}")

    def run_step(self, msg: Message, training: bool) -> None:
        ex = self.ex
        t = self.t
        step = msg.step
        sizes = msg.extra.get("sizes")
        if type(sizes) is not list or not sizes or any(type(n) is not int or n < 1 for n in sizes):
            raise ValueError(f"stage {self.cfg.stage}: bad microbatch sizes {sizes!r} in command")
        weights = msg.extra.get("weights")
        if weights is not None and (type(weights) is not list or len(weights) != len(sizes)
                                    or any(type(w) is not float for w in weights)):
            raise ValueError(f"stage {self.cfg.stage}: bad loss weights {weights!r} in command")
        tensors = msg.tensors
        x = tensors[0] if ex.is_first else None
        target = tensors[-1] if (ex.needs_target and training) else None
        ex.begin(step, sizes, training, x, target, weights)
        aux = msg.extra.get("aux_weights")
        if aux is not None:  # data parallelism: head losses weighted by their share of the whole batch
            if type(aux) is not list or len(aux) != len(sizes) or any(type(w) is not float for w in aux):
                raise ValueError(f"stage {self.cfg.stage}: bad auxiliary loss weights {aux!r} in command")
            ex.aux_weights = aux
        rec = self.trace.append if self.trace is not None else None
        gen = execute(ex, self.actions(len(sizes), training), self.trace)
        fq, bq = t.forward_queue, t.backward_queue
        clock = time.perf_counter_ns
        value: Any = None
        try:
            while True:
                req = gen.send(value)
                op = req[0]
                value = None
                t0 = clock() if rec else 0
                if op is Op.RECV_ACT:
                    got = t.wait_data(fq, step, req[1])
                    value = got.tensors
                    if rec:
                        rec((trace.WAIT_ACT, step, req[1], t0, clock(), _nbytes(value)))
                elif op is Op.RECV_GRAD:
                    got = t.wait_data(bq, step, req[1])
                    value = got.tensors
                    if rec:
                        rec((trace.WAIT_GRAD, step, req[1], t0, clock(), _nbytes(value)))
                elif op is Op.SEND_ACT:
                    t.send_activation(step, req[1], req[2])
                    if rec:
                        rec((trace.SEND_ACT, step, req[1], t0, clock(), _nbytes(req[2])))
                elif op is Op.SEND_GRAD:
                    t.send_gradient(step, req[1], req[2])
                    if rec:
                        rec((trace.SEND_GRAD, step, req[1], t0, clock(), _nbytes(req[2])))
                elif op == OUTPUT:
                    t.send_control(Kind.OUTPUT, step, req[1], req[2])
                    if rec:
                        rec((trace.OUTPUT, step, req[1], t0, clock(), _nbytes(req[2])))
        except StopIteration:
            pass
        if ex.is_last and training:
            t.send_control(Kind.LOSS, step, extra={"loss": ex.mean_loss()})


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _build(cfg: WorkerConfig, payload: "bytes | StageBuilder") -> tuple[Any, Any, Any, Any]:
    if isinstance(payload, bytes):
        return pickle.loads(payload)
    return payload.build(cfg.stage, cfg.n_stages)


def _publish(cfg: WorkerConfig, info: dict[str, Any]) -> None:
    """Multi-host: publish this stage's endpoints in the rendezvous store (JSON, no pickles)."""
    if cfg.store is None:
        return
    import datetime
    import json

    from torch.distributed import PrefixStore, TCPStore

    host, port, prefix = cfg.store
    store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60),
                     wait_for_workers=False)
    PrefixStore(prefix, store).set(f"stage/{cfg.stage}", json.dumps(info))


def worker_entry(cfg: WorkerConfig, payload: "bytes | StageBuilder") -> None:
    """Entry point of a stage process (started by the runner, or by a node agent).

    ``payload`` is either the pickled (module, loss_fn, optimizer factory, lr scheduler factory)
    that the runner handed to this process at start, or a :class:`StageBuilder` that builds them
    here from importable names (multi-host: nothing but plain data crosses hosts). Never anything
    received over a socket. It is built only once the control channel is up, so that a failure
    to build the stage is reported with its reason.
    """
    if cfg.die_with_parent and not _can_watch(cfg.driver_pid):
        # No pidfd to watch the driver with: let the kernel kill us with it (no clean-up then).
        _die_with_parent()
    # Ctrl-C reaches the whole process group: the driver decides how its stages stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _set_name(f"pipeq-stage{cfg.stage}" + (f"r{cfg.replica}" if cfg.replicas > 1 else ""))
    tune_process_allocator()
    # Pin first: threads started later (ZeroMQ's I/O thread, torch's pool) inherit the affinity.
    pin_cpu(cfg)
    transport = StageTransport(
        cfg.ident,
        cfg.control_addr,
        transport=cfg.transport,
        where=cfg.where,
        queue_capacity=cfg.queue_capacity,
        spin_s=cfg.spin_s,
    )
    heartbeat = None
    clean = False
    try:
        # From here on the driver is watched: if it dies, this stage cleans up and exits.
        heartbeat = Heartbeat(
            transport.ctx, cfg.control_addr, cfg.ident, cfg.heartbeat_interval,
            cfg.driver_pid or os.getppid(), lambda: _orphaned(cfg)
        )
        device = select_device(cfg)
        torch.manual_seed(cfg.seed)  # each stage its own stream (dropout masks differ by stage)
        built = _build(cfg, payload)
        module, loss_fn, optimizer_factory, scheduler_factory = built[:4]
        executor = make_executor(cfg.schedule, cfg.stage, cfg.n_stages, module, optimizer_factory,
                                 loss_fn, device, scheduler_factory, built[4] if len(built) > 4 else None)
        if cfg.replicas > 1:  # join the stage's replicas: replica 0's weights, summed gradients
            assert cfg.dp_store is not None
            from . import dataparallel

            dataparallel.join(cfg.stage, cfg.replica, cfg.replicas, cfg.dp_store, device,
                              cfg.where if cfg.transport == "tcp" else None)
            params = executor.optimizer_params()
            dataparallel.broadcast_from_replica_0(params + list(executor.module.buffers()))
            executor.grad_sync = dataparallel.GradSync(params)
        info = {**transport.addresses, "pid": os.getpid(), "device": str(device), "replica": cfg.replica,
                "threads": torch.get_num_threads(), "host": os.uname().nodename,
                "cores": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []}
        _publish(cfg, info)
        transport.send_control(Kind.READY, extra={**info, "layout": executor.layout()})
        EventLoop(cfg, transport, executor).serve()
        clean = True
    except Stopped:
        clean = True
    except BaseException as exc:  # report everything, KeyboardInterrupt included
        try:
            transport.send_control(
                Kind.ERROR,
                extra={"message": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()},
            )
        except Exception:
            pass
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        transport.close(linger_ms=200)
    # Skip the interpreter's teardown (a second or more with torch loaded): sockets are closed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if clean else 1)
