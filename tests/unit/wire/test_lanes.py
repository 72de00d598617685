"""Lanes (pipeq.wire.lanes): one host's data hops on Unix SEQPACKET sockets, in this process."""

from __future__ import annotations

import os
import socket
import struct

import pytest
import torch

from pipeq.wire import codec
from pipeq.wire.lanes import MAX_DATAGRAM, Lane, LaneError, LaneInbox, lane_path, split


@pytest.fixture
def pair(tmp_path):
    """A lane and the inbox it is connected to (accepted), in a private folder."""
    os.chmod(tmp_path, 0o700)
    inbox = LaneInbox(str(tmp_path / "stage1-fwd.lane"), "stage 1")
    lane = Lane(inbox.path)
    inbox.accept()
    yield lane, inbox
    lane.close()
    inbox.close()


def receive(inbox: LaneInbox):
    assert len(inbox.conns) == 1
    return inbox.receive(inbox.conns[0])


def test_a_message_crosses_whole_with_its_tensors_at_torchs_alignment(pair) -> None:
    lane, inbox = pair
    a, b = torch.arange(10, dtype=torch.float32), torch.arange(7, dtype=torch.int64).reshape(7, 1)
    frames = codec.encode(1, 3, 2, [a, b], {"tree": [0, 1]})
    assert lane.send(lane.datagram(frames))
    got = receive(inbox)
    assert [bytes(f) for f in got] == [bytes(memoryview(f).cast("B")) for f in frames]
    for f in got[1:]:  # tensors built over the datagram need no copy to be aligned
        assert torch.frombuffer(f, dtype=torch.uint8).data_ptr() % 64 == 0
    msg = codec.decode(got)
    assert (msg.step, msg.microbatch) == (3, 2)
    assert torch.equal(msg.tensors[0], a) and torch.equal(msg.tensors[1], b)
    assert receive(inbox) is None  # nothing more waiting


def test_messages_arrive_in_order_one_datagram_each(pair) -> None:
    lane, inbox = pair
    for j in range(5):
        assert lane.send(lane.datagram(codec.encode(1, 0, j, [torch.full((3,), float(j))], None)))
    assert [codec.decode(receive(inbox)).microbatch for _ in range(5)] == list(range(5))


def test_datagrams_share_a_buffer_each_whole_aligned_and_apart_past_its_end(pair) -> None:
    """One system call per datagram: each lands at the next 64-byte boundary of the inbox's
    buffer, and when the room left could not hold the largest datagram a new buffer is taken;
    every message keeps its own bytes, the earlier ones' tensors too."""
    lane, inbox = pair
    sizes = [1, 17, 1000, lane.max_bytes // 4 - 64, 5, lane.max_bytes // 4 - 64, 3, lane.max_bytes // 4 - 64, 2]
    sent, got = [], []
    for j, n in enumerate(sizes * 2):  # past the end of the first buffer
        t = torch.arange(n, dtype=torch.float32) + j
        sent.append(t)
        assert lane.send(lane.datagram(codec.encode(1, 0, j, [t], None)))
        frames = receive(inbox)
        assert torch.frombuffer(frames[1], dtype=torch.uint8).data_ptr() % 64 == 0
        got.append(codec.decode(frames))
    for j, (t, msg) in enumerate(zip(sent, got)):
        assert msg.microbatch == j and torch.equal(msg.tensors[0], t)


def test_a_datagram_over_the_largest_a_lane_sends_is_refused_not_cut(pair) -> None:
    lane, inbox = pair
    frames = [struct.pack("<2I", 1, MAX_DATAGRAM) + bytes(MAX_DATAGRAM)]  # one frame: count, length, bytes
    lane.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * MAX_DATAGRAM)
    lane.sock.sendmsg(frames)
    with pytest.raises(LaneError, match=f"over the {MAX_DATAGRAM}"):
        receive(inbox)


def test_a_message_too_big_for_a_datagram_is_left_to_zeromq(pair) -> None:
    lane, _ = pair
    big = torch.zeros(lane.max_bytes // 4 + 1)
    assert lane.datagram(codec.encode(1, 0, 0, [big], None)) is None


def test_a_full_peer_makes_send_say_so_without_blocking(pair) -> None:
    lane, inbox = pair
    parts = lane.datagram(codec.encode(1, 0, 0, [torch.zeros(lane.max_bytes // 8)], None))
    sent = 0
    while lane.send(parts):  # non-blocking: False once the peer's buffer is full
        sent += 1
        assert sent < 10_000
    assert sent >= 1
    assert receive(inbox) is not None  # the receiver takes one: there is room again
    assert lane.send(parts)


def test_a_peer_that_is_gone_is_forgotten_not_an_error(pair) -> None:
    lane, inbox = pair
    inbox.close()
    frames = codec.encode(1, 0, 0, [torch.zeros(4)], None)
    assert lane.send(lane.datagram(frames))  # no exception: the driver sees the peer's death
    assert lane.send(lane.datagram(frames))


def test_a_sender_that_closes_is_dropped_by_the_inbox(pair) -> None:
    lane, inbox = pair
    inbox.changed = False
    lane.close()
    assert receive(inbox) is None
    assert inbox.conns == [] and inbox.changed  # the poller is told to forget its socket


def test_an_inbox_serves_several_senders(pair, tmp_path) -> None:
    lane, inbox = pair
    other = Lane(inbox.path)
    try:
        inbox.accept()
        assert len(inbox.conns) == 2 and len(inbox.fds()) == 3  # the listener and two senders
        other.send(other.datagram(codec.encode(2, 1, 0, [torch.ones(2)], None)))
        got = [inbox.receive(c) for c in inbox.conns]
        assert got[0] is None and codec.decode(got[1]).kind == 2
    finally:
        other.close()


def test_nothing_to_connect_to_is_an_oserror(tmp_path) -> None:
    with pytest.raises(OSError):
        Lane(str(tmp_path / "nobody.lane"))


def test_lane_paths_exist_for_ipc_addresses_only() -> None:
    assert lane_path("ipc:///run/x/stage1-fwd") == "/run/x/stage1-fwd.lane"
    assert lane_path("tcp://127.0.0.1:5555") is None


def datagram(lengths: list[int], payload: int, count: int | None = None) -> memoryview:
    n = len(lengths) if count is None else count
    return memoryview(struct.pack(f"<I{len(lengths)}I", n, *lengths) + bytes(payload))


@pytest.mark.parametrize("data, message", [
    (memoryview(b"\x01\x00"), "has no frame count"),
    (datagram([], 0, count=0), "announces 0 frames"),
    (datagram([4], 0, count=70_000), "announces 70000 frames"),
    (datagram([4, 8], 55), "add up to 72 bytes, not its 67"),  # frame 1 (at 64) cut short
    (datagram([4, 8], 61), "add up to 72 bytes, not its 73"),  # a byte past the last frame
    (datagram([4], 5), "add up to 12 bytes, not its 13"),
])
def test_a_malformed_datagram_is_refused_saying_what_does_not_add_up(data, message) -> None:
    with pytest.raises(LaneError, match=message):
        split(data, "stage 1")


def test_split_finds_each_frame_where_the_layout_puts_it() -> None:
    head, body = b"abcd", bytes(range(8))
    data = struct.pack("<3I", 2, 4, 8) + head + bytes(64 - 16) + body  # frame 1 at offset 64
    frames = split(memoryview(data))
    assert bytes(frames[0]) == head and bytes(frames[1]) == body
