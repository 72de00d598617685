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

    stage k, replica r <--replicas (PUSH->PULL, both ways)--> stage k, replica r'
    (ReplicaLink, data parallelism: gradient buckets, replica 0's weights at start)

    node agent (DriverLink) --DEALER--> the driver's ROUTER (multi-host runs)

Every stage binds its two inbound sockets (three with replicas) where its :class:`BindTo` says
(``ipc://`` files in a private directory, or ``tcp://`` ports on one address) and connects its
outbound ones to its neighbours' (and its replicas') addresses.

Nobody without the job's secret gets in (:class:`WireAuth`). An ``ipc`` directory is private to
the user (mode 0700, checked before use). Every ``tcp`` socket is authenticated at the ZeroMQ
handshake by a ZAP handler (:class:`_Gatekeeper`) that admits only keys derived from the secret::

    mode            control channel          data channels (activations, gradients, replicas)
    "encrypt"       CURVE                    CURVE (encrypted and authenticated)
    "authenticate"  CURVE                    PLAIN handshake + a Poly1305 MAC per message

A peer without the keys is refused at the handshake: it can neither read nor inject, and the run
does not notice it. Inbound data frames are capped (``max_frame_bytes``, ZeroMQ's MAXMSGSIZE):
a larger one is refused before it is buffered. Arriving data messages are filed in a :class:`KeyedQueue` under
``(step, microbatch)``, so the order in which they arrive does not matter, and the queue's
capacity bounds what a stage may hold. Peers on the control channel are named by their
ZeroMQ identity: ``s<g>`` a stage process, ``h<g>`` its heartbeat thread, ``a<r>`` node r's agent.

Received tensors are views over ZeroMQ's buffers (zero copy), except small ones that are not at
torch's alignment (:func:`_decode`): the same run computes the same bits every time.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import os
import shutil
import stat
import struct
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import torch
import zmq
from cryptography.hazmat.primitives.poly1305 import Poly1305
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from pipeq.wire import codec
from pipeq.wire.keys import JobSecret
from pipeq.wire.lanes import Lane, LaneInbox, lane_path
from pipeq.wire.shm import CudaSlotReader, CudaSlotWriter, ShmConfig, SlotReader, SlotWriter
from pipeq.wire.messages import Kind, Message

#: Socket-level buffering. ZeroMQ's high-water marks stay far above what the keyed queues allow,
#: so that flow control is the schedule's business and never a silent drop.
_HWM = 10_000
_KERNEL_BUF = 4 << 20
_SLICE_MS = 200  # how often a blocked wait looks for an EXIT from the driver
_COMMAND_SPIN_S = 0.001  # the longest busy-poll for the next command (see next_control)

STAGE, HEARTBEAT, AGENT = "s", "h", "a"  # roles on the control channel (identity prefixes)
SECURITY_MODES = ("encrypt", "authenticate")
DEFAULT_MAX_FRAME = 256 << 20
ZAP_DOMAIN = "pipeq"
_TAG_BYTES = 16  # Poly1305
#: A received tensor under _COPY_BELOW bytes whose address is not a multiple of _ALIGN is copied
#: (see _decode); torch's own allocations are 64-byte aligned.
_ALIGN = 64
_COPY_BELOW = 64 << 10


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
    path = tempfile.mkdtemp(prefix="pipeq-")  # mode 0700, a fresh name
    check_private_dir(path)
    return path


def check_private_dir(path: str) -> None:
    """Refuse an ipc directory another user could reach: it must be a real directory (not a
    symlink) owned by this user with no access for group or others."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise PermissionError(f"ipc directory {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"ipc directory {path} is not a directory (a symlink?); refusing to use it")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise PermissionError(f"ipc directory {path} belongs to uid {st.st_uid}, not to this user "
                              f"({os.getuid()}); refusing to put sockets there")
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise PermissionError(f"ipc directory {path} is open to others (mode {stat.S_IMODE(st.st_mode):o}); "
                              "it must be 0700")


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
            check_private_dir(self.ipc_dir)
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


@dataclass(frozen=True)
class WireAuth:
    """Who may talk to a run over TCP: holders of ``secret``; ``mode`` is "encrypt" (CURVE on
    every socket) or "authenticate" (CURVE on the control channel; data frames in the clear with
    a per-message HMAC, for bandwidth-bound runs: see the README's measurements)."""

    secret: JobSecret
    mode: str = "encrypt"

    def __post_init__(self) -> None:
        if self.mode not in SECURITY_MODES:
            raise ValueError(f"tcp_security={self.mode!r}: use one of {SECURITY_MODES}")

    def curve(self, role: str) -> tuple[bytes, bytes]:
        """The (public, secret) CURVE key pair of ``role`` ("server" or "client"), z85."""
        secret_key = z85.encode(self.secret.derive(f"curve-{role}"))
        return zmq.curve_public(secret_key), secret_key

    def plain_password(self) -> bytes:
        return self.secret.derive("data-plain").hex().encode()


def _tcp(addr: str) -> bool:
    return addr.startswith("tcp://")


def _need_auth(auth: WireAuth | None, addr: str) -> None:
    if auth is None and _tcp(addr):
        raise ValueError(f"{addr}: a tcp socket needs the job's secret (WireAuth); pipeq never "
                         "opens an unauthenticated TCP port")


def secure_server(sock: zmq.Socket, auth: WireAuth | None, *, data: bool = False) -> None:
    """Make ``sock`` (about to bind on tcp) demand the job's keys at the handshake."""
    if auth is None:
        return
    if data and auth.mode == "authenticate":
        sock.plain_server = True
    else:
        public, secret = auth.curve("server")
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler: refuse, never admit


def secure_client(sock: zmq.Socket, auth: WireAuth | None, addr: str, *, data: bool = False) -> None:
    """Give ``sock`` (about to connect to ``addr``) the job's keys, if ``addr`` is tcp."""
    _need_auth(auth, addr)
    if auth is None or not _tcp(addr):
        return
    if data and auth.mode == "authenticate":
        sock.plain_username = b"pipeq"
        sock.plain_password = auth.plain_password()
    else:
        sock.curve_serverkey = auth.curve("server")[0]
        sock.curve_publickey, sock.curve_secretkey = auth.curve("client")


class _Gatekeeper:
    """The ZAP handler of one ZeroMQ context: admits the job's CURVE client key and the job's
    PLAIN password, refuses everything else (refused peers are never seen by pipeq's code)."""

    def __init__(self, ctx: zmq.Context, auth: WireAuth) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        client_key = auth.curve("client")[0]

        class _Keys:
            def callback(self, domain: str, key: bytes) -> bool:
                return hmac.compare_digest(key, client_key)

        # pyzmq logs each denial at DEBUG only: an attacker cannot flood the logs
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("pipeq.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_Keys())
        self._auth.configure_plain(ZAP_DOMAIN, {"pipeq": auth.plain_password().decode()})

    def stop(self) -> None:
        self._auth.stop()


class _FrameMac:
    """Per-message MACs of one data channel in "authenticate" mode.

    A sealed message is ``[seq (8 bytes) + tag (16), header, buffers...]``. The tag is a
    Poly1305 MAC (12 GB/s here, 7x HMAC-SHA256) under a one-time key derived from the job's
    data key, the channel's label (which stage sent it, which direction) and the sequence number;
    it covers the sequence number and every frame with its length. The receiver drops a message
    whose tag does not verify or whose sequence number is not above the last one it accepted (a
    replay), without a word: a forger must not be able to end the run.
    """

    __slots__ = ("_key", "_label", "seq", "dropped")

    def __init__(self, auth: WireAuth, label: str) -> None:
        self._key = auth.secret.derive("data-mac")
        self._label = label.encode()
        self.seq = 0
        self.dropped = 0

    def _tag(self, seq: bytes, frames: Sequence[Any]) -> bytes:
        one_time = hmac.new(self._key, self._label + b"\0" + seq, hashlib.sha256).digest()
        mac = Poly1305(one_time)
        mac.update(seq)
        for f in frames:
            view = memoryview(f)
            mac.update(struct.pack(">Q", view.nbytes))
            mac.update(view)
        return mac.finalize()

    def seal(self, frames: list[Any]) -> list[Any]:
        self.seq += 1
        seq = struct.pack(">Q", self.seq)
        return [seq + self._tag(seq, frames), *frames]

    def open(self, frames: Sequence[Any]) -> Sequence[Any] | None:
        """The message's frames if it is genuine and new, else None."""
        if len(frames) < 2:
            self.dropped += 1
            return None
        head = memoryview(frames[0]).tobytes()
        if len(head) != 8 + _TAG_BYTES:
            self.dropped += 1
            return None
        (seq,) = struct.unpack(">Q", head[:8])
        if seq <= self.seq or not hmac.compare_digest(head[8:], self._tag(head[:8], frames[1:])):
            self.dropped += 1
            return None
        self.seq = seq
        return frames[1:]


def _decode(frames: Sequence[Any], take: codec.Take | None = None, take_device: codec.Take | None = None) -> Message:
    """:func:`codec.decode`, with every small tensor at torch's alignment.

    ZeroMQ hands over a small frame where it lies in its 8 KiB receive buffer, at an address that
    depends on how the bytes happened to arrive (one read or two), so it changes from run to run
    and under load; and MKL's matrix products round differently for an operand at another
    address modulo 16 (1 ulp, e.g. a Linear(16, 3) on a 12x16 float32 input). Those tensors are
    copied (under 64 KiB: microseconds). A larger frame has a ZeroMQ allocation of its own, always at the
    same offset from malloc's 16-byte alignment, and is used in place (zero copy).
    """
    msg = codec.decode(frames, take, take_device)
    if any(t.data_ptr() % _ALIGN and t.nbytes < _COPY_BELOW for t in msg.tensors):
        msg.tensors = [t.clone() if t.data_ptr() % _ALIGN and t.nbytes < _COPY_BELOW else t
                       for t in msg.tensors]
    return msg


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
        self, process: int, control_addr: str, *, bind: BindTo, queue_capacity: int, spin_s: float = 0.0,
        auth: WireAuth | None = None, max_frame_bytes: int = DEFAULT_MAX_FRAME, shm: ShmConfig | None = None,
        device: torch.device | None = None,
    ) -> None:
        """``shm``: large tensors to and from this stage's neighbours travel through shared
        memory (:mod:`pipeq.shm`; ipc only: every neighbour is on this host); with a CUDA
        ``device`` as well, device tensors travel through CUDA IPC (:attr:`device_payloads`)."""
        self.process = process
        self.auth = auth
        self.max_frame_bytes = max_frame_bytes
        self.ctx = zmq.Context(io_threads=1)
        tcp = bind.scheme == "tcp"
        if tcp and auth is None:
            raise ValueError("a stage bound on tcp needs the job's secret (WireAuth)")
        self._gate = _Gatekeeper(self.ctx, auth) if tcp and auth is not None else None
        self.ctrl = self.ctx.socket(zmq.DEALER)
        self.ctrl.setsockopt(zmq.IDENTITY, _identity(STAGE, process))
        tune_socket(self.ctrl)
        secure_client(self.ctrl, auth, control_addr)
        self.ctrl.connect(control_addr)
        self.fwd_in = self.ctx.socket(zmq.PULL)
        self.bwd_in = self.ctx.socket(zmq.PULL)
        for s in (self.fwd_in, self.bwd_in):
            tune_socket(s)
            s.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes + 1024)  # tensor frame + MAC/slack
            if tcp:
                secure_server(s, auth, data=True)
        self.addresses = {
            "forward": bind.bind(self.fwd_in, f"s{process}-fwd"),
            "backward": bind.bind(self.bwd_in, f"s{process}-bwd"),
        }
        # "authenticate" mode: inbound data is MAC-checked per message, outbound is sealed
        macs = tcp and auth is not None and auth.mode == "authenticate"
        self._mac_in = {self.fwd_in: _FrameMac(auth, f"F{process - 1}"),
                        self.bwd_in: _FrameMac(auth, f"B{process + 1}")} if macs else {}
        self._mac_fwd = _FrameMac(auth, f"F{process}") if macs else None
        self._mac_bwd = _FrameMac(auth, f"B{process}") if macs else None
        self.fwd_out: zmq.Socket | None = None
        self.bwd_out: zmq.Socket | None = None
        if shm is not None and tcp:
            raise ValueError("shared-memory payloads are for one host (ipc); a tcp stage sends frames")
        self.shm = shm
        where = f"stage process {process}"
        # a message on fwd_in comes from process - 1's forward output, on bwd_in from process + 1's backward
        self._readers = {self.fwd_in: SlotReader(shm, f"F{process - 1}", where),
                         self.bwd_in: SlotReader(shm, f"B{process + 1}", where)} if shm is not None else {}
        self._slots_fwd: SlotWriter | None = None
        self._slots_bwd: SlotWriter | None = None
        #: CUDA tensors cross to the neighbours as they are (CUDA IPC), not through host memory
        self.device_payloads = shm is not None and device is not None and device.type == "cuda"
        self.device = device
        self._dev_readers = {self.fwd_in: CudaSlotReader(shm, f"F{process - 1}", device, where),
                             self.bwd_in: CudaSlotReader(shm, f"B{process + 1}", device, where)
                             } if self.device_payloads and shm is not None and device is not None else {}
        self._dev_fwd: CudaSlotWriter | None = None
        self._dev_bwd: CudaSlotWriter | None = None
        self.forward_queue = KeyedQueue(f"stage process {process} forward", queue_capacity)
        self.backward_queue = KeyedQueue(f"stage process {process} backward", queue_capacity)
        self.control_queue: collections.deque[Message] = collections.deque()
        self.poller = zmq.Poller()
        for s in (self.ctrl, self.fwd_in, self.bwd_in):
            self.poller.register(s, zmq.POLLIN)
        self.spin_s = spin_s
        # one host, shared memory on: the data hops take lanes (pipeq.lanes), ZeroMQ stays for
        # whatever does not fit a lane's datagram
        self._inboxes: dict[zmq.Socket, LaneInbox] = {}
        if shm is not None:
            for sock, key in ((self.fwd_in, "forward"), (self.bwd_in, "backward")):
                path = lane_path(self.addresses[key])
                if path is not None:
                    self._inboxes[sock] = LaneInbox(path, f"stage process {process} {key} lane")
        self._lane_fds: dict[int, zmq.Socket] = {}  # a lane's fd -> the ZeroMQ socket it stands beside
        self._register_lanes()
        self._lane_fwd: Lane | None = None
        self._lane_bwd: Lane | None = None

    # -- wiring --------------------------------------------------------------------------------
    def connect(self, next_forward: str | None, prev_backward: str | None) -> None:
        if next_forward:
            self.fwd_out = self.ctx.socket(zmq.PUSH)
            tune_socket(self.fwd_out)
            secure_client(self.fwd_out, self.auth, next_forward, data=True)
            self.fwd_out.connect(next_forward)
            self._lane_fwd = self._connect_lane(next_forward)
            if self.shm is not None:
                self._slots_fwd = SlotWriter(self.shm, f"F{self.process}", self._idle)
                if self.device_payloads:
                    self._dev_fwd = CudaSlotWriter(self.shm, f"F{self.process}", self.device, self._idle)
        if prev_backward:
            self.bwd_out = self.ctx.socket(zmq.PUSH)
            tune_socket(self.bwd_out)
            secure_client(self.bwd_out, self.auth, prev_backward, data=True)
            self.bwd_out.connect(prev_backward)
            self._lane_bwd = self._connect_lane(prev_backward)
            if self.shm is not None:
                self._slots_bwd = SlotWriter(self.shm, f"B{self.process}", self._idle)
                if self.device_payloads:
                    self._dev_bwd = CudaSlotWriter(self.shm, f"B{self.process}", self.device, self._idle)

    def _register_lanes(self) -> None:
        """(Re)register every lane socket with the poller (after a connection came or went)."""
        for fd in self._lane_fds:
            self.poller.unregister(fd)
        self._lane_fds = {fd: sock for sock, box in self._inboxes.items() for fd in box.fds()}
        for fd in self._lane_fds:
            self.poller.register(fd, zmq.POLLIN)
        for box in self._inboxes.values():
            box.changed = False

    def _connect_lane(self, address: str) -> Lane | None:
        path = lane_path(address) if self.shm is not None else None
        if path is None:
            return None
        try:
            return Lane(path)
        except OSError:  # the neighbour has no lane (shared memory off there): ZeroMQ only
            return None

    def _idle(self) -> None:
        """Every shared-memory slot of a channel is busy: file what has arrived meanwhile (its
        slots are freed, so two stages sending to each other never wait on each other) and give
        up on the driver's EXIT. Does not block: the caller comes back at once to look again."""
        self.pump(0)
        self._check_exit()
        os.sched_yield()

    @property
    def shm_waits(self) -> int:
        """How often a send found every shared-memory slot of its channel busy."""
        return sum(w.waits for w in (self._slots_fwd, self._slots_bwd, self._dev_fwd, self._dev_bwd) if w is not None)

    @property
    def dropped(self) -> int:
        """Inbound data messages dropped as forged or replayed ("authenticate" mode)."""
        return sum(m.dropped for m in self._mac_in.values())

    def _data_frames(self, kind: Kind, step: int, mb: int, tensors: Sequence[torch.Tensor],
                     mac: "_FrameMac | None", extra: dict[str, Any] | None = None,
                     slots: SlotWriter | None = None, dev: CudaSlotWriter | None = None) -> list[Any]:
        place = None
        if slots is not None:
            low = slots.cfg.min_bytes
            big = [n for n in (t.numel() * t.element_size() for t in tensors if not t.is_cuda) if n >= low]
            if big and slots.fits(big):
                place = slots.put
        frames = codec.encode(kind, step, mb, tensors, extra, place, slots.cfg.min_bytes if place else 0,
                              dev.put if dev is not None else None)
        for f in frames[1:]:
            if f.nbytes > self.max_frame_bytes:
                t = next(t for t in tensors if t.numel() * t.element_size() == f.nbytes)
                raise ValueError(
                    f"stage process {self.process}: the {kind.name.lower()} of step {step} microbatch {mb} "
                    f"holds a tensor of {f.nbytes / 2**20:.1f} MiB (shape {list(t.shape)}, {t.dtype}), over "
                    f"the {self.max_frame_bytes / 2**20:.0f} MiB cap of a data frame; raise max_message_mb "
                    "(PipelineRunner / the job file) or use smaller microbatches")
        return mac.seal(frames) if mac is not None else frames

    # -- sending -------------------------------------------------------------------------------
    # Sends block only past the high-water mark, which the bounded queues keep far away; a stage
    # stuck in one because its peer died is ended by the driver, which watches every process.
    def send_activation(self, step: int, mb: int, tensors: Sequence[torch.Tensor], tree: Any = None) -> None:
        """``tree``: the description of a stage output that is not a tuple of tensors
        (:mod:`pipeq.microbatch`), sent in the header."""
        assert self.fwd_out is not None, "stage has no next stage"
        extra = {"tree": tree} if tree is not None else None
        self._send(self.fwd_out, self._lane_fwd, self._data_frames(Kind.ACTIVATION, step, mb, tensors, self._mac_fwd,
                                                                   extra, self._slots_fwd, self._dev_fwd))

    def send_gradient(self, step: int, mb: int, tensors: Sequence[torch.Tensor]) -> None:
        assert self.bwd_out is not None, "stage has no previous stage"
        self._send(self.bwd_out, self._lane_bwd, self._data_frames(Kind.GRADIENT, step, mb, tensors, self._mac_bwd,
                                                                   None, self._slots_bwd, self._dev_bwd))

    def _send(self, sock: zmq.Socket, lane: Lane | None, frames: list[Any]) -> None:
        """Through the lane when there is one and the message fits a datagram, else ZeroMQ. A
        full lane is waited out filing this stage's own arrivals (see :meth:`_idle`)."""
        parts = lane.datagram(frames) if lane is not None else None
        if parts is not None:
            while not lane.send(parts):  # type: ignore[union-attr]
                self._idle()
            return
        sock.send_multipart(frames, copy=False)

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
            mac = self._mac_in.get(sock)
            if mac is not None:
                frames = mac.open(frames)
                if frames is None:
                    continue  # forged, replayed or garbage: dropped (counted in ``dropped``)
            self._file(sock, frames)

    def _file(self, sock: zmq.Socket, frames: Sequence[Any]) -> None:
        """Decode a message that arrived on ``sock`` (or its lane) and queue it."""
        reader, dev = self._readers.get(sock), self._dev_readers.get(sock)
        msg = _decode(frames, reader.take if reader is not None else None, dev.take if dev is not None else None)
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

    def _drain_lane(self, sock: zmq.Socket, accept: bool = False) -> bool:
        """File every message waiting on the lane beside ``sock``; True if any came. New
        connections are taken when ``accept`` (the poller saw one) or while there is none."""
        box = self._inboxes[sock]
        if accept or not box.conns:
            box.accept()
        got = False
        for conn in list(box.conns):
            while True:
                frames = box.receive(conn)
                if frames is None:
                    break
                got = True
                self._file(sock, frames)
        if box.changed:
            self._register_lanes()
        return got

    def pump(self, timeout_ms: int) -> bool:
        """Wait up to ``timeout_ms`` for traffic and file it; True if anything arrived."""
        events = self.poller.poll(timeout_ms)
        for sock, _ in events:
            if type(sock) is int:
                self._drain_lane(self._lane_fds[sock], accept=True)
            else:
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
            lane = sock in self._inboxes
            end = time.perf_counter() + self.spin_s
            spins = 0
            while time.perf_counter() < end:
                # a lane is read with one non-blocking syscall; ZeroMQ (what does not fit a
                # lane) is looked at every 16th turn
                if (lane and self._drain_lane(sock)) or ((not lane or spins & 15 == 0) and sock.poll(0)):
                    self._drain(sock)
                    msg = queue.pop(step, mb)
                    if msg is not None:
                        return msg
                spins += 1
                os.sched_yield()  # let other stages (and ZeroMQ's I/O thread) have the core
        while True:
            self.pump(_SLICE_MS)
            msg = queue.pop(step, mb)
            if msg is not None:
                return msg
            self._check_exit()

    def next_control(self, timeout_ms: int) -> Message | None:
        """The next control message, waiting up to ``timeout_ms``; None on time-out. Like data,
        a command is busy-polled first, for at most 1 ms (``spin_s`` if shorter): the next
        step's TRAIN follows the last one's LOSS within a driver's round trip when the caller
        loops, and an idle stage must not keep a core busy."""
        if not self.control_queue and self.spin_s > 0:
            end = time.perf_counter() + min(self.spin_s, _COMMAND_SPIN_S, timeout_ms / 1000)
            while not self.control_queue and time.perf_counter() < end:
                self._drain(self.ctrl)
                if not self.control_queue:
                    os.sched_yield()
        if not self.control_queue:
            self.pump(timeout_ms)
        return self.control_queue.popleft() if self.control_queue else None

    def close(self, linger_ms: int = 0) -> None:
        for s in (self.ctrl, self.fwd_in, self.bwd_in, self.fwd_out, self.bwd_out):
            if s is not None:
                s.close(linger=linger_ms)
        for w in (self._slots_fwd, self._slots_bwd, self._dev_fwd, self._dev_bwd, self._lane_fwd, self._lane_bwd,
                  *self._inboxes.values()):
            if w is not None:
                w.close()
        for reader in (*self._readers.values(), *self._dev_readers.values()):
            reader.close()
        if self._gate is not None:
            self._gate.stop()
        self.ctx.term()



class ReplicaLink:
    """Stage k's channel to the same stage of the other replicas (data parallelism).

    Replica r of stage k binds one more inbound socket (PULL, where its :class:`BindTo` says; on
    tcp it demands the job's keys like the data channels, and its frames are capped alike) and,
    once told its siblings' addresses (:meth:`connect`), pushes to each of them on a socket of its
    own. What travels is whole tensors for one ``(step, index)``: the gradient buckets of a step,
    replica 0's weights at start. A message is::

        [origin, header, tensor frames...]           ipc, or tcp "encrypt" (CURVE)
        [origin, seq + MAC, header, tensor frames...]  tcp "authenticate"

    where ``origin`` is the sender's replica number (4 bytes, big-endian). In "authenticate" mode
    it picks the :class:`_FrameMac` of the link ``origin -> this replica`` (its label names the
    stage and both ends), so a message verifies only on the link it was sealed for; a forged,
    replayed or misdirected one is dropped without a word, like on the pipeline's channels.

    Arrivals are filed under ``(sender, step, index)`` (at most ``capacity`` at once);
    :meth:`wait` blocks for one, and an EXIT from the driver (read from the stage's control
    socket, which it polls too) interrupts it with :class:`Stopped`: a replica whose sibling died
    waits until the driver, which watches every process, ends the run. The link shares the stage
    transport's ZeroMQ context (and so its ZAP handler); close it before the transport.
    """

    def __init__(self, transport: StageTransport, bind: BindTo, *, stage: int, replica: int, replicas: int,
                 capacity: int, shard: int = 0) -> None:
        """``shard``: with tensor parallelism, the stage's shard this link sums (its MACs name it)."""
        if not 0 <= replica < replicas:
            raise ValueError(f"replica {replica} of {replicas}")
        tcp = bind.scheme == "tcp"
        if tcp and transport.auth is None:
            raise ValueError("a replica link bound on tcp needs the job's secret (WireAuth)")
        self.transport = transport
        self.stage = stage
        self.shard = shard
        self.replica = replica
        self.replicas = replicas
        self.capacity = capacity
        self.sock = transport.ctx.socket(zmq.PULL)
        tune_socket(self.sock)
        self.sock.setsockopt(zmq.MAXMSGSIZE, transport.max_frame_bytes + 1024)  # tensor frame + MAC/slack
        if tcp:
            secure_server(self.sock, transport.auth, data=True)
        self.address = bind.bind(self.sock, f"s{transport.process}-replicas")
        auth = transport.auth
        macs = tcp and auth is not None and auth.mode == "authenticate"
        others = [r for r in range(replicas) if r != replica]
        self._mac_in = {r: _FrameMac(auth, self._label(r, replica)) for r in others} if macs else {}
        self._mac_out = {r: _FrameMac(auth, self._label(replica, r)) for r in others} if macs else {}
        self._origin = struct.pack(">I", replica)
        self._out: dict[int, zmq.Socket] = {}
        self._inbox: dict[tuple[int, int, int], Sequence[torch.Tensor]] = {}
        self._bad_origin = 0
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(transport.ctrl, zmq.POLLIN)
        # data keeps being filed while this replica waits: a neighbour waiting for one of this
        # stage's shared-memory slots to come free must not wait on the all-reduce
        self.poller.register(transport.fwd_in, zmq.POLLIN)
        self.poller.register(transport.bwd_in, zmq.POLLIN)

    def _label(self, sender: int, receiver: int) -> str:
        return f"R{self.stage}" + (f".{self.shard}" if self.shard else "") + f":{sender}>{receiver}"

    def connect(self, addresses: Sequence[str]) -> None:
        """Connect to every other replica; ``addresses[r]`` is replica r's bound address."""
        if len(addresses) != self.replicas or not all(type(a) is str for a in addresses):
            raise ValueError(f"stage {self.stage}, replica {self.replica}: expected the addresses of "
                             f"{self.replicas} replicas, got {addresses!r}")
        for r, addr in enumerate(addresses):
            if r == self.replica or r in self._out:
                continue
            sock = self.transport.ctx.socket(zmq.PUSH)
            tune_socket(sock)
            secure_client(sock, self.transport.auth, addr, data=True)
            sock.connect(addr)
            self._out[r] = sock

    @property
    def dropped(self) -> int:
        """Inbound messages dropped as forged, replayed or misdirected ("authenticate" mode)."""
        return self._bad_origin + sum(m.dropped for m in self._mac_in.values())

    # -- sending -------------------------------------------------------------------------------
    def send(self, step: int, index: int, tensors: Sequence[torch.Tensor], to: Sequence[int] | None = None) -> None:
        """Send ``tensors`` (CPU tensors ZeroMQ may read until it is done with them: never
        modify them after) as ``(step, index)`` to replicas ``to`` (default: every other one).
        Does not block (short of ZeroMQ's high-water mark, far above what a step sends)."""
        frames = codec.encode(Kind.REPLICA, step, index, tensors)
        for i, f in enumerate(frames[1:]):
            if f.nbytes > self.transport.max_frame_bytes:
                raise ValueError(
                    f"stage {self.stage}, replica {self.replica}: tensor {i} of message ({step}, {index}) to the "
                    f"other replicas is {f.nbytes / 2**20:.1f} MiB, over the "
                    f"{self.transport.max_frame_bytes / 2**20:.0f} MiB cap of a data frame")
        targets = [r for r in range(self.replicas) if r != self.replica] if to is None else to
        for r in targets:
            sock = self._out.get(r)
            if sock is None:
                raise RuntimeError(f"stage {self.stage}, replica {self.replica}: not connected to replica {r}")
            mac = self._mac_out.get(r)
            sock.send_multipart([self._origin, *(mac.seal(frames) if mac is not None else frames)], copy=False)

    # -- receiving -----------------------------------------------------------------------------
    def _sender(self, frame: Any) -> int | None:
        head = memoryview(frame).tobytes()
        if len(head) == 4:
            (r,) = struct.unpack(">I", head)
            if r < self.replicas and r != self.replica:
                return r
        return None

    def _drain(self) -> None:
        """File every message waiting on the inbound socket."""
        while True:
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            sender = self._sender(frames[0])
            body: Sequence[Any] | None = frames[1:]
            if self._mac_in:
                if sender is None:
                    self._bad_origin += 1
                    continue
                body = self._mac_in[sender].open(frames[1:])
                if body is None:
                    continue  # forged, replayed or sealed for another link: dropped
            elif sender is None:  # only the job's processes get this far: a bug, not an attack
                raise ProtocolError(f"stage {self.stage}, replica {self.replica}: a message from the other "
                                    f"replicas names no valid sender ({memoryview(frames[0]).tobytes()!r})")
            msg = codec.decode(body)
            if msg.kind is not Kind.REPLICA:
                raise ProtocolError(f"stage {self.stage}, replica {self.replica}: {msg.kind.name} on the "
                                    "replicas' channel")
            key = (sender, msg.step, msg.microbatch)
            if key in self._inbox:
                raise ProtocolError(f"stage {self.stage}, replica {self.replica}: duplicate message "
                                    f"({msg.step}, {msg.microbatch}) from replica {sender}")
            if len(self._inbox) >= self.capacity:
                raise ProtocolError(f"stage {self.stage}, replica {self.replica}: {self.capacity} messages "
                                    "from the other replicas are waiting; one is running ahead")
            self._inbox[key] = msg.tensors

    def wait(self, sender: int, step: int, index: int) -> Sequence[torch.Tensor]:
        """Block until replica ``sender``'s message ``(step, index)`` is here and return its
        tensors (views over the received frames: this replica's to keep, and to write to).
        An EXIT from the driver interrupts the wait (:class:`Stopped`)."""
        key = (sender, step, index)
        got = self._inbox.pop(key, None)
        ctrl = self.transport.ctrl
        slice_ms = 5 if self.transport._inboxes else _SLICE_MS  # lanes are not in this poller: look often
        while got is None:
            events = dict(self.poller.poll(slice_ms))
            if self.sock in events:
                self._drain()
            for s in (ctrl, self.transport.fwd_in, self.transport.bwd_in):
                if s in events:
                    self.transport._drain(s)  # commands and data queue up for the event loop
            for s in self.transport._inboxes:
                self.transport._drain_lane(s)
            got = self._inbox.pop(key, None)
            if got is None:
                self.transport._check_exit()
        return got

    def close(self, linger_ms: int = 0) -> None:
        for s in (self.sock, *self._out.values()):
            s.close(linger=linger_ms)
        self._out.clear()


class ControlServer:
    """The driver's end of every control channel (one ROUTER socket)."""

    def __init__(self, bind: BindTo, auth: WireAuth | None = None) -> None:
        if bind.scheme == "tcp" and auth is None:
            raise ValueError("a control channel on tcp needs the job's secret (WireAuth)")
        self.ctx = zmq.Context(io_threads=1)
        self._gate = _Gatekeeper(self.ctx, auth) if bind.scheme == "tcp" and auth is not None else None
        self.sock = self.ctx.socket(zmq.ROUTER)
        tune_socket(self.sock)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if bind.scheme == "tcp":
            secure_server(self.sock, auth)
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
        return peer_of(frames[0].bytes), _decode(frames[1:])

    def close(self, linger_ms: int = 0) -> None:
        self.sock.close(linger=linger_ms)
        if self._gate is not None:
            self._gate.stop()
        self.ctx.term()


def peer_of(identity: bytes) -> Peer | None:
    """The pipeq peer a control-channel identity names, exactly as pipeq spells it (``s2``, never
    ``s02`` or ``s+2``); None for anything else."""
    role, num = identity[:1].decode("latin-1"), identity[1:]
    if role not in (STAGE, HEARTBEAT, AGENT) or not num.isdigit() or len(num) > 9:
        return None
    if num != str(int(num)).encode():
        return None
    return Peer(role, int(num))


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

        _need_auth(auth, control_addr)
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
        sock.setsockopt(zmq.IDENTITY, _identity(HEARTBEAT, process))
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
                    sock.send_multipart(_frames(Message(Kind.HEARTBEAT, beat, extra=status or {})),
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
        _need_auth(auth, control_addr)
        self.ctx = zmq.Context(io_threads=1)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, _identity(AGENT, node))
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
            return _decode(self.sock.recv_multipart(copy=False))
        return None

    def close(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
        self.sock.close()
        self.ctx.term()
