"""ZeroMQ sockets and bounded, keyed queues: how messages move between processes.

This module is the only user of :mod:`pipeq.codec`: everyone else sends and receives
:class:`~pipeq.messages.Message` objects through the classes here, which encode on the way out
and decode (and validate) on the way in. Channels::

            control (DEALER <-> ROUTER): commands, replies, errors, heartbeats
    driver  <------------------------------------------------------------+
    (ControlServer)                                                      |
      |                                                                  |
    stage 0 --forward (PUSH->PULL)--> stage 1 --forward--> ... stage N-1
    stage 0 <--backward (PULL<-PUSH)-- stage 1 <--backward-- ...
    (StageTransport, one per stage process; its Heartbeat thread has a DEALER of its own)

    node agent (DriverLink) --DEALER--> the driver's ROUTER (multi-host runs)

Every stage binds its two inbound sockets where its :class:`BindTo` says (``ipc://`` files in a
private directory, or ``tcp://`` ports on one address) and connects its outbound ones to its
neighbours' addresses. Arriving data messages are filed in a :class:`KeyedQueue` under
``(step, microbatch)``, so the order in which they arrive does not matter, and the queue's
capacity bounds what a stage may hold. Peers on the control channel are named by their
ZeroMQ identity: ``s<g>`` a stage process, ``h<g>`` its heartbeat thread, ``a<r>`` node r's agent.
"""

from __future__ import annotations

import collections
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from . import codec
from .messages import Kind, Message

#: Socket-level buffering. ZeroMQ's high-water marks stay far above what the keyed queues allow,
#: so that flow control is the schedule's business and never a silent drop.
_HWM = 10_000
_KERNEL_BUF = 4 << 20
_SLICE_MS = 200  # how often a blocked wait looks for an EXIT from the driver

STAGE, HEARTBEAT, AGENT = "s", "h", "a"  # roles on the control channel (identity prefixes)


class ProtocolError(RuntimeError):
    """A peer sent something the schedule does not allow (duplicate, overflow, wrong kind)."""


class PeerUnreachable(RuntimeError):
    """The driver could not hand a message to a stage (its control socket is gone)."""

    def __init__(self, process: int) -> None:
        super().__init__(f"stage process {process} is not connected to the control channel")
        self.process = process


class Stopped(Exception):
    """The driver told this stage to exit while it was waiting for data."""


class Peer(NamedTuple):
    """Who sent a control message: ``role`` (STAGE, HEARTBEAT or AGENT) and its number."""

    role: str
    index: int


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
    """A private directory for one pipeline's ``ipc://`` socket files (removed by the driver)."""
    return tempfile.mkdtemp(prefix="pipeq-")


def remove_ipc_dir(path: str | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True)
class BindTo:
    """Where a process binds its inbound sockets: ``ipc`` socket files in ``ipc_dir`` (one host),
    or ``tcp`` ports (chosen by the kernel) on the address ``host``."""

    scheme: str  # "ipc" or "tcp"
    ipc_dir: str = ""
    host: str = ""

    @classmethod
    def ipc(cls, directory: str) -> "BindTo":
        return cls("ipc", ipc_dir=directory)

    @classmethod
    def tcp(cls, host: str) -> "BindTo":
        return cls("tcp", host=host)

    def bind(self, sock: zmq.Socket, name: str) -> str:
        """Bind ``sock`` (``name`` is its file name under ipc); returns the address peers connect to."""
        if self.scheme == "ipc":
            addr = f"ipc://{os.path.join(self.ipc_dir, name)}"
            sock.bind(addr)
            return addr
        sock.bind(f"tcp://{self.host}:0")
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def tune_socket(sock: zmq.Socket) -> None:
    """pipeq's socket options: high-water marks above any queue's bound, 4 MiB kernel buffers."""
    sock.setsockopt(zmq.SNDHWM, _HWM)
    sock.setsockopt(zmq.RCVHWM, _HWM)
    sock.setsockopt(zmq.SNDBUF, _KERNEL_BUF)
    sock.setsockopt(zmq.RCVBUF, _KERNEL_BUF)
    sock.setsockopt(zmq.LINGER, 2000)


def _frames(msg: Message) -> list[Any]:
    return codec.encode(msg.kind, msg.step, msg.microbatch, msg.tensors, msg.extra or None)


def _identity(role: str, index: int) -> bytes:
    return f"{role}{index}".encode()


class StageTransport:
    """The sockets and queues of one stage process. Not thread-safe: the event loop owns it.

    ``process`` is the stage process's number on the control channel (``r * n_stages + k`` for
    replica r's stage k).
    """

    def __init__(
        self, process: int, control_addr: str, *, bind: BindTo, queue_capacity: int, spin_s: float = 0.0
    ) -> None:
        self.process = process
        self.ctx = zmq.Context(io_threads=1)
        self.ctrl = self.ctx.socket(zmq.DEALER)
        self.ctrl.setsockopt(zmq.IDENTITY, _identity(STAGE, process))
        tune_socket(self.ctrl)
        self.ctrl.connect(control_addr)
        self.fwd_in = self.ctx.socket(zmq.PULL)
        self.bwd_in = self.ctx.socket(zmq.PULL)
        for s in (self.fwd_in, self.bwd_in):
            tune_socket(s)
        self.addresses = {
            "forward": bind.bind(self.fwd_in, f"s{process}-fwd"),
            "backward": bind.bind(self.bwd_in, f"s{process}-bwd"),
        }
        self.fwd_out: zmq.Socket | None = None
        self.bwd_out: zmq.Socket | None = None
        self.forward_queue = KeyedQueue(f"stage process {process} forward", queue_capacity)
        self.backward_queue = KeyedQueue(f"stage process {process} backward", queue_capacity)
        self.control_queue: collections.deque[Message] = collections.deque()
        self.poller = zmq.Poller()
        for s in (self.ctrl, self.fwd_in, self.bwd_in):
            self.poller.register(s, zmq.POLLIN)
        self.spin_s = spin_s

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
    # Sends block only past the high-water mark, which the bounded queues keep far away; a stage
    # stuck in one because its peer died is ended by the driver, which watches every process.
    def send_activation(self, step: int, mb: int, tensors: Sequence[torch.Tensor]) -> None:
        assert self.fwd_out is not None, "stage has no next stage"
        self.fwd_out.send_multipart(codec.encode(Kind.ACTIVATION, step, mb, tensors), copy=False)

    def send_gradient(self, step: int, mb: int, tensors: Sequence[torch.Tensor]) -> None:
        assert self.bwd_out is not None, "stage has no previous stage"
        self.bwd_out.send_multipart(codec.encode(Kind.GRADIENT, step, mb, tensors), copy=False)

    def send_control(self, msg: Message) -> None:
        """Send ``msg`` to the driver (replies, errors)."""
        self.ctrl.send_multipart(_frames(msg), copy=False)

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
                    raise ProtocolError(f"stage process {self.process}: {msg.kind.name} on the forward channel")
                self.forward_queue.put(msg)
            else:
                if msg.kind is not Kind.GRADIENT:
                    raise ProtocolError(f"stage process {self.process}: {msg.kind.name} on the backward channel")
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
        """Block until message ``(step, mb)`` is in ``queue``; an EXIT from the driver interrupts."""
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
    """The driver's end of every control channel (one ROUTER socket)."""

    def __init__(self, bind: BindTo) -> None:
        self.ctx = zmq.Context(io_threads=1)
        self.sock = self.ctx.socket(zmq.ROUTER)
        tune_socket(self.sock)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.address = bind.bind(self.sock, "control")

    def send_many(self, messages: Sequence[tuple[int, Message]]) -> None:
        """Send each ``(process, message)``. Every message is encoded before the first is sent,
        so one that cannot be encoded leaves no stage half-commanded.

        Raises :class:`PeerUnreachable` naming the first process whose socket is gone.
        """
        encoded = [(_identity(STAGE, g), _frames(msg), g) for g, msg in messages]
        for ident, frames, g in encoded:
            try:
                self.sock.send_multipart([ident, *frames], copy=False)
            except zmq.ZMQError as exc:  # ROUTER_MANDATORY: the stage's socket is gone
                if exc.errno == zmq.EHOSTUNREACH:
                    raise PeerUnreachable(g) from None
                raise

    def send(self, process: int, msg: Message) -> None:
        self.send_many([(process, msg)])

    def send_best_effort(self, role: str, index: int, msg: Message) -> bool:
        """Send without blocking; False if no such peer is connected (used on teardown)."""
        try:
            self.sock.send_multipart([_identity(role, index), *_frames(msg)], copy=False, flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def recv(self, timeout_ms: int) -> tuple[Peer | None, Message] | None:
        """``(sender, message)``, or None after ``timeout_ms``. The sender is None when its
        identity is not one of pipeq's roles. A malformed message raises :class:`CodecError`."""
        if not self.sock.poll(timeout_ms):
            return None
        frames = self.sock.recv_multipart(copy=False)
        ident = frames[0].bytes
        role, num = ident[:1].decode("latin-1"), ident[1:]
        peer = Peer(role, int(num)) if role in (STAGE, HEARTBEAT, AGENT) and num.isdigit() else None
        return peer, codec.decode(frames[1:])

    def close(self, linger_ms: int = 0) -> None:
        self.sock.close(linger=linger_ms)
        self.ctx.term()


class Heartbeat:
    """A daemon thread that tells the driver, every ``interval`` seconds, that this stage lives.

    It has its own socket (ZeroMQ sockets are not thread-safe) and also watches the driver
    process (``driver_pid``, through a pidfd where Linux has one): if the driver is gone,
    ``on_orphan`` is called (the worker exits), whoever the worker's parent is.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        control_addr: str,
        process: int,
        interval: float,
        driver_pid: int,
        on_orphan: Callable[[], None],
    ) -> None:
        import threading

        self._stop = threading.Event()
        self._args = (ctx, control_addr, process, interval, on_orphan)
        self._driver_pid = driver_pid
        self._wake_r, self._wake_w = os.pipe()  # stop() writes here to end a wait at once
        self._thread = threading.Thread(target=self._run, name=f"pipeq-heartbeat-{process}", daemon=True)
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
        ctx, addr, process, interval, on_orphan = self._args
        try:
            pidfd: int | None = os.pidfd_open(self._driver_pid)  # type: ignore[attr-defined]
        except ProcessLookupError:
            on_orphan()
            return
        except (AttributeError, OSError):
            pidfd = None
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, _identity(HEARTBEAT, process))
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
                    sock.send_multipart(_frames(Message(Kind.HEARTBEAT, beat)), flags=zmq.NOBLOCK)
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


class DriverLink:
    """A node agent's connection to the driver's control channel (identity ``a<node>``).

    With ``heartbeat_s=(interval, timeout)`` ZeroMQ heartbeats run on the connection, so a driver
    host that vanishes (no FIN ever comes) shows as disconnected too; :attr:`connected` is None
    until the first handshake, then True or False, and :attr:`lost_since` (monotonic seconds)
    says since when it is not connected.
    """

    def __init__(self, control_addr: str, node: int, *, heartbeat_s: tuple[float, float] | None = None,
                 linger_ms: int = 500) -> None:
        self.ctx = zmq.Context(io_threads=1)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, _identity(AGENT, node))
        self.sock.setsockopt(zmq.LINGER, linger_ms)
        self.monitor: zmq.Socket | None = None
        if heartbeat_s is not None:
            self.sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_s[0] * 1000))
            self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_s[1] * 1000))
            self.monitor = self.sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self.connected: bool | None = None
        self.lost_since = time.monotonic()
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        if self.monitor is not None:
            self.poller.register(self.monitor, zmq.POLLIN)
        self.sock.connect(control_addr)

    def send(self, msg: Message, *, block: bool = True) -> bool:
        """Send ``msg`` to the driver; without ``block``, False if it cannot go out now."""
        try:
            self.sock.send_multipart(_frames(msg), flags=0 if block else zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            if block:
                raise
            return False

    def recv(self, timeout_ms: int) -> Message | None:
        """A message from the driver, or None after ``timeout_ms`` (connection events are noted
        on the way). A malformed message raises :class:`CodecError`."""
        events = dict(self.poller.poll(timeout_ms))
        if self.monitor is not None and self.monitor in events:
            ev = recv_monitor_message(self.monitor)
            if ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = True
            elif ev["event"] == zmq.EVENT_DISCONNECTED and self.connected:
                self.connected = False
                self.lost_since = time.monotonic()
        if self.sock in events:
            return codec.decode(self.sock.recv_multipart(copy=False))
        return None

    def close(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
        self.sock.close()
        self.ctx.term()
