"""Shared-memory payloads (pipeq.wire.shm) between transports in this process: every dtype and layout intact, the receiver's own memory, borrowed slots, back-pressure that blocks and recovers (and yields to EXIT), forged slot references refused."""

from __future__ import annotations

import math
import os
import threading
import time

import msgpack
import pytest
import torch
import zmq

from pipeq.wire import codec
from pipeq.wire import shm
from pipeq.wire.codec import HeaderError
from pipeq.wire.messages import Kind, Message
from pipeq.wire.shm import ShmConfig, SlotError, SlotReader, SlotWriter
from pipeq.wire.control_link import ControlServer
from pipeq.wire.errors import Stopped
from pipeq.wire.sockets import BindTo, make_ipc_dir, remove_ipc_dir
from one_stage import OneStage
from shm_helpers import mapped_segments, transport_pair, wait_until


# -- helpers ----------------------------------------------------------------------------------
def record_puts(writer: SlotWriter) -> list[list[int]]:
    """Record the byte sizes of the buffers of every ``writer.put``."""
    calls: list[list[int]] = []
    real = writer.put

    def put(buffers):
        calls.append([b.numel() for b in buffers])
        return real(buffers)

    writer.put = put  # type: ignore[method-assign]
    return calls


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads, -0.0 and all), of ``a`` as a sender's codec sees it."""
    a = a.resolve_conj().resolve_neg().contiguous()
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


# -- 2. every dtype, any layout, either side of the threshold -----------------------------------
def random_tensor(dtype: torch.dtype, numel: int, g: torch.Generator) -> torch.Tensor:
    if dtype is torch.bool:
        return torch.randint(0, 2, (numel,), generator=g, dtype=torch.uint8).bool()
    item = torch.empty((), dtype=dtype).element_size()  # random bits: NaNs, infinities, -0.0 too
    return torch.randint(0, 256, (numel * item,), generator=g, dtype=torch.uint8).view(dtype)


def layouts(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` (1-D, a multiple of 64 elements) as a contiguous matrix and as views that are not:
    transposed, strided, sliced, expanded (strides 0), and for complex a lazy conjugate."""
    m = t.view(-1, 8)
    out = [m, m.t(), m[::2], m[:, 1:7], m[:, :1].expand(-1, 8), m[:1].expand(3, -1, -1)]  # strides 0 too
    if t.is_complex():
        out.append(m.conj())  # a lazy conjugate: sent resolved
    return out


@pytest.mark.timeout(30)
def test_every_dtype_and_layout_crosses_intact():
    g = torch.Generator().manual_seed(5)
    min_bytes = 64 << 10
    with transport_pair(slots=2, min_bytes=min_bytes) as (a, b, cfg):
        fwd = record_puts(a.tx.forward.slots)
        bwd = record_puts(b.tx.backward.slots)
        for mb, dtype in enumerate(codec._DTYPES):
            item = torch.empty((), dtype=dtype).element_size()
            big = random_tensor(dtype, (min_bytes // item + 64) // 64 * 64 * 2, g)  # > 2 x min_bytes
            small = random_tensor(dtype, 64, g)
            tensors = [*layouts(big), random_tensor(dtype, min_bytes // item, g),  # exactly min_bytes: a slot
                       torch.empty(0, 3, dtype=dtype), torch.empty((4, 0), dtype=dtype)]  # zero-size: neither
            tensors += [*layouts(small), random_tensor(dtype, min_bytes // item - 1, g)]  # under: frames
            tensors = tensors[1::2] + tensors[::2]  # mixed: slot, frame and zero-size ones interleaved
            expected_slot = [t.numel() * item for t in tensors if t.numel() * item >= min_bytes]
            assert len(expected_slot) >= 6
            before_f, before_b = len(fwd), len(bwd)
            a.send_activation(3, mb, tensors)
            got = b.wait_data(b.forward_queue, 3, mb).tensors
            assert len(got) == len(tensors)
            for i, (t, r) in enumerate(zip(tensors, got)):
                assert same_bytes(t, r), (dtype, i, t.shape, t.stride())
            assert fwd[before_f:] == [expected_slot], (dtype, fwd[before_f:])  # one slot for the big ones
            # and back the other way (b's backward output to a)
            b.send_gradient(3, mb, got)
            back = a.wait_data(a.backward_queue, 3, mb).tensors
            assert all(same_bytes(t, r) for t, r in zip(tensors, back)), dtype
            assert bwd[before_b:] == [expected_slot]
        # nothing over the threshold (small and zero-size tensors only): no slot at all
        a.send_activation(4, 0, [torch.arange(10.0), torch.empty(0), torch.ones(2, 2, dtype=torch.bool)])
        got = b.wait_data(b.forward_queue, 4, 0).tensors
        assert torch.equal(got[0], torch.arange(10.0)) and got[1].shape == (0,) and got[2].all()
        assert len(fwd) == len(codec._DTYPES)
        assert a.shm_waits == 0 and b.shm_waits == 0  # the receiver always took before the next send


@pytest.mark.timeout(30)
def test_received_tensors_are_the_receivers_own_memory():
    # one slot, reused: a tensor received earlier must not change when the slot is refilled
    with transport_pair(slots=1, min_bytes=1024) as (a, b, cfg):
        first = torch.randn(64, 64)
        a.send_activation(1, 0, [first])
        got = b.wait_data(b.forward_queue, 1, 0).tensors[0]
        a.send_activation(1, 1, [torch.zeros(64, 64)])
        assert torch.equal(b.wait_data(b.forward_queue, 1, 1).tensors[0], torch.zeros(64, 64))
        assert torch.equal(got, first), "a received tensor is a view over the reused slot"
        got.add_(1)  # and it is writable
        maps = mapped_segments(os.getpid(), cfg.prefix)
        assert list(maps) == [f"{cfg.prefix}-F0-0-1"], maps  # one segment, reused, no new one
        # a larger message grows the slot: a new generation, the old one unmapped
        a.send_activation(1, 2, [torch.randn(1024, 512)])  # 2 MiB > the first generation's 1 MiB
        b.wait_data(b.forward_queue, 1, 2)
        assert list(mapped_segments(os.getpid(), cfg.prefix)) == [f"{cfg.prefix}-F0-0-2"]


@pytest.mark.timeout(30)
def test_the_receiver_borrows_slots_and_one_always_circulates():
    """Received tensors are the slot itself (no copy) while fewer than slots - 1 are lent; a
    receiver that keeps everything (activations saved for their backward) then gets copies, so the
    sender never waits on it for good; a slot goes back when the last view of it dies."""
    import threading

    with transport_pair(slots=3, min_bytes=1024) as (a, b, cfg):
        reader = b.rx._readers[b.rx.fwd_in]
        sent = [torch.full((256, 16), float(i)) for i in range(8)]
        kept: list[torch.Tensor] = []

        def receive() -> None:
            for i in range(len(sent)):
                kept.append(b.wait_data(b.forward_queue, 4, i).tensors[0])

        t = threading.Thread(target=receive)
        t.start()
        for i, x in enumerate(sent):
            a.send_activation(4, i, [x])  # would wait for good if every slot stayed lent
        t.join(10)
        assert not t.is_alive()
        assert all(torch.equal(x, r) for x, r in zip(sent, kept))
        assert reader.lent == 2  # slots - 1 lent, the others copied out and handed back at once
        writer = a.tx.forward.slots
        assert sum(seg.state != shm.FREE for seg in writer._slots if seg is not None) == 2
        kept[0].add_(1)  # a lent tensor is the receiver's to write
        assert torch.equal(kept[0], sent[0] + 1)
        del kept[:]
        assert reader.lent == 0
        assert all(seg.state == shm.FREE for seg in writer._slots if seg is not None)


@pytest.mark.timeout(30)
def test_tensors_that_fit_a_slot_only_unaligned_still_cross():
    """A slot lays its tensors out 64-byte aligned: three float32 tensors of 349,524 bytes (each
    a little under a third of max_bytes = 1 MiB) add up to 1,048,572 bytes, which fit, but take
    3 x 349,568 = 1,048,704 in the slot, which do not. The message must still arrive (in frames,
    or in a slot that holds it), not fail the sender."""
    where = make_ipc_dir()
    cfg = ShmConfig(shm.run_prefix(where), slots=1, max_bytes=1 << 20)
    a = OneStage(0, "inproc://unused", bind=BindTo.ipc(where), queue_capacity=4, shm=cfg,
                       max_frame_bytes=1 << 20)
    b = OneStage(1, "inproc://unused", bind=BindTo.ipc(where), queue_capacity=4, shm=cfg,
                       max_frame_bytes=1 << 20)
    try:
        a.connect(b.addresses["forward"], None)
        xs = [torch.randn(87381) for _ in range(3)]
        assert sum(x.nbytes for x in xs) <= cfg.max_bytes < shm.layout([x.nbytes for x in xs])[1]
        a.send_activation(1, 0, xs)
        got = b.wait_data(b.forward_queue, 1, 0).tensors
        assert all(torch.equal(x, r) for x, r in zip(xs, got))
    finally:
        a.close()
        b.close()
        shm.remove_segments(cfg.prefix)
        remove_ipc_dir(where)


# -- 5. back-pressure -------------------------------------------------------------------------
def watch_idle(writer: SlotWriter) -> threading.Event:
    """An event set the first time ``writer`` finds every slot busy (and calls its idle)."""
    blocked = threading.Event()
    real = writer.idle

    def idle():
        blocked.set()
        real()

    writer.idle = idle
    return blocked


@pytest.mark.timeout(30)
def test_a_full_pool_blocks_the_sender_until_the_receiver_takes():
    n, hold = 6, 0.3
    with transport_pair(slots=2, min_bytes=1024) as (a, b, cfg):
        blocked = watch_idle(a.tx.forward.slots)
        sent = [torch.full((64, 64), float(mb)) + torch.randn(64, 64) for mb in range(n)]
        took: list[float] = []
        errors: list[BaseException] = []

        def sender():
            try:
                for mb, x in enumerate(sent):
                    t0 = time.monotonic()
                    a.send_activation(2, mb, [x])
                    took.append(time.monotonic() - t0)
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)

        thread = threading.Thread(target=sender)
        thread.start()
        try:
            assert blocked.wait(10), "the sender never found the pool full"
            time.sleep(hold)  # the receiver holds on (this is the wait being measured)
            assert len(took) == 2 and thread.is_alive(), "a third message went out with both slots in use"
            # now take: everything arrives, in order, intact, though the two slots were reused
            wait_until(lambda: (b.pump(50), len(b.forward_queue) == n)[1], 10, "every message")
        finally:
            thread.join(10)
        assert not errors, errors
        assert not thread.is_alive()
        assert list(b.forward_queue._items) == [(2, mb) for mb in range(n)]
        for mb, x in enumerate(sent):
            assert torch.equal(b.wait_data(b.forward_queue, 2, mb).tensors[0], x), mb
        assert a.shm_waits >= 1
        assert took[2] >= hold * 0.9, f"the third send took {took[2]:.3f} s: it did not wait for a slot"
        assert len(mapped_segments(os.getpid(), cfg.prefix)) == 2  # never more segments than slots


@pytest.mark.timeout(30)
def test_exit_interrupts_a_sender_blocked_on_a_full_pool():
    where = make_ipc_dir()
    server = ControlServer(BindTo.ipc(where))
    try:
        with transport_pair(slots=1, min_bytes=1024, control=server.address) as (a, b, cfg):
            a.send_control(Message(Kind.READY))  # the server knows stage process 0 from here on
            got = wait_until(lambda: server.recv(100), 10, "stage 0 on the control channel")
            assert got[1].kind is Kind.READY
            blocked = watch_idle(a.tx.forward.slots)
            a.send_activation(1, 0, [torch.randn(64, 64)])  # fills the only slot; b never takes
            timer = threading.Thread(target=lambda: blocked.wait(10) and server.send(0, Message(Kind.EXIT)))
            timer.start()
            t0 = time.monotonic()
            try:
                with pytest.raises(Stopped):
                    a.send_activation(1, 1, [torch.randn(64, 64)])
            finally:
                timer.join(10)
            assert blocked.is_set() and time.monotonic() - t0 < 5
            assert a.shm_waits == 1
    finally:
        server.close()
        remove_ipc_dir(where)


# -- 6. forged slot references ----------------------------------------------------------------
def header(metas, extra, kind: Kind = Kind.ACTIVATION) -> bytes:
    """A message header written by hand (no pipeq codec)."""
    return msgpack.packb([codec.FORMAT_VERSION, int(kind), 1, 0, metas, extra])


F32 = codec._DTYPES.index(torch.float32)


def slotted(ref, shape=(256,)) -> list[bytes]:
    """Frames of one float32 tensor said to be in shared-memory slot ``ref``."""
    return [header([[F32, list(shape), 4 * math.prod(shape), 1]], {"@slot": ref})]


@pytest.fixture
def pool():
    """A writer and a reader of channel F0 (slots 0..1) under a fresh prefix: (cfg, writer, reader)."""
    cfg = ShmConfig(f"pipeq-test{os.getpid()}x{time.monotonic_ns()}", slots=2, max_bytes=256 << 20, min_bytes=64)
    writer = SlotWriter(cfg, "F0", idle=lambda: None)
    reader = SlotReader(cfg, "F0", "stage process 1")
    try:
        yield cfg, writer, reader
    finally:
        writer.close()
        reader.close()
        shm.remove_segments(cfg.prefix)


def refused(reader: SlotReader, frames, match: str, error=SlotError):
    with pytest.raises(error, match=match) as info:
        codec.decode(frames, reader.take)
    return str(info.value)


def test_forged_slot_references_are_refused(pool):
    cfg, writer, reader = pool
    who = r"stage process 1: a message names shared-memory slot"
    # out of range, negative, a generation pipeq never makes, one that does not exist
    refused(reader, slotted([2, 1]), who + r" 2 \(generation 1\) of channel F0, which has only slots 0\.\.1")
    refused(reader, slotted([-1, 1]), who + r" -1 .* of channel F0, which has only slots")
    refused(reader, slotted([0, 0]), who + r" 0 \(generation 0\) of channel F0, which is not a generation")
    refused(reader, slotted([0, 1]), who + r" 0 \(generation 1\) of channel F0, which does not exist")
    # not a [slot, generation] pair of integers
    for ref in ("pipeq-x-F0-0-1", [0], [0, 1, 2], [0, 1.0], [True, 1], [0, "1"], {"slot": 0}, 0):
        refused(reader, slotted(ref), r"stage process 1: bad shared-memory slot reference .* on channel F0")
    refused(reader, slotted(None), "must come together", HeaderError)

    # a slot that exists but was never filled (state 0), and one already taken (a replay)
    writer._grow(0, 1024)  # gen 1 of slot 0: made, empty
    refused(reader, slotted([0, 1]), who + r" 0 \(generation 1\) of channel F0, which its sender has not filled")
    data = torch.randn(256)
    ref = list(writer.put([data.view(torch.uint8)]))
    assert ref == [0, 1]  # the made, empty slot 0
    msg = codec.decode(slotted(ref), reader.take)
    assert torch.equal(msg.tensors[0], data) and "@slot" not in msg.extra
    refused(reader, slotted(ref), who + r" 0 \(generation 1\) of channel F0, which its sender has not filled")
    del msg  # its tensor was lent (a view of slot 0): the slot goes back when it dies
    assert reader.lent == 0

    # a filled slot, but the header announces more bytes than it holds
    assert writer.put([torch.ones(1024, dtype=torch.uint8)]) == (0, 1)  # slot 0, filled at last
    capacity = writer._slots[0].capacity
    refused(reader, slotted([0, 1], (capacity // 4 + 16,)),
            rf"{who} 0 \(generation 1\) of channel F0, which holds {capacity} bytes, not the {capacity + 64} the "
            "header announces")

    # a stale generation: slot 0 grew (generation 2) and was mapped; generation 1 is refused
    reader.take([0, 1], [1024])  # hands slot 0 back
    assert writer.put([torch.ones(2 << 20, dtype=torch.uint8)]) == (1, 1)  # 2 MiB: slot 1 is made for it
    assert writer.put([torch.ones(2 << 20, dtype=torch.uint8)]) == (0, 2)  # and slot 0, free but small, grows
    reader.take([0, 2], [2 << 20])
    refused(reader, slotted([0, 1]), who + r" 0 \(generation 1\) of channel F0, which is older than generation 2")

    # the slot and the tensors in it come together, or not at all
    refused(reader, [header([[F32, [256], 1024]], {"@slot": [0, 1]}), bytes(1024)], "must come together",
            HeaderError)
    refused(reader, [header([[F32, [256], 1024, 1]], None)], "must come together", HeaderError)
    refused(reader, [header([[F32, [256], 1024, True]], {"@slot": [0, 1]})], r"\[dtype, shape, nbytes, 1 or 2\]",
            HeaderError)
    refused(reader, [header([[F32, [256], 1024, 3]], {"@slot": [0, 1]})], r"\[dtype, shape, nbytes, 1 or 2\]",
            HeaderError)
    # a tensor said to be in a CUDA slot: no "@cuda" reference, and (here) no CUDA reader at all
    refused(reader, [header([[F32, [256], 1024, 2]], None)], "a CUDA slot and the tensors in it "
            "must come together", HeaderError)
    refused(reader, [header([[F32, [256], 1024, 2]], {"@cuda": [0, 1]})], "names a CUDA slot, which this "
            "channel does not take", HeaderError)
    refused(reader, [header([[F32, [0], 0, 1]], {"@slot": [0, 1]})], "header says 0", codec.FrameLengthError)
    refused(reader, [header([[F32, [256], 1024, 1]], {"@slot": [0, 1]}), bytes(1024)],
            r"header announces 0 tensor frame\(s\) but 1 arrived", codec.FrameCountError)
    # a channel that takes no slots refuses a header naming one
    with pytest.raises(HeaderError, match="does not take"):
        codec.decode(slotted([0, 1]), None)


def test_segments_of_another_channel_or_run_cannot_be_named(pool):
    cfg, writer, reader = pool
    other_channel = SlotWriter(cfg, "F1", idle=lambda: None)
    other_run = SlotWriter(ShmConfig(cfg.prefix + "y", slots=2, max_bytes=256 << 20, min_bytes=64), "F0",
                           idle=lambda: None)
    try:
        for w in (other_channel, other_run):
            assert w.put([torch.ones(1024, dtype=torch.uint8)]) == (0, 1)
        assert {f"{cfg.prefix}-F1-0-1", f"{cfg.prefix}y-F0-0-1"} <= set(os.listdir(shm.SHM_DIR))
        # F0's reader builds names from its own channel and prefix: [0, 1] is its own slot 0, absent
        refused(reader, slotted([0, 1], (256,)), "of channel F0, which does not exist")
        # the others' segments are untouched: still named, still full
        for w in (other_channel, other_run):
            assert os.path.exists(os.path.join(shm.SHM_DIR, w._slots[0].name))
            assert w._slots[0].state == shm.FULL
    finally:
        other_channel.close()
        other_run.close()
        shm.remove_segments(cfg.prefix + "y")


def test_odd_files_under_a_slots_name_are_refused(pool):
    cfg, writer, reader = pool
    # a file too short to be a slot
    with open(os.path.join(shm.SHM_DIR, cfg.name("F0", 0, 1)), "wb") as f:
        f.write(b"\x01" * 10)
    refused(reader, slotted([0, 1]), r"slot 0 \(generation 1\) of channel F0, which is 10 bytes long")
    # a symbolic link (to a full segment of another channel): not followed
    other = SlotWriter(cfg, "F9", idle=lambda: None)
    try:
        other.put([torch.ones(1024, dtype=torch.uint8)])
        os.symlink(os.path.join(shm.SHM_DIR, other._slots[0].name), os.path.join(shm.SHM_DIR, cfg.name("F0", 1, 1)))
        refused(reader, slotted([1, 1]), r"slot 1 \(generation 1\) of channel F0, which cannot be opened")
    finally:
        other.close()


@pytest.mark.timeout(30)
def test_forged_slot_header_on_a_stages_forward_socket():
    """Pushed into a stage's forward socket, a forged reference fails the stage's receive with a
    SlotError naming the stage, the channel and the slot."""
    with transport_pair(slots=2, min_bytes=1024) as (a, b, cfg):
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(b.addresses["forward"])
        try:
            for ref, why in (([7, 1], r"slot 7 \(generation 1\) of channel F0, which has only slots 0\.\.1"),
                             ([1, 3], r"slot 1 \(generation 3\) of channel F0, which does not exist")):
                push.send_multipart(slotted(ref))
                with pytest.raises(SlotError, match="stage process 1: a message names shared-memory " + why):
                    wait_until(lambda: b.pump(100) and False, 10, "the forged message")
            # the stage's own traffic still goes through
            x = torch.randn(64, 64)
            a.send_activation(1, 0, [x])
            assert torch.equal(b.wait_data(b.forward_queue, 1, 0).tensors[0], x)
        finally:
            push.close()
            ctx.term()
