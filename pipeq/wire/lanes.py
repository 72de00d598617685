"""Lanes: the data hops between stages of one host, on Unix SEQPACKET sockets of their own.

A hop through ZeroMQ wakes three threads (the sender's I/O thread, the receiver's I/O thread,
the receiver), and on a virtual machine each wake-up costs 50-150 us: a small round trip
between two stage processes measured 220-400 us through pipeq's ZeroMQ path, against 45 us
blocking and 7 us polling on a Unix socket. So on one host, where large tensors already travel
through shared memory (:mod:`pipeq.wire.shm`) and a message is little more than its header, a
stage's forward and backward messages take a *lane*: the sender's own thread writes the whole
message as one datagram, and the receiver, polling, has it without any other thread running::

    datagram = [u32 n][u32 length x n][frame 0 (msgpack header)] pad [frame 1] pad ... [frame n-1]

where every frame but the first starts at a multiple of 64 bytes (the padding is implied by the
lengths), so that the tensors built over a received datagram are at torch's alignment.

The frames are exactly the codec's (:mod:`pipeq.wire.codec`), validated the same way on arrival, and
filed in the same keyed queues; a lane only replaces the ZeroMQ socket under them. A message
that does not fit a datagram (:attr:`Lane.max_bytes`: a huge tree description, or a tensor
that could not go through shared memory) still goes through ZeroMQ, which stays connected:
arrival order never mattered (the queues are keyed by step and microbatch).

Only this user can reach a lane: its socket file lives in the run's private ipc directory
(mode 0700), and the receiver checks each connecting peer's uid (SO_PEERCRED). A peer that
goes away is simply forgotten: a failure is the driver's to see and to report.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Any, Sequence

import torch

__all__ = ["Lane", "LaneInbox", "LaneError", "lane_path", "split", "MAX_FRAMES"]

_COUNT = struct.Struct("<I")
MAX_FRAMES = 1 << 16
_SNDBUF = 1 << 20  # asked for; the kernel caps it (net.core.wmem_max) and doubles it
_ALIGN = 64
_PADS = [bytes(i) for i in range(_ALIGN)]
#: a receive that says a datagram's whole length even when it was cut (a plain int: an IntFlag's
#: ``|`` costs microseconds, per poll)
_TRUNC = int(socket.MSG_TRUNC)
_DONTWAIT = int(socket.MSG_DONTWAIT)
MAX_DATAGRAM = 256 << 10  # the largest datagram a Lane sends (its max_bytes is at most this)
_ARENA = 1 << 20  # received datagrams are packed into buffers of this size (see LaneInbox.receive)


def _layout(lengths: Sequence[int]) -> tuple[list[int], int]:
    """Each frame's offset in a datagram and the datagram's size (frames after the first are
    64-byte aligned)."""
    pos = 4 * (len(lengths) + 1)
    offsets = []
    for i, n in enumerate(lengths):
        if i:
            pos = (pos + _ALIGN - 1) & ~(_ALIGN - 1)
        offsets.append(pos)
        pos += n
    return offsets, pos


class LaneError(RuntimeError):
    """A datagram on a lane is not a well-formed sequence of frames."""


def lane_path(ipc_address: str) -> str | None:
    """The lane socket file beside a ZeroMQ ``ipc://`` address (None for any other address)."""
    return ipc_address[len("ipc://"):] + ".lane" if ipc_address.startswith("ipc://") else None


class Lane:
    """The sending end: one connected SEQPACKET socket to a neighbour's :class:`LaneInbox`."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SNDBUF)
            self.sock.connect(path)
        except OSError:
            self.sock.close()
            raise
        # the largest datagram the kernel takes on this socket, with room for its bookkeeping
        self.max_bytes = min(MAX_DATAGRAM, self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 2 - 4096)
        self.broken = False

    def datagram(self, frames: Sequence[Any]) -> list[Any] | None:
        """The parts of the datagram carrying ``frames`` (prefix, frames, padding), or None when
        it would not fit :attr:`max_bytes` (the message then goes through ZeroMQ)."""
        lengths = [memoryview(f).nbytes for f in frames]
        k = len(frames)
        parts: list[Any] = [struct.pack(f"<{k + 1}I", k, *lengths)]
        pos = 4 * (k + 1)
        for i, (f, n) in enumerate(zip(frames, lengths)):
            if i and pos % _ALIGN:
                parts.append(_PADS[_ALIGN - pos % _ALIGN])
                pos += _ALIGN - pos % _ALIGN
            parts.append(f)
            pos += n
        return parts if pos <= self.max_bytes else None

    def send(self, parts: Sequence[Any]) -> bool:
        """Send one :meth:`datagram` without blocking; False when the peer's buffer is full (try
        again after filing this stage's own arrivals). A peer gone is not an error here."""
        if self.broken:
            return True
        try:
            self.sock.sendmsg(parts, [], _DONTWAIT)
        except BlockingIOError:
            return False
        except (BrokenPipeError, ConnectionResetError, ConnectionRefusedError):
            self.broken = True  # the peer is gone: the driver sees it and ends the run
        return True

    def close(self) -> None:
        self.sock.close()


class LaneInbox:
    """The receiving end: a listening socket beside an inbound ZeroMQ socket, and the
    connections its neighbour makes to it. :meth:`fds` are what a poller watches."""

    def __init__(self, path: str, where: str) -> None:
        self.where = where
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self.listener.bind(path)
            self.listener.listen(8)
        except OSError:
            self.listener.close()
            raise
        self.listener.setblocking(False)
        self.listener_fd = self.listener.fileno()  # what a poller reports when a connection waits
        self.conns: list[socket.socket] = []
        self._arena = memoryview(bytearray())  # where the next datagram lands (see receive)
        self._pos = 0
        self._free = self._arena  # the arena from _pos on
        self._room()
        self.changed = False  # conns changed since the owner last looked (re-register the poller)

    def fds(self) -> list[int]:
        return [self.listener_fd, *(c.fileno() for c in self.conns)]

    def accept(self) -> None:
        """Take every waiting connection from a process of this user."""
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
            if hasattr(os, "getuid") and uid != os.getuid():
                conn.close()
                continue
            conn.setblocking(False)
            self.conns.append(conn)
            self.changed = True

    def receive(self, conn: socket.socket) -> list[Any] | None:
        """The frames of the next datagram on ``conn`` (memoryviews over the inbox's buffer), or
        None when none is waiting. A closed connection is dropped.

        One system call per datagram: it lands at the next 64-byte boundary of a buffer of
        :data:`_ARENA` bytes (torch's, 64-byte aligned like torch's own tensors, not zeroed) with
        room for the largest datagram a lane sends; a new buffer is taken once less is left (the
        old one lives as long as the tensors over it). A datagram over that size (no lane sends
        one) is refused, never cut short unseen."""
        view = self._free
        try:
            n = conn.recv_into(view, 0, _TRUNC)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            n = 0
        if n == 0:  # the peer closed (a SEQPACKET datagram is never empty: it has a count)
            self._drop(conn)
            return None
        if n > MAX_DATAGRAM:  # (past len(view), it was cut short)
            raise LaneError(f"{self.where}: a lane datagram of {n} bytes is over the {MAX_DATAGRAM} a lane sends")
        self._pos += (n + _ALIGN - 1) & ~(_ALIGN - 1)
        self._room()
        return split(view[:n], self.where)

    def _room(self) -> None:
        """The free end of the receive buffer (:attr:`_free`), at least :data:`MAX_DATAGRAM` bytes."""
        if len(self._arena) - self._pos < MAX_DATAGRAM:
            self._arena = memoryview(torch.empty(_ARENA, dtype=torch.uint8).numpy())
            self._pos = 0
        self._free = self._arena[self._pos:]

    def _drop(self, conn: socket.socket) -> None:
        if conn in self.conns:
            self.conns.remove(conn)
            self.changed = True
        conn.close()

    def close(self) -> None:
        for c in self.conns:
            c.close()
        self.conns.clear()
        self.listener.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


def split(data: memoryview, where: str = "lane") -> list[memoryview]:
    """A datagram's frames, checked: the count and every length must add up exactly."""
    total = len(data)
    if total < 4:
        raise LaneError(f"{where}: a lane datagram of {total} bytes has no frame count")
    (n,) = _COUNT.unpack_from(data, 0)
    if not 1 <= n <= MAX_FRAMES or 4 * (n + 1) > total:
        raise LaneError(f"{where}: a lane datagram announces {n} frames in {total} bytes")
    lengths = struct.unpack_from(f"<{n}I", data, 4)
    offsets, end = _layout(lengths)
    if end != total:
        raise LaneError(f"{where}: a lane datagram's frame lengths add up to {end} bytes, not its {total}")
    return [data[o:o + length] for o, length in zip(offsets, lengths)]
