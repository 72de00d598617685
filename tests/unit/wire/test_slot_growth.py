"""Slots whose messages change size (sequences of other lengths): a slot grows only when a message
outgrows it (doubling, at most max_bytes), is reused otherwise, and no generation is left
behind: host slots (pipeq.wire.shm) end to end in this process; the CUDA writer's bookkeeping
(pipeq.wire.cuda_slots) with its device calls stood in for, so that it runs without a GPU
(tests/gpu/test_cuda_varlen.py runs the real thing)."""

from __future__ import annotations

import os

import pytest
import torch

from pipeq.wire import cuda_slots, shm
from pipeq.wire.shm import HEAD, MIN_SLOT, ShmConfig, SlotReader, SlotWriter, slot_bytes
from pipeq.wire.sockets import make_ipc_dir, remove_ipc_dir
from shm_helpers import mapped_segments, segment_names

MiB = 1 << 20
#: a message's bytes for sequence lengths 32, 24, 40, 17, ... (32 KiB per position), twice over
LENGTHS = [32, 24, 40, 17, 64, 8, 32, 24, 40, 17, 64, 8]


def test_slot_bytes_double_from_the_minimum_up_to_the_cap():
    assert slot_bytes(1, 8 * MiB) == slot_bytes(MIN_SLOT, 8 * MiB) == MIN_SLOT
    assert slot_bytes(MIN_SLOT + 1, 8 * MiB) == 2 * MIN_SLOT
    assert slot_bytes(3 * MiB, 8 * MiB) == 4 * MiB
    assert slot_bytes(5 * MiB, 6 * MiB) == 6 * MiB  # never past the cap
    sizes = {slot_bytes(n, 64 * MiB) for n in range(1, 64 * MiB, 12_345)}
    assert sorted(sizes) == [MiB << k for k in range(7)]  # 7 sizes for every message up to 64 MiB


@pytest.fixture
def pool():
    where = make_ipc_dir()
    cfg = ShmConfig(shm.run_prefix(where), slots=2, max_bytes=4 * MiB, min_bytes=1024)
    writer = SlotWriter(cfg, "F0", lambda: pytest.fail("a slot was busy: the reader takes each message first"))
    reader = SlotReader(cfg, "F0", "test")
    try:
        yield cfg, writer, reader
    finally:
        writer.close()
        reader.close()
        left = segment_names(cfg.prefix)
        shm.remove_segments(cfg.prefix)
        remove_ipc_dir(where)
        assert left == [], f"segments left behind: {left}"


def test_host_slots_grow_when_outgrown_and_are_reused_otherwise(pool):
    cfg, writer, reader = pool
    g = torch.Generator().manual_seed(0)
    made: list[tuple[int, int]] = []  # (slot, generation) of each message
    for T in LENGTHS:
        msg = [torch.randint(0, 256, (T * 32 * 1024 - 100,), generator=g, dtype=torch.uint8),
               torch.randint(0, 256, (100,), generator=g, dtype=torch.uint8)]  # two tensors, unaligned
        slot, gen = writer.put(msg)
        got = reader.take([slot, gen], [m.numel() for m in msg])
        assert all(torch.equal(a, b) for a, b in zip(msg, got))
        del got  # a lent slot goes back when its views are gone
        made.append((slot, gen))
        assert segment_names(cfg.prefix) == []  # every generation unlinked once the reader mapped it
        mapped = mapped_segments(os.getpid(), cfg.prefix)
        assert len(mapped) <= cfg.slots and all(mapped.values()), mapped  # old generations unmapped
        assert all(s is None or s.capacity <= cfg.max_bytes for s in writer._slots)
    first, second = made[:6], made[6:]
    assert len(set(first)) <= 3, first  # a 2 MiB slot (lengths up to 40), a 4 MiB one (64): not one a message
    assert set(second) <= set(first), (first, second)  # the same lengths again: the slots made, reused
    # a message over max_bytes takes no slot (the transport sends it in frames)
    assert not writer.fits([cfg.max_bytes + 1]) and writer.fits([cfg.max_bytes - HEAD])


class FakeEvent:
    """torch.cuda.Event(interprocess=True), without a GPU: what the writer calls."""

    def __init__(self, interprocess: bool = False) -> None:
        assert interprocess

    def ipc_handle(self) -> bytes:
        return b"event"

    def record(self, stream: object) -> None:
        pass


def test_the_cuda_writer_grows_its_buffers_only_when_outgrown_and_caps_them(monkeypatch):
    """The CUDA writer's choices, its buffers on the CPU: the device calls (IPC handles, events,
    streams) stood in for; the receiver's part is played by freeing each slot's flag."""
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.UntypedStorage, "_share_cuda_",
                        lambda self: (0, b"mem", self.nbytes(), 0, b"ref", 0, b"ev", False), raising=False)
    where = make_ipc_dir()
    cfg = ShmConfig(shm.run_prefix(where), slots=2, max_bytes=4 * MiB)
    writer = cuda_slots.CudaSlotWriter(cfg, "F0", torch.device("cpu"), lambda: pytest.fail("every slot busy"))
    try:
        made, held = [], {}  # held: slot -> (generation, size) it had before this message
        for T in LENGTHS:
            msg = [torch.full((T * 32 * 1024,), T % 251, dtype=torch.uint8)]
            need = msg[0].numel()
            ref = writer.put(msg)
            slot, gen, size = ref[0], ref[1], ref[4]
            assert size == writer._bufs[slot].numel() and torch.equal(writer._bufs[slot][:need], msg[0])
            before = held.get(slot)
            if before is None or before[0] != gen:  # a new buffer: only because the old one was too small
                assert before is None or before[1] < need, (T, before)
                assert size == slot_bytes(need, cfg.max_bytes)
            held[slot] = (gen, size)
            made.append((slot, gen))
            writer._flags.map[HEAD + slot] = shm.FREE  # the receiver copied it out
        first, second = made[:6], made[6:]
        assert len(set(first)) <= 4, first  # 1 MiB, 2 MiB (40 and 64)
        assert set(second) <= set(first)  # the same lengths again: the buffers made, reused
        assert max(size for _, size in held.values()) == 2 * MiB  # 64 x 32 KiB fits 2 MiB exactly
        with pytest.raises(ValueError, match=r"channel F0: a message of 5\.0 MiB of CUDA tensors is over the 4 MiB "
                                             r"cap of a slot; raise max_message_mb"):
            writer.put([torch.zeros(5 * MiB, dtype=torch.uint8)])
    finally:
        writer.close()
        left = segment_names(cfg.prefix)
        shm.remove_segments(cfg.prefix)
        remove_ipc_dir(where)
    assert left == []
