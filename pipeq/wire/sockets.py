"""Where and how pipeq's sockets are made: bind addresses, private ipc directories, socket tuning.

Every stage binds its inbound sockets where its :class:`BindTo` says (``ipc://`` files in a
private directory, or ``tcp://`` ports on one address) and connects its outbound ones to its
neighbours' (and its replicas') addresses. Inbound data frames are capped (``max_frame_bytes``,
ZeroMQ's MAXMSGSIZE): a larger one is refused before it is buffered.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from dataclasses import dataclass

import zmq

from pipeq.wire.security import WireAuth, secure_client, secure_server

__all__ = ["BindTo", "make_ipc_dir", "check_private_dir", "remove_ipc_dir", "tune_socket", "tune_process_allocator",
           "data_inlet", "data_outlet"]

#: Socket-level buffering. ZeroMQ's high-water marks stay far above what the keyed queues allow,
#: so that flow control is the schedule's business and never a silent drop.
_HWM = 10_000
_KERNEL_BUF = 4 << 20
_FRAME_SLACK = 1024  # room beside a capped tensor frame for a MAC and ZeroMQ's framing


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


def data_inlet(ctx: zmq.Context, auth: WireAuth | None, tcp: bool, max_frame_bytes: int) -> zmq.Socket:
    """An inbound data socket (PULL), not yet bound: tuned, its frames capped at ``max_frame_bytes``
    (a tensor frame, plus room for a MAC), demanding the job's keys at the handshake on ``tcp``."""
    sock = ctx.socket(zmq.PULL)
    tune_socket(sock)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes + _FRAME_SLACK)
    if tcp:
        secure_server(sock, auth, data=True)
    return sock


def data_outlet(ctx: zmq.Context, auth: WireAuth | None, addr: str) -> zmq.Socket:
    """An outbound data socket (PUSH), tuned, holding the job's keys if ``addr`` is tcp, connected to ``addr``."""
    sock = ctx.socket(zmq.PUSH)
    try:
        tune_socket(sock)
        secure_client(sock, auth, addr, data=True)
        sock.connect(addr)
    except BaseException:  # closed here, or the context could never terminate
        sock.close(linger=0)
        raise
    return sock
