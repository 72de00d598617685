"""Device slots: how CUDA tensors cross between stage processes on GPUs of one host (CUDA IPC).

The device counterpart of :mod:`pipeq.wire.shm`'s slots, written for stage processes on GPUs of
one host (tests/gpu exercises it; a machine without CUDA never builds one)::

    sender (CudaSlotWriter)                           receiver (CudaSlotReader)
    slot i: a device buffer, exported once             opens the buffer and the event once per
    (storage._share_cuda_, torch.multiprocessing's      (slot, generation): _new_shared_cuda,
    mechanism) and an interprocess event               Event.from_ipc_handle
    copy_ tensors into it on the current stream        current stream waits on the event,
    event.record(); flag[i] = 1 (host shm)   --ZMQ-->  copies out to its own device, synchronizes,
    the header carries the handles                     flag[i] = 0 (pwrite)

The flags live in a small host segment per channel (``<prefix>-<channel>-cuda-0-1``), the
handles travel in the header and are checked for shape and type; the receiver never reads past
the size it was given when it opened the buffer. As with host slots, a slot grows (a new buffer,
a new generation of handles; the receiver drops the old mapping when it opens the new one) only
when a message outgrows it, sized by :func:`~pipeq.wire.shm.slot_bytes` (doubling, at most
``max_bytes``: a larger message is refused, naming ``max_message_mb``), and is reused otherwise.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Sequence

import torch

from pipeq.wire.shm import (FREE, FULL, HEAD, SHM_DIR, Segment, ShmConfig, SlotError, create_segment, layout,
                             slot_bytes, unlink_segment)

__all__ = ["CudaSlotWriter", "CudaSlotReader"]

_FLAGS_BYTES = 4096


class CudaSlotWriter:
    """The sending end of a channel's device slots (one device: the sender's)."""

    def __init__(self, cfg: ShmConfig, channel: str, device: torch.device, idle: Callable[[], None]) -> None:
        self.cfg, self.channel, self.device, self.idle = cfg, channel, device, idle
        self._flags: Segment | None = None
        self._bufs: list[torch.Tensor | None] = [None] * cfg.slots
        self._handles: list[list | None] = [None] * cfg.slots
        self._events: list[torch.cuda.Event | None] = [None] * cfg.slots
        self._gens = [0] * cfg.slots
        self.waits = 0

    def _flag_segment(self) -> Segment:
        if self._flags is None:
            self._flags = create_segment(self.cfg.name(self.channel + "-cuda", 0, 1), _FLAGS_BYTES, 1)
        return self._flags

    def put(self, buffers: Sequence[torch.Tensor]) -> list:
        """Copy ``buffers`` (flat uint8 device tensors) into a free slot, grown (a new generation)
        when they outgrow it, at most ``max_bytes``; returns the header's reference."""
        offsets, need = layout([b.numel() for b in buffers])
        if need > self.cfg.max_bytes:
            raise ValueError(f"channel {self.channel}: a message of {need / 2**20:.1f} MiB of CUDA tensors is over "
                             f"the {self.cfg.max_bytes / 2**20:.0f} MiB cap of a slot; raise max_message_mb "
                             "(PipelineRunner / the job file) or use smaller microbatches")
        flags = self._flag_segment()
        spins = 0
        while True:
            free = [i for i in range(self.cfg.slots) if flags.map[HEAD + i] == FREE]
            fit = [i for i in free if self._bufs[i] is not None and self._bufs[i].numel() >= need]
            if fit or free:
                i = (fit or free)[0]
                break
            self.waits += spins == 0
            spins += 1
            self.idle()
            if spins > 4096:
                time.sleep(0.0002)
        buf = self._bufs[i]
        if buf is None or buf.numel() < need:
            self._gens[i] += 1
            size = slot_bytes(need, self.cfg.max_bytes)
            buf = self._bufs[i] = torch.empty(size, dtype=torch.uint8, device=self.device)
            ev = self._events[i] = torch.cuda.Event(interprocess=True)
            (dev, handle, size_bytes, offset_bytes, ref_handle, ref_offset, _ev_handle,
             _sync) = buf.untyped_storage()._share_cuda_()
            self._handles[i] = [dev, bytes(handle), size_bytes, offset_bytes, bytes(ref_handle), ref_offset,
                                bytes(ev.ipc_handle())]
        for b, off in zip(buffers, offsets):
            buf[off:off + b.numel()].copy_(b, non_blocking=True)
        ev = self._events[i]
        assert ev is not None
        ev.record(torch.cuda.current_stream(self.device))
        flags.map[HEAD + i] = FULL
        return [i, self._gens[i], *self._handles[i]]  # type: ignore[misc]

    def close(self) -> None:
        if self._flags is not None:
            unlink_segment(self._flags.name)
            self._flags.close()
            self._flags = None
        self._bufs = [None] * self.cfg.slots
        self._events = [None] * self.cfg.slots


class CudaSlotReader:
    """The receiving end of a channel's device slots; tensors land on ``device`` (this stage's)."""

    def __init__(self, cfg: ShmConfig, channel: str, device: torch.device, where: str) -> None:
        self.cfg, self.channel, self.device, self.where = cfg, channel, device, where
        self._flags: Segment | None = None
        self._open: dict[int, tuple[int, torch.Tensor, Any]] = {}  # slot -> (gen, buffer, event)

    def _fail(self, slot: object, gen: object, why: str) -> SlotError:
        return SlotError(f"{self.where}: a message names CUDA slot {slot!r} (generation {gen!r}) of channel "
                         f"{self.channel}, {why}")

    def _flag_segment(self) -> Segment:
        if self._flags is None:
            path = os.path.join(SHM_DIR, self.cfg.name(self.channel + "-cuda", 0, 1))
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as exc:
                raise SlotError(f"{self.where}: the CUDA slot flags of channel {self.channel} cannot be opened "
                                f"({exc.strerror})") from None
            if os.fstat(fd).st_size != _FLAGS_BYTES:
                os.close(fd)
                raise SlotError(f"{self.where}: the CUDA slot flags of channel {self.channel} have the wrong size")
            self._flags = Segment(os.path.basename(path), 1, fd, _FLAGS_BYTES)
            unlink_segment(path)
        return self._flags

    def take(self, ref: object, sizes: Sequence[int]) -> list[torch.Tensor]:
        if (type(ref) is not list or len(ref) != 9 or any(type(ref[k]) is not int for k in (0, 1, 2, 4, 5, 7))
                or any(type(ref[k]) is not bytes for k in (3, 6, 8))):
            raise SlotError(f"{self.where}: bad CUDA slot reference on channel {self.channel}")
        slot, gen, dev, handle, size_bytes, offset_bytes, ref_handle, ref_offset, ev_handle = ref
        if not 0 <= slot < self.cfg.slots or gen < 1:
            raise self._fail(slot, gen, f"which is not one of its slots 0..{self.cfg.slots - 1}")
        if not 0 < size_bytes <= self.cfg.max_bytes or offset_bytes < 0 or not 0 <= dev < torch.cuda.device_count():
            raise self._fail(slot, gen, f"with a size {size_bytes}, offset {offset_bytes} or device {dev} out of range")
        flags = self._flag_segment()
        got = self._open.get(slot)
        if got is None or got[0] != gen:
            if got is not None and gen < got[0]:
                raise self._fail(slot, gen, f"which is older than generation {got[0]} already in use")
            try:
                storage = torch.UntypedStorage._new_shared_cuda(dev, handle, size_bytes, offset_bytes, ref_handle,
                                                                ref_offset, b"", False)
                buf = torch.empty(0, dtype=torch.uint8, device=f"cuda:{dev}").set_(storage, 0, (size_bytes,), (1,))
                event = torch.cuda.Event.from_ipc_handle(torch.device("cuda", dev), ev_handle)
            except RuntimeError as exc:
                raise self._fail(slot, gen, f"whose IPC handles do not open ({exc})") from None
            got = self._open[slot] = (gen, buf, event)
        if flags.map[HEAD + slot] != FULL:
            raise self._fail(slot, gen, "which its sender has not filled")
        _, buf, event = got
        offsets, need = layout(sizes)
        if need > buf.numel():
            raise self._fail(slot, gen, f"which holds {buf.numel()} bytes, not the {need} the header announces")
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(event)  # the sender's copies into the slot are done
        out = []
        for n, off in zip(sizes, offsets):
            t = torch.empty(n, dtype=torch.uint8, device=self.device)
            t.copy_(buf[off:off + n], non_blocking=True)
            out.append(t)
        stream.synchronize()  # copied out: the sender may reuse the slot
        os.pwrite(flags.fd, b"\0", HEAD + slot)
        return out

    def close(self) -> None:
        self._open.clear()
        if self._flags is not None:
            self._flags.close()
            self._flags = None
