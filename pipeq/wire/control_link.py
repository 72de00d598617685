"""The control channel: the driver's ROUTER, a stage's heartbeat thread, a node agent's link.

Commands, replies, errors and heartbeats travel between the driver (:class:`ControlServer`) and
every stage (its :class:`~pipeq.wire.stage_inbox.StageInbox`'s DEALER, and the DEALER of its
:class:`Heartbeat` thread), and, in multi-host runs, every node agent (:class:`DriverLink`).
Peers on the control channel are named by their ZeroMQ identity: ``s<g>`` a stage process,
``h<g>`` its heartbeat thread, ``a<r>`` node r's agent.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, NamedTuple, Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from pipeq.wire.errors import PeerUnreachable
from pipeq.wire.frames import decode_aligned, frames_of
from pipeq.wire.messages import Kind, Message
from pipeq.wire.security import Gatekeeper, WireAuth, need_auth, secure_client, secure_server
from pipeq.wire.sockets import BindTo, tune_socket

__all__ = ["STAGE", "HEARTBEAT", "AGENT", "Peer", "identity", "peer_of", "ControlServer", "Heartbeat", "DriverLink"]

STAGE, HEARTBEAT, AGENT = "s", "h", "a"  # roles on the control channel (identity prefixes)


class Peer(NamedTuple):
    """Who sent a control message: ``role`` (STAGE, HEARTBEAT or AGENT) and its number."""

    role: str
    index: int


def identity(role: str, index: int) -> bytes:
    """The ZeroMQ identity of peer ``index`` of ``role`` on the control channel."""
    return f"{role}{index}".encode()


def peer_of(identity: bytes) -> Peer | None:
    """The pipeq peer a control-channel identity names, exactly as pipeq spells it (``s2``, never
    ``s02`` or ``s+2``); None for anything else."""
    role, num = identity[:1].decode("latin-1"), identity[1:]
    if role not in (STAGE, HEARTBEAT, AGENT) or not num.isdigit() or len(num) > 9:
        return None
    if num != str(int(num)).encode():
        return None
    return Peer(role, int(num))


class ControlServer:
    """The driver's end of every control channel (one ROUTER socket)."""

    def __init__(self, bind: BindTo, auth: WireAuth | None = None) -> None:
        tcp = bind.scheme == "tcp"
        self.ctx = zmq.Context(io_threads=1)
        self._gate = Gatekeeper.on_tcp(self.ctx, auth, tcp, "a control channel")
        self.sock = self.ctx.socket(zmq.ROUTER)
        tune_socket(self.sock)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # a stage process started again under the same number (a rebuilt replica) takes over its
        # identity at once, even before this socket has noticed that the old one is gone
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if tcp:
            secure_server(self.sock, auth)
        self.address = bind.bind(self.sock, "control")

    def send_many(self, messages: Sequence[tuple[int, Message]]) -> None:
        """Send each ``(process, message)``. Every message is encoded before the first is sent,
        so one that cannot be encoded leaves no stage half-commanded.

        Raises :class:`PeerUnreachable` naming the first process whose socket is gone.
        """
        encoded = [(identity(STAGE, g), frames_of(msg), g) for g, msg in messages]
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
            self.sock.send_multipart([identity(role, index), *frames_of(msg)], copy=False, flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def recv(self, timeout_ms: int) -> tuple[Peer | None, Message] | None:
        """``(sender, message)``, or None after ``timeout_ms``. The sender is None when its
        identity is not one of pipeq's roles. A malformed message raises :class:`CodecError`."""
        if not self.sock.poll(timeout_ms):
            return None
        frames = self.sock.recv_multipart(copy=False)
        return peer_of(frames[0].bytes), decode_aligned(frames[1:])

    def close(self, linger_ms: int = 0) -> None:
        self.sock.close(linger=linger_ms)
        if self._gate is not None:
            self._gate.stop()
        self.ctx.term()


class Heartbeat:
    """A daemon thread that tells the driver, every ``interval`` seconds, that this stage lives.

    It has its own socket (ZeroMQ sockets are not thread-safe) and also watches the driver
    process (``driver_pid``, through a pidfd where Linux has one): if the driver is gone,
    ``on_orphan`` is called (the worker exits), whoever the worker's parent is. Each beat
    carries ``status()`` (the worker's compute action under way and for how long, or None) in
    its ``extra``: how the driver tells a stage stuck in its computation from a waiting one.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        control_addr: str,
        process: int,
        interval: float,
        driver_pid: int,
        on_orphan: Callable[[], None],
        auth: WireAuth | None = None,
        status: Callable[[], dict[str, Any] | None] | None = None,
    ) -> None:
        import threading

        need_auth(auth, control_addr)
        self._status = status
        self._stop = threading.Event()
        self._auth = auth
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
        sock.setsockopt(zmq.IDENTITY, identity(HEARTBEAT, process))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)
        secure_client(sock, self._auth, addr)
        sock.connect(addr)
        try:
            beat = 0
            while not self._stop.is_set():
                if self._driver_gone(pidfd, interval):
                    on_orphan()
                    return
                beat += 1
                try:
                    status = self._status() if self._status is not None else None
                except Exception:  # a report that cannot be made must not stop the beats
                    status = None
                try:
                    sock.send_multipart(frames_of(Message(Kind.HEARTBEAT, beat, extra=status or {})),
                                        flags=zmq.NOBLOCK)
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
                 linger_ms: int = 500, auth: WireAuth | None = None) -> None:
        need_auth(auth, control_addr)
        self.ctx = zmq.Context(io_threads=1)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity(AGENT, node))
        secure_client(self.sock, auth, control_addr)
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
            self.sock.send_multipart(frames_of(msg), flags=0 if block else zmq.NOBLOCK)
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
            return decode_aligned(self.sock.recv_multipart(copy=False))
        return None

    def close(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
        self.sock.close()
        self.ctx.term()
