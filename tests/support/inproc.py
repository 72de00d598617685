"""A pipeline in this process: the driver's real backend and supervisor, the stages' real event
loops in threads, and an in-memory wire between them (no process, no socket).

What runs is pipeq's own code on both ends: :class:`pipeq.control.driver.ProcessBackend` builds
the commands and reads the replies, :class:`pipeq.control.supervisor.Supervisor` watches every
wait, and each stage is a :class:`pipeq.runtime.loop.EventLoop` over a real executor. Only the
transport is replaced: :class:`Wire` plays the driver's ``ControlServer`` and every stage
process's ``ProcessTransport`` (messages are handed over as objects, their tensors copied, as a
socket would). So the unit tests that use it assert what a user sees (losses, states, the errors that
name a stage) without naming what the messages carry.

Two things a stage *process* does are done here the same way: a stage's exception reaches the
driver as an ERROR with its message and traceback (``worker_entry``), and a heartbeat carries
what the stage is computing (``EventLoop.doing()``, as ``pipeq.wire.control_link.Heartbeat`` sends
it). They are the two places that know a message's contents: :func:`error_reply`, :func:`beat`.

The one seam this needs in pipeq: a ``ProcessBackend`` whose control server and supervisor are
given rather than started (:func:`attach` sets them).
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from typing import Any, Callable, Sequence

import torch

from pipeq.control.config import FaultConfig, RunConfig
from pipeq.control.batching import Batcher
from pipeq.control.driver import ProcessBackend
from pipeq.control.processes import RunSetup
from pipeq.control.supervisor import Supervisor
from pipeq.runtime.config import ChunkConfig, WorkerConfig
from pipeq.runtime.executors import StageSpec, make_executor
from pipeq.runtime.loop import Chunk, EventLoop
from pipeq.stage.numerics import Numerics
from pipeq.wire import control
from pipeq.wire.control import ErrorReply, HeartbeatInfo
from pipeq.wire.messages import Kind, Message
from pipeq.wire.control_link import HEARTBEAT, STAGE, Peer
from pipeq.wire.errors import PeerUnreachable, Stopped

_TICK = 0.01  # how often a waiting stage looks whether the wire was closed


def error_reply(exc: BaseException, loop: EventLoop | None) -> Message:
    """A stage's exception as the driver gets it (as ``pipeq.runtime.worker.worker_entry`` sends it)."""
    return control.message(ErrorReply(message=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(),
                                      step=loop.step if loop is not None else None, at=time.monotonic()))


def beat(n: int, loop: EventLoop | None) -> Message:
    """A heartbeat, saying what the stage computes (as ``pipeq.wire.control_link.Heartbeat`` sends it)."""
    return control.message(loop.doing() if loop is not None else HeartbeatInfo(), n)


class _Inbox:
    """A stage's forward or backward queue: messages by (step, microbatch)."""

    def __init__(self) -> None:
        self.items: dict[tuple[int, int], Message] = {}
        self.cond = threading.Condition()

    def put(self, msg: Message) -> None:
        with self.cond:
            self.items[(msg.step, msg.microbatch)] = msg
            self.cond.notify_all()


def _copy(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


class StageEnd:
    """Stage g's transport, as its event loop uses it (a process of one stage: chunk 0)."""

    def __init__(self, wire: "Wire", g: int) -> None:
        self.wire = wire
        self.g = g
        self.forward_queue = _Inbox()
        self.backward_queue = _Inbox()
        self.device_payloads = False

    def shm_waits(self, c: int) -> int:
        return 0

    def connect(self, c: int, next_forward: str | None, prev_backward: str | None) -> None:
        pass  # the wire knows the neighbours

    def next_command(self, ready: Sequence[int], timeout_ms: int) -> tuple[int, Message] | None:
        if not ready:
            raise AssertionError("a process of one stage is always ready for its next command")
        end = time.monotonic() + timeout_ms / 1000
        while not self.wire.closed:
            try:
                return 0, self.wire.commands[self.g].get(timeout=_TICK)
            except queue.Empty:
                if time.monotonic() > end:
                    return None
        raise Stopped()

    def send_control(self, c: int, msg: Message) -> None:
        self.wire.replies.put((Peer(STAGE, self.g), Message(msg.kind, msg.step, msg.microbatch,
                                                              _copy(msg.tensors), dict(msg.extra))))

    def send_activation(self, c: int, step: int, mb: int, tensors: Sequence[torch.Tensor], tree: Any = None) -> None:
        extra = {"tree": tree} if tree is not None else {}  # (only lone tensors cross in these tests)
        self.wire.ends[self.g + 1].forward_queue.put(Message(Kind.ACTIVATION, step, mb, _copy(tensors), extra))

    def send_gradient(self, c: int, step: int, mb: int, tensors: Sequence[torch.Tensor]) -> None:
        self.wire.ends[self.g - 1].backward_queue.put(Message(Kind.GRADIENT, step, mb, _copy(tensors)))

    def wait_activation(self, c: int, step: int, mb: int) -> Message:
        return self._wait(self.forward_queue, step, mb)

    def wait_gradient(self, c: int, step: int, mb: int) -> Message:
        return self._wait(self.backward_queue, step, mb)

    def _wait(self, inbox: _Inbox, step: int, mb: int) -> Message:
        with inbox.cond:
            while (step, mb) not in inbox.items:
                if self.wire.closed:
                    raise Stopped()
                inbox.cond.wait(_TICK)
            return inbox.items.pop((step, mb))


class Wire:
    """The driver's control server (``send``, ``send_many``, ``recv``, ``close``) and, in
    :attr:`ends`, every stage's transport. ``gone`` holds processes whose control socket is gone
    (sending them raises ``PeerUnreachable``, as the real server does)."""

    address = "inproc://driver"

    def __init__(self, n: int) -> None:
        self.replies: queue.Queue[Any] = queue.Queue()
        self.commands: list[queue.Queue[Message]] = [queue.Queue() for _ in range(n)]
        self.ends = [StageEnd(self, g) for g in range(n)]
        self.gone: set[int] = set()
        self.closed = False

    def send_many(self, messages: Sequence[tuple[int, Message]]) -> None:
        for g, _ in messages:
            if g in self.gone:
                raise PeerUnreachable(g)
        for g, msg in messages:
            self.commands[g].put(Message(msg.kind, msg.step, msg.microbatch, _copy(msg.tensors), dict(msg.extra)))

    def send(self, g: int, msg: Message) -> None:
        self.send_many([(g, msg)])

    def send_best_effort(self, role: str, index: int, msg: Message) -> bool:
        return False

    def recv(self, timeout_ms: int) -> tuple[Peer | None, Message] | None:
        """The next reply; an exception put in the queue is raised (a malformed message)."""
        try:
            got = self.replies.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            return None
        if isinstance(got, BaseException):
            raise got
        return got

    def close(self, linger_ms: int = 0) -> None:
        self.closed = True


def worker_config(k: int, n: int, schedule: Any, trace: bool) -> WorkerConfig:
    """Stage k's process, as the driver describes it (its plumbing unused here: no process starts)."""
    setup = RunSetup(RunConfig(schedule, 2, "trace.json" if trace else None), Numerics(), None)
    return WorkerConfig(chunks=(ChunkConfig(stage=k, process=k, seed=0, tp_plan=None),), index=k, n_stages=n,
                        schedule=setup.config.schedule, settings=setup.stage_settings(), control_addr=Wire.address,
                        bind=None, device="cpu", cores=[], threads=1, replica=0, replicas=1, shard=0, shards=1,
                        mesh=None, auth=None, driver_pid=0, die_with_parent=False, store=None,
                        fault=None)


class Stage(threading.Thread):
    """Stage k's event loop in a thread of this process, over a real executor, with its
    heartbeats (every ``beat_s`` seconds, until :attr:`silent` is set)."""

    def __init__(self, wire: Wire, k: int, n: int, spec: StageSpec | None, schedule: Any,
                 beat_s: float, trace: bool = False) -> None:
        super().__init__(name=f"inproc-stage{k}", daemon=True)
        self.wire, self.k, self.n, self.spec, self.schedule = wire, k, n, spec, schedule
        self.beat_s = beat_s
        self.silent = threading.Event()
        self.loop: EventLoop | None = None
        cfg = worker_config(k, n, schedule, trace)
        executor = make_executor(schedule, k, n, spec, torch.device("cpu")) if spec is not None else None
        self.loop = EventLoop(cfg, wire.ends[k], [Chunk(0, cfg.chunks[0], executor, None, trace)])
        self._beats = threading.Thread(target=self._beat, name=f"inproc-beat{k}", daemon=True)

    def start(self) -> None:
        super().start()
        self._beats.start()

    def run(self) -> None:
        end = self.wire.ends[self.k]
        try:
            self.loop.serve()
        except Stopped:
            pass
        except BaseException as exc:  # noqa: BLE001 (reported, as a stage process does)
            end.send_control(0, error_reply(exc, self.loop))

    def _beat(self) -> None:
        n = 0
        while not self.wire.closed and self.is_alive():
            if not self.silent.is_set():
                n += 1
                self.wire.replies.put((Peer(HEARTBEAT, self.k), beat(n, self.loop)))
            time.sleep(self.beat_s)


class InProcessPipeline:
    """``stages`` (modules) trained with ``schedule`` by the real driver and stages, in this
    process. ``backend`` is the driver's (train, predict, get_state, close...); ``teardowns``
    counts the supervisor's teardowns (a failure stops every stage before it is raised)."""

    def __init__(self, modules: Sequence[torch.nn.Module] | None, loss_fn: Callable | None = None,
                 optimizer: Callable | None = None, *, schedule: Any = "1f1b", microbatches: int = 2,
                 n_stages: int | None = None, heartbeat_timeout: float = 10.0, step_timeout: float | None = None,
                 beat_s: float = 0.2, trace_path: str | None = None, procs: dict[int, Any] | None = None,
                 lr_scheduler: Callable | None = None, lr_scheduler_interval: str = "step") -> None:
        # (beat_s: heartbeats far apart compared with the supervisor's 50 ms reads: while messages
        # keep coming within each read, Supervisor.read_error does not return; see test_supervisor.py)
        n = len(modules) if modules is not None else int(n_stages or 1)
        self.n = n
        self.loss_fn = loss_fn
        self.wire = Wire(n)
        self.teardowns = 0
        specs = ([StageSpec(m, optimizer, loss_fn if k == n - 1 else None, lr_scheduler,
                            lr_scheduler_interval=lr_scheduler_interval) for k, m in enumerate(modules)]
                 if modules is not None else [None] * n)
        self.stages = [Stage(self.wire, k, n, specs[k], schedule, beat_s, trace=trace_path is not None)
                       for k in range(n)]
        config = RunConfig(schedule, microbatches, trace_path,
                           fault=FaultConfig(heartbeat_interval=beat_s, heartbeat_timeout=heartbeat_timeout,
                                             step_timeout=step_timeout))
        self.backend = ProcessBackend([b""] * n, RunSetup(config, Numerics(), None))
        self.batcher = Batcher(schedule, n, microbatches, loss_fn) if loss_fn is not None else None
        self.sup = attach(self.backend, self.wire, self._teardown, procs or {})
        self._step = 0
        self.on_close: list[Callable[[], None]] = []  # e.g. let a stage stuck on purpose go on

    def _teardown(self) -> None:
        self.teardowns += 1
        self.wire.close()

    def __enter__(self) -> "InProcessPipeline":
        for s in self.stages:
            s.start()
        self.sup.expect_heartbeats()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if exc[0] is None and self.sup.failure is None:
                self.backend.close()
        finally:
            self.wire.close()
            for release in self.on_close:
                release()
            for s in self.stages:
                s.join(5.0)
            assert not any(s.is_alive() for s in self.stages), "a stage thread outlived its pipeline"

    def shards(self, target: torch.Tensor) -> Any:
        assert self.batcher is not None
        return self.batcher.shards(target, len(target))

    def train(self, x: torch.Tensor, target: torch.Tensor) -> float:
        """One training step, as ``runner.step`` sends it: the whole batch's mean loss."""
        step, self._step = self._step, self._step + 1
        return self.backend.train(step, self.shards(target), x, target)

    def submit(self, x: torch.Tensor, target: torch.Tensor) -> int:
        """A step sent without waiting for it (``runner.stream``): its step number."""
        step, self._step = self._step, self._step + 1
        self.backend.submit(step, self.shards(target), x, target)
        return step


def attach(backend: ProcessBackend, wire: Wire, teardown: Callable[[], None], procs: dict[int, Any]) -> Supervisor:
    """Give ``backend`` a control server and a supervisor without starting processes (what
    ``ProcessBackend.start`` does after starting them and before their READY)."""
    p = backend.processes  # what ProcessBackend's start-up (pipeq.control.startup) owns
    p.server = wire
    p.procs = procs
    p.sup = Supervisor(wire, procs, n_stages=p.n_stages, n_processes=p.n_all, numbering=p.numbering, n_nodes=1,
                       heartbeat_timeout=p.heartbeat_timeout, teardown=teardown, step_timeout=p.step_timeout)
    return p.sup
