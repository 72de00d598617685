"""ZeroMQ sockets and bounded, keyed queues: how messages move between processes.

This module is the only user of :mod:`pipeq.codec`. Its users are the worker event loop (one
:class:`StageTransport` per stage process) and the runner's control plane (one
:class:`ControlServer` per pipeline). Channels::

            control (DEALER <-> ROUTER): commands, losses, errors, heartbeats
    runner  <------------------------------------------------------------+
      |                                                                  |
    stage 0 --forward (PUSH->PULL)--> stage 1 --forward--> ... stage N-1
    stage 0 <--backward (PULL<-PUSH)-- stage 1 <--backward-- ...

Every stage binds its two inbound sockets (``ipc://`` files in a private directory by default,
``tcp://`` on request) and connects its outbound ones to its neighbours' addresses. Arriving data
messages are filed in a :class:`KeyedQueue` under ``(step, microbatch)``, so the order in which
they arrive does not matter, and the queue's capacity bounds what a stage may hold.
"""

from __future__ import annotations

import collections
import os
import shutil
import tempfile
import time
from typing import Any, Callable, Sequence

import torch
import zmq

from . import codec
from .codec import Kind, Message

#: Socket-level buffering. ZeroMQ's high-water marks stay far above what the keyed queues allow,
#: so that flow control is the schedule's business and never a silent drop.
_HWM = 10_000
_KERNEL_BUF = 4 << 20
_SLICE_MS = 200  # how often a blocked wait looks for an EXIT from the runner


class ProtocolError(RuntimeError):
    """A peer sent something the schedule does not allow (duplicate, overflow, wrong kind)."""


class PeerUnreachable(RuntimeError):
    """The runner could not hand a message to a stage (its control socket is gone)."""

    def __init__(self, stage: int) -> None:
        super().__init__(f"stage {stage} is not connected to the control channel")
        self.stage = stage


class Stopped(Exception):
    """The runner told this stage to exit while it was waiting for data."""


class KeyedQueue:
    """A bounded map ``(step, microbatch) -> Message``; arrival order does not matter."""

    __slots__ = ("name", "capacity", "_items")

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self._items: dict[tuple[int, int], Message] = {}

    def put(self, msg: Message) -> None:
        key = (msg.step, msg.microbatch)
        if key in self._items:
            raise ProtocolError(f"{self.name} queue: duplicate message for step {key[0]} microbatch {key[1]}")
        if len(self._items) >= self.capacity:
            raise ProtocolError(
                f"{self.name} queue is full ({self.capacity} messages); a peer is running ahead "
                "of the schedule"
            )
        self._items[key] = msg

    def pop(self, step: int, microbatch: int) -> Message | None:
        return self._items.pop((step, microbatch), None)

    def __len__(self) -> int:
        return len(self._items)


def tune_process_allocator() -> bool:
    """Let this process reuse freed large buffers instead of mapping fresh pages for each.

    libzmq allocates every received message in its I/O thread; glibc serves large blocks with
    mmap and returns them on free, so each 64 MiB tensor costs ~16k page faults (about 3x the
    transfer itself). One arena (so the I/O thread's blocks come back to the main heap), no mmap,
    and a high trim threshold make the heap keep and reuse them. Called by every stage process
    at start, before any thread exists; a no-op where glibc's mallopt is not available.
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(-8, 1)  # M_ARENA_MAX
        ok &= libc.mallopt(-4, 0)  # M_MMAP_MAX
        ok &= libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
        return bool(ok)
    except (OSError, AttributeError):
        return False


def make_ipc_dir() -> str:
    """A private directory for one pipeline's ``ipc://`` socket files (removed by the runner)."""
    return tempfile.mkdtemp(prefix="pipeq-")


def remove_ipc_dir(path: str | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)


def _bind(sock: zmq.Socket, transport: str, where: str, name: str) -> str:
    if transport == "ipc":
        addr = f"ipc://{os.path.join(where, name)}"
        sock.bind(addr)
        return addr
    sock.bind(f"tcp://{where}:0")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def tune_socket(sock: zmq.Socket) -> None:
    """pipeq's socket options: high-water marks above any queue's bound, 4 MiB kernel buffers."""
    sock.setsockopt(zmq.SNDHWM, _HWM)
    sock.setsockopt(zmq.RCVHWM, _HWM)
    sock.setsockopt(zmq.SNDBUF, _KERNEL_BUF)
    sock.setsockopt(zmq.RCVBUF, _KERNEL_BUF)
    sock.setsockopt(zmq.LINGER, 2000)


class StageTransport:
    """The sockets and queues of one stage process. Not thread-safe: the event loop owns it."""

    def __init__(
        self,
        stage: int,
        control_addr: str,
        *,
        transport: str = "ipc",
        where: str,
        queue_capacity: int,
        spin_s: float = 0.0,
    ) -> None:
        self.stage = stage
        self.ctx = zmq.Context(io_threads=1)
        self.ctrl = self.ctx.socket(zmq.DEALER)
        self.ctrl.setsockopt(zmq.IDENTITY, b"s%d" % stage)
        tune_socket(self.ctrl)
        self.ctrl.connect(control_addr)
        self.fwd_in = self.ctx.socket(zmq.PULL)
        self.bwd_in = self.ctx.socket(zmq.PULL)
        for s in (self.fwd_in, self.bwd_in):
            tune_socket(s)
        self.addresses = {
            "forward": _bind(self.fwd_in, transport, where, f"s{stage}-fwd"),
            "backward": _bind(self.bwd_in, transport, where, f"s{stage}-bwd"),
        }
        self.fwd_out: zmq.Socket | None = None
        self.bwd_out: zmq.Socket | None = None
        self.forward_queue = KeyedQueue(f"stage {stage} forward", queue_capacity)
        self.backward_queue = KeyedQueue(f"stage {stage} backward", queue_capacity)
        self.control_queue: collections.deque[Message] = collections.deque()
        self.poller = zmq.Poller()
        for s in (self.ctrl, self.fwd_in, self.bwd_in):
            self.poller.register(s, zmq.POLLIN)
        self.spin_s = spin_s
        self.bytes_sent = 0
        self.bytes_received = 0

    # -- wiring --------------------------------------------------------------------------------
    def connect(self, next_forward: str | None, prev_backward: str | None) -> None:
        if next_forward:
            self.fwd_out = self.ctx.socket(zmq.PUSH)
            tune_socket(self.fwd_out)
            self.fwd_out.connect(next_forward)
        if prev_backward:
            self.bwd_out = self.ctx.socket(zmq.PUSH)
            tune_socket(self.bwd_out)
            self.bwd_out.connect(prev_backward)

    # -- sending -------------------------------------------------------------------------------
    def _send(self, sock: zmq.Socket, frames: list[Any]) -> None:
        # Blocks only past the high-water mark, which the bounded queues keep far away; a stage
        # stuck here because its peer died is ended by the runner, which watches every process.
        sock.send_multipart(frames, copy=False)

    def send_activation(self, step: int, mb: int, tensors: Sequence[torch.Tensor]) -> None:
        assert self.fwd_out is not None, "stage has no next stage"
        self._send(self.fwd_out, codec.encode(Kind.ACTIVATION, step, mb, tensors))

    def send_gradient(self, step: int, mb: int, tensors: Sequence[torch.Tensor]) -> None:
        assert self.bwd_out is not None, "stage has no previous stage"
        self._send(self.bwd_out, codec.encode(Kind.GRADIENT, step, mb, tensors))

    def send_control(
        self,
        kind: Kind,
        step: int = 0,
        mb: int = 0,
        tensors: Sequence[torch.Tensor] = (),
        extra: dict[str, Any] | None = None,
    ) -> None:
        self._send(self.ctrl, codec.encode(kind, step, mb, tensors, extra))

    # -- receiving -----------------------------------------------------------------------------
    def _drain(self, sock: zmq.Socket) -> None:
        """File every message waiting on ``sock`` into its queue."""
        while True:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            msg = codec.decode(frames)
            if sock is self.ctrl:
                self.control_queue.append(msg)
            elif sock is self.fwd_in:
                if msg.kind is not Kind.ACTIVATION:
                    raise ProtocolError(f"stage {self.stage}: {msg.kind.name} on the forward channel")
                self.forward_queue.put(msg)
            else:
                if msg.kind is not Kind.GRADIENT:
                    raise ProtocolError(f"stage {self.stage}: {msg.kind.name} on the backward channel")
                self.backward_queue.put(msg)

    def pump(self, timeout_ms: int) -> bool:
        """Wait up to ``timeout_ms`` for traffic and file it; True if anything arrived."""
        events = self.poller.poll(timeout_ms)
        for sock, _ in events:
            self._drain(sock)
        return bool(events)

    def _check_exit(self) -> None:
        for msg in self.control_queue:
            if msg.kind is Kind.EXIT:
                raise Stopped()

    def wait_data(self, queue: KeyedQueue, step: int, mb: int) -> Message:
        """Block until message ``(step, mb)`` is in ``queue``; an EXIT from the runner interrupts."""
        msg = queue.pop(step, mb)
        if msg is not None:
            return msg
        sock = self.fwd_in if queue is self.forward_queue else self.bwd_in
        if self.spin_s > 0:  # busy-poll briefly: saves a wake-up on the latency-bound path
            end = time.perf_counter() + self.spin_s
            while time.perf_counter() < end:
                if sock.poll(0):
                    self._drain(sock)
                    msg = queue.pop(step, mb)
                    if msg is not None:
                        return msg
                os.sched_yield()  # let ZeroMQ's I/O thread (and other stages) have the core
        while True:
            self.pump(_SLICE_MS)
            msg = queue.pop(step, mb)
            if msg is not None:
                return msg
            self._check_exit()

    def next_control(self, timeout_ms: int) -> Message | None:
        """The next control message, waiting up to ``timeout_ms``; None on time-out."""
        if not self.control_queue:
            self.pump(timeout_ms)
        return self.control_queue.popleft() if self.control_queue else None

    def close(self, linger_ms: int = 0) -> None:
        for s in (self.ctrl, self.fwd_in, self.bwd_in, self.fwd_out, self.bwd_out):
            if s is not None:
                s.close(linger=linger_ms)
        self.ctx.term()


class ControlServer:
    """The runner's end of every stage's control channel (one ROUTER socket)."""

    def __init__(self, transport: str, where: str) -> None:
        self.ctx = zmq.Context(io_threads=1)
        self.sock = self.ctx.socket(zmq.ROUTER)
        tune_socket(self.sock)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.address = _bind(self.sock, transport, where, "control")

    def send(self, stage: int, frames: list[Any]) -> None:
        """Send already-encoded frames (see :func:`codec.encode`) to ``stage``."""
        try:
            self.sock.send_multipart([b"s%d" % stage, *frames], copy=False)
        except zmq.ZMQError as exc:  # ROUTER_MANDATORY: the stage's socket is gone
            if exc.errno == zmq.EHOSTUNREACH:
                raise PeerUnreachable(stage) from None
            raise

    def send_to(self, identity: bytes, frames: list[Any]) -> bool:
        """Best effort: False if no peer of that identity is connected (used on teardown)."""
        try:
            self.sock.send_multipart([identity, *frames], copy=False, flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def recv(self, timeout_ms: int) -> tuple[bytes, Message] | None:
        """``(peer identity, message)`` or None after ``timeout_ms``."""
        if not self.sock.poll(timeout_ms):
            return None
        frames = self.sock.recv_multipart(copy=False)
        return frames[0].bytes, codec.decode(frames[1:])

    def close(self, linger_ms: int = 0) -> None:
        self.sock.close(linger=linger_ms)
        self.ctx.term()


class Heartbeat:
    """A daemon thread that tells the runner, every ``interval`` seconds, that this stage lives.

    It has its own socket (ZeroMQ sockets are not thread-safe) and also watches the driver
    process (``driver_pid``, through a pidfd where Linux has one): if the driver is gone,
    ``on_orphan`` is called (the worker exits), whoever the worker's parent is.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        control_addr: str,
        stage: int,
        interval: float,
        driver_pid: int,
        on_orphan: Callable[[], None],
    ) -> None:
        import threading

        self._stop = threading.Event()
        self._args = (ctx, control_addr, stage, interval, on_orphan)
        self._driver_pid = driver_pid
        self._wake_r, self._wake_w = os.pipe()  # stop() writes here to end a wait at once
        self._thread = threading.Thread(target=self._run, name=f"pipeq-heartbeat-{stage}", daemon=True)
        self._thread.start()

    def _driver_gone(self, pidfd: int | None, timeout: float) -> bool:
        """Wait up to ``timeout`` s (or until :meth:`stop`); True if the driver has exited."""
        if pidfd is not None:
            import select

            p = select.poll()
            p.register(pidfd, select.POLLIN)
            p.register(self._wake_r, select.POLLIN)
            return any(fd == pidfd for fd, _ in p.poll(timeout * 1000))
        self._stop.wait(timeout)
        try:
            os.kill(self._driver_pid, 0)
            return False
        except ProcessLookupError:
            return True
        except PermissionError:
            return False

    def _run(self) -> None:
        ctx, addr, stage, interval, on_orphan = self._args
        try:
            pidfd: int | None = os.pidfd_open(self._driver_pid)  # type: ignore[attr-defined]
        except ProcessLookupError:
            on_orphan()
            return
        except (AttributeError, OSError):
            pidfd = None
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, b"h%d" % stage)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.connect(addr)
        try:
            beat = 0
            while not self._stop.is_set():
                if self._driver_gone(pidfd, interval):
                    on_orphan()
                    return
                beat += 1
                try:
                    sock.send_multipart(codec.encode(Kind.HEARTBEAT, beat), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
        finally:
            sock.close(linger=0)
            if pidfd is not None:
                os.close(pidfd)

    def stop(self) -> None:
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)
