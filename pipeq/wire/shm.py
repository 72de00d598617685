"""Shared-memory slots: how large tensors cross between stage processes on one host.

A data channel (stage process p's forward output, or its backward output) owns a small pool of
*slots*, each one shared-memory segment that is allocated once and reused for every message.
The sender copies a message's large tensors into a free slot and sends, over ZeroMQ as before,
only the msgpack header (naming the slot) and its small tensors; the receiver copies the
tensors out of the slot into memory of its own and hands the slot back at once::

    sender (SlotWriter)                               receiver (SlotReader)
    --------------------                              ---------------------
    pick a free slot (state 0), or wait               on arrival of the header naming (slot, gen):
    copy the big tensors in (64-byte aligned)  ZMQ     open + map the slot once per generation
    state = 1, send [header, small frames] ------>     check state == 1 and the sizes fit
                                                      copy each tensor out (its own buffer)
    ... reuse the slot when state is 0 again  <-----   state = 0 (pwrite: a syscall, so ordered)

So the queues, the ordering, the codec's validation and the failure handling are ZeroMQ's and
pipeq's as before; only the bytes of large tensors move through memory (two copies, one in each
process, instead of a socket's chunked copies through the kernel). A slot is one file in
``/dev/shm`` named ``<prefix>-<channel>-<slot>-<generation>``; it grows (a new generation, the
old one unlinked) when a message does not fit, up to ``max_bytes``. The receiver unlinks a name
as soon as it has mapped it: from then on the segment has no name and the kernel frees it when
the last of the two processes exits, SIGKILL included. A name that never got mapped (a
receiver killed before the first message) is removed by :func:`remove_segments` by prefix: the
driver does it when the run ends, and a stage does it when it finds its driver gone.

Back-pressure: a sender with no free slot waits (calling ``idle``, with which the transport keeps
draining its own inbound sockets, so two stages that send to each other cannot deadlock, and
watches for the driver's EXIT); memory never grows past ``slots x max_bytes`` per channel.

A header naming a slot index out of range, a generation that is stale or does not exist, a
slot not handed over (state 0), or sizes larger than the slot, raises :class:`SlotError` naming
the channel, the slot and the generation. Names are made from the receiver's own idea of the
channel, so a header can never name another channel's (or another run's) segment.

Device tensors between stage processes on GPUs of one host take CUDA IPC instead, with their
flags in a segment of this kind: :mod:`pipeq.wire.cuda_slots`.
"""

from __future__ import annotations

import mmap
import os
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from pipeq.errors import CodecError

__all__ = ["ShmConfig", "SlotWriter", "SlotReader", "SlotError", "Segment", "available", "run_prefix", "remove_segments",
           "layout", "slot_bytes", "create_segment", "unlink_segment", "SHM_DIR", "HEAD", "MIN_SLOT", "FREE", "FULL",
           "LENT"]

SHM_DIR = "/dev/shm"
HEAD = 64  # bytes before a slot's data: byte 0 is the state, the data is 64-byte aligned
_ALIGN = 64
MIN_SLOT = 1 << 20
FREE, FULL, LENT = 0, 1, 2  # a slot's state byte: the sender fills a FREE one, the receiver lends or frees it


class SlotError(CodecError):
    """A message names a shared-memory slot that is not one this channel handed over."""


@dataclass(frozen=True)
class ShmConfig:
    """Shared-memory payloads of one run (one host): segment names start with ``prefix``; each
    channel has at most ``slots`` slots of at most ``max_bytes`` each; a message's tensors of at
    least ``min_bytes`` travel through a slot, smaller ones in ZeroMQ frames."""

    prefix: str
    slots: int  # the run's shm_slots (pipeq.WireConfig)
    max_bytes: int  # the run's max_message_mb, in bytes
    min_bytes: int = 64 << 10

    def __post_init__(self) -> None:
        if not self.prefix or "/" in self.prefix or not self.prefix.isprintable():
            raise ValueError(f"shared-memory prefix {self.prefix!r}: a plain file name is needed")
        if not 1 <= self.slots <= 64:
            raise ValueError(f"shared-memory slots per channel = {self.slots}: use 1..64 (0 turns shared memory off "
                             "where the runner takes it)")
        if self.min_bytes < 1 or self.max_bytes < self.min_bytes:
            raise ValueError(f"shared memory: min_bytes={self.min_bytes}, max_bytes={self.max_bytes}")

    def name(self, channel: str, slot: int, gen: int) -> str:
        return f"{self.prefix}-{channel}-{slot}-{gen}"


def available() -> bool:
    """Whether this host has POSIX shared memory where pipeq looks for it (Linux's /dev/shm)."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK | os.X_OK)


def run_prefix(ipc_dir: str) -> str:
    """The segment-name prefix of the run whose private ipc directory is ``ipc_dir`` (its
    random name, ``pipeq-XXXXXXXX``): known to the driver and every stage without a message."""
    return os.path.basename(os.path.normpath(ipc_dir))


def remove_segments(prefix: str | None) -> int:
    """Unlink every segment whose name starts with ``prefix-`` (a run's leftovers); returns how
    many. Safe to call any number of times, from any of the run's processes."""
    if not prefix or not os.path.isdir(SHM_DIR):
        return 0
    removed = 0
    for name in os.listdir(SHM_DIR):
        if name.startswith(prefix + "-"):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed += 1
            except OSError:
                pass
    return removed


def slot_bytes(need: int, cap: int) -> int:
    """The size of a slot made to hold ``need`` bytes: the next power of two, at least
    :data:`MIN_SLOT`, at most ``cap``. A slot grows only when a message outgrows it, and then by
    doubling at least, so a channel whose messages change size (sequences of other lengths) makes
    a handful of generations, never one per message, and reuses its slots otherwise."""
    return min(max(MIN_SLOT, 1 << max(0, (need - 1).bit_length())), cap)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Each tensor's offset in a slot's data area, and the bytes they take (64-byte aligned)."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += _align(n)
    return offsets, end


class Segment:
    """One mapped slot: its file descriptor, mapping and a uint8 tensor over its data area."""

    __slots__ = ("name", "gen", "fd", "map", "data", "capacity")

    def __init__(self, name: str, gen: int, fd: int, size: int) -> None:
        self.name, self.gen, self.fd = name, gen, fd
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # fault the pages in once, now
        self.map = mmap.mmap(fd, size, flags=flags)
        self.capacity = size - HEAD
        self.data = torch.frombuffer(self.map, dtype=torch.uint8, count=self.capacity, offset=HEAD)

    @property
    def state(self) -> int:
        return self.map[0]

    def close(self) -> None:
        self.data = None  # type: ignore[assignment]  # the tensor exports the mapping's buffer
        try:
            self.map.close()
        except BufferError:  # a view still lives somewhere: the mapping goes with it
            pass
        fd, self.fd = self.fd, -1  # a late release (a lent view dying after close) must not write
        try:
            os.close(fd)
        except OSError:
            pass

    def release(self) -> None:
        """Hand the slot back to its sender: state 0, through a syscall, so ordered after every
        read of the data before it."""
        if self.fd >= 0:
            try:
                os.pwrite(self.fd, b"\0", 0)
            except OSError:
                pass


def create_segment(name: str, size: int, gen: int) -> Segment:
    """A new segment ``name`` of ``size`` bytes, this user's only (mode 0600), mapped."""
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        return Segment(name, gen, fd, size)
    except BaseException:
        os.close(fd)
        unlink_segment(name)
        raise


class SlotWriter:
    """The sending end of one channel's pool (``channel`` names it, e.g. ``F3``: process 3's
    forward output). ``idle()`` is called while every slot is busy (it may raise to give up)."""

    def __init__(self, cfg: ShmConfig, channel: str, idle: Callable[[], None]) -> None:
        self.cfg, self.channel, self.idle = cfg, channel, idle
        self._slots: list[Segment | None] = [None] * cfg.slots
        self._gens = [0] * cfg.slots
        self.waits = 0  # how often a send found every slot busy (back-pressure)

    def fits(self, sizes: Sequence[int]) -> bool:
        """Whether tensors of these byte sizes fit one slot (laid out 64-byte aligned)."""
        return layout(sizes)[1] <= self.cfg.max_bytes

    def put(self, buffers: Sequence[torch.Tensor]) -> tuple[int, int]:
        """Copy ``buffers`` (flat uint8 tensors) into a free slot; returns ``(slot, generation)``
        for the header. Waits while every slot is busy."""
        offsets, need = layout([b.numel() for b in buffers])
        i = self._free_slot(need)
        seg = self._slots[i]
        if seg is None or seg.capacity < need:
            seg = self._grow(i, need)
        data = seg.data
        for b, off in zip(buffers, offsets):
            data[off:off + b.numel()].copy_(b)
        seg.map[0] = FULL  # after the data; the receiver reads it after ZeroMQ's syscalls
        return i, seg.gen

    def _free_slot(self, need: int) -> int:
        """A free slot: one big enough, else one not made yet, else a small one (to grow)."""
        spins = 0
        while True:
            empty = small = -1
            for i, seg in enumerate(self._slots):
                if seg is None:
                    empty = i if empty < 0 else empty
                elif seg.state == FREE:
                    if seg.capacity >= need:
                        return i
                    small = i if small < 0 else small
            if empty >= 0 or small >= 0:
                return empty if empty >= 0 else small
            if spins == 0:
                self.waits += 1
            spins += 1
            self.idle()  # files this stage's own arrivals, yields the core
            if spins > 4096:  # a receiver that keeps its slots long: stop burning the core
                time.sleep(0.0002)

    def _grow(self, i: int, need: int) -> Segment:
        """(Re)create slot ``i`` with room for ``need`` bytes: a new generation, a new name."""
        old = self._slots[i]
        if old is not None:
            unlink_segment(old.name)
            old.close()
            self._slots[i] = None
        size = slot_bytes(need + HEAD, self.cfg.max_bytes + HEAD)
        self._gens[i] += 1
        seg = self._slots[i] = create_segment(self.cfg.name(self.channel, i, self._gens[i]), size, self._gens[i])
        return seg

    def close(self) -> None:
        for i, seg in enumerate(self._slots):
            if seg is not None:
                unlink_segment(seg.name)  # usually gone already (the receiver unlinks what it mapped)
                seg.close()
                self._slots[i] = None


class SlotReader:
    """The receiving end of one channel's pool: turns a header's ``(slot, generation)`` and its
    tensors' sizes into tensors of this process's own, and hands the slot back.

    While fewer than ``slots - 1`` of the channel's slots are lent out, the tensors are *lent*:
    views of the slot itself (no copy), and the slot goes back to the sender when the last of
    them is garbage (a ``weakref.finalize`` on the array under them). Otherwise they are copied
    out and the slot goes back at once. So at least one slot always circulates, whatever the
    receiver keeps (an activation saved for a backward holds its slot until then)."""

    def __init__(self, cfg: ShmConfig, channel: str, where: str) -> None:
        self.cfg, self.channel, self.where = cfg, channel, where
        self._maps: dict[int, Segment] = {}
        self.lent = 0  # slots whose tensors are views still alive somewhere
        self.lend = cfg.slots > 1

    def _fail(self, slot: object, gen: object, why: str) -> SlotError:
        return SlotError(f"{self.where}: a message names shared-memory slot {slot!r} (generation {gen!r}) of "
                         f"channel {self.channel}, {why}")

    def _segment(self, slot: int, gen: int) -> Segment:
        seg = self._maps.get(slot)
        if seg is not None and seg.gen == gen:
            return seg
        if seg is not None and gen < seg.gen:
            raise self._fail(slot, gen, f"which is older than generation {seg.gen} already in use")
        name = self.cfg.name(self.channel, slot, gen)
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise self._fail(slot, gen, "which does not exist") from None
        except OSError as exc:
            raise self._fail(slot, gen, f"which cannot be opened ({exc.strerror})") from None
        try:
            st = os.fstat(fd)
            if hasattr(os, "getuid") and st.st_uid != os.getuid():
                raise self._fail(slot, gen, f"which belongs to uid {st.st_uid}, not to this user")
            if st.st_size <= HEAD:
                raise self._fail(slot, gen, f"which is {st.st_size} bytes long")
            new = Segment(name, gen, fd, st.st_size)
        except BaseException:
            os.close(fd)
            raise
        unlink_segment(path)  # both ends have it mapped: the kernel frees it with the last of them
        if seg is not None:
            seg.close()
        self._maps[slot] = new
        return new

    def take(self, ref: object, sizes: Sequence[int]) -> list[torch.Tensor]:
        """The buffers (flat uint8 tensors, this process's own) of the tensors in slot ``ref`` =
        ``[slot, generation]`` with byte sizes ``sizes``; the slot is handed back."""
        if type(ref) is not list or len(ref) != 2 or any(type(v) is not int for v in ref):
            raise SlotError(f"{self.where}: bad shared-memory slot reference {ref!r} on channel {self.channel}")
        slot, gen = ref
        if not 0 <= slot < self.cfg.slots:
            raise self._fail(slot, gen, f"which has only slots 0..{self.cfg.slots - 1}")
        if gen < 1:
            raise self._fail(slot, gen, "which is not a generation pipeq makes")
        seg = self._segment(slot, gen)
        if seg.state != FULL:
            raise self._fail(slot, gen, "which its sender has not filled")
        offsets, need = layout(sizes)
        if need > seg.capacity:
            raise self._fail(slot, gen, f"which holds {seg.capacity} bytes, not the {need} the header announces")
        if self.lend and self.lent < self.cfg.slots - 1:
            os.pwrite(seg.fd, bytes([LENT]), 0)  # no longer FULL: a replayed header is refused
            under = np.frombuffer(seg.map, dtype=np.uint8, count=need, offset=HEAD)
            weakref.finalize(under, self._returned, seg)
            self.lent += 1
            base = torch.from_numpy(under)  # keeps ``under`` alive as long as any view of it
            return [base[off:off + n] for n, off in zip(sizes, offsets)]
        data = seg.data
        out = []
        for n, off in zip(sizes, offsets):
            buf = torch.empty(n, dtype=torch.uint8)
            buf.copy_(data[off:off + n])
            out.append(buf)
        seg.release()
        return out

    def _returned(self, seg: Segment) -> None:
        """The last view of a lent slot is gone (in whichever thread dropped it)."""
        self.lent -= 1
        seg.release()

    def close(self) -> None:
        for seg in self._maps.values():
            seg.close()
        self._maps.clear()


def unlink_segment(path_or_name: str) -> None:
    path = path_or_name if path_or_name.startswith("/") else os.path.join(SHM_DIR, path_or_name)
    try:
        os.unlink(path)
    except OSError:
        pass
