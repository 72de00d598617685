"""The transport: keyed queues, stage-to-stage data, the control channel both ways, the agent's link."""

from __future__ import annotations

import time

import msgpack
import pytest
import torch
import zmq

from pipeq.errors import CodecError
from pipeq.messages import Kind, Message
from pipeq.transport import (AGENT, STAGE, BindTo, ControlServer, DriverLink, KeyedQueue, Peer, PeerUnreachable,
                             ProtocolError, StageTransport, make_ipc_dir, remove_ipc_dir)


def encode_frames(msg: Message) -> list[bytes]:
    """A tensor-less message as a foreign peer would write it, by hand (no pipeq codec)."""
    return [msgpack.packb([1, int(msg.kind), msg.step, msg.microbatch, [], msg.extra or None])]


def msg(step: int, mb: int) -> Message:
    return Message(Kind.ACTIVATION, step, mb)


def test_keyed_queue_is_order_free_and_bounded():
    q = KeyedQueue("stage 1 forward", capacity=3)
    for key in [(1, 2), (1, 0), (2, 0)]:  # any arrival order
        q.put(msg(*key))
    assert q.pop(1, 0).microbatch == 0
    assert q.pop(1, 1) is None
    q.put(msg(1, 1))
    with pytest.raises(ProtocolError, match="stage 1 forward queue is full"):
        q.put(msg(3, 0))
    with pytest.raises(ProtocolError, match="duplicate message for step 1 microbatch 2"):
        q.put(msg(1, 2))
    assert len(q) == 3


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["ipc", "tcp"])
def test_activation_and_gradient_between_two_stages(kind):
    where = make_ipc_dir() if kind == "ipc" else "127.0.0.1"
    bind = BindTo.ipc(where) if kind == "ipc" else BindTo.tcp(where)
    a = StageTransport(0, "inproc://unused", bind=bind, queue_capacity=4)
    b = StageTransport(1, "inproc://unused", bind=bind, queue_capacity=4)
    try:
        a.connect(b.addresses["forward"], None)
        b.connect(None, a.addresses["backward"])
        x = torch.randn(32, 64)
        for mb in (1, 0):  # sent out of order, taken in order
            a.send_activation(7, mb, [x + mb])
        got0 = b.wait_data(b.forward_queue, 7, 0)
        got1 = b.wait_data(b.forward_queue, 7, 1)
        assert torch.equal(got0.tensors[0], x) and torch.equal(got1.tensors[0], x + 1)
        b.send_gradient(7, 0, [torch.ones(32, 64)])
        assert torch.equal(a.wait_data(a.backward_queue, 7, 0).tensors[0], torch.ones(32, 64))
    finally:
        a.close()
        b.close()
        if kind == "ipc":
            remove_ipc_dir(where)


def wait_for(fn, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = fn()
        if got is not None:
            return got
    raise AssertionError("timed out")


@pytest.mark.timeout(30)
def test_control_channel_both_ways_and_a_batch_is_all_or_nothing():
    where = make_ipc_dir()
    server = ControlServer(BindTo.ipc(where))
    stage = StageTransport(3, server.address, bind=BindTo.ipc(where), queue_capacity=4)
    try:
        # a stage's message arrives decoded, with the sender named by role and process number
        stage.send_control(Message(Kind.READY, 0, 0, [torch.arange(6.0).view(2, 3)], {"pid": 42}))
        peer, msg = wait_for(lambda: server.recv(100))
        assert peer == Peer(STAGE, 3) and msg.kind is Kind.READY and msg.extra == {"pid": 42}
        assert torch.equal(msg.tensors[0], torch.arange(6.0).view(2, 3))
        # a batch of commands with one that cannot be encoded: refused before anything is sent
        bad = Message(Kind.SET_STATE, -1, 0, [torch.zeros(2, dtype=torch.uint32)])
        with pytest.raises(CodecError):
            server.send_many([(3, Message(Kind.TRAIN, 1)), (3, bad)])
        server.send_many([(3, Message(Kind.PREDICT, 2, 0, [torch.ones(2)], {"sizes": [2]}))])
        got = wait_for(lambda: stage.next_control(100))
        assert got.kind is Kind.PREDICT and got.step == 2  # the TRAIN of the refused batch never came
        assert stage.next_control(100) is None
        # a process that never connected is named
        with pytest.raises(PeerUnreachable, match="stage process 7"):
            server.send(7, Message(Kind.EXIT))
    finally:
        stage.close()
        server.close()
        remove_ipc_dir(where)


@pytest.mark.timeout(30)
def test_driver_link_reports_connection_and_foreign_peers_are_unnamed():
    server = ControlServer(BindTo.tcp("127.0.0.1"))
    link = DriverLink(server.address, 2, heartbeat_s=(0.1, 0.5))
    foreign = zmq.Context()
    raw = foreign.socket(zmq.DEALER)
    raw.setsockopt(zmq.IDENTITY, b"x9")
    raw.setsockopt(zmq.LINGER, 0)
    try:
        assert link.connected is None  # not yet handshaken
        link.send(Message(Kind.HEARTBEAT, 1))
        peer, msg = wait_for(lambda: server.recv(100))
        assert peer == Peer(AGENT, 2) and msg.kind is Kind.HEARTBEAT
        wait_for(lambda: True if (link.recv(50), link.connected)[1] else None)
        assert server.send_best_effort(AGENT, 2, Message(Kind.EXIT, extra={"abort": False}))
        got = wait_for(lambda: link.recv(100))
        assert got.kind is Kind.EXIT and got.extra == {"abort": False}
        # a peer whose identity is not one of pipeq's roles is not named as anyone
        raw.connect(server.address)
        raw.send_multipart(encode_frames(Message(Kind.ERROR, extra={"message": "forged"})))
        peer, msg = wait_for(lambda: server.recv(100))
        assert peer is None and msg.kind is Kind.ERROR
        # the driver going away shows as a lost connection
        server.close()
        server = None
        wait_for(lambda: True if (link.recv(50), link.connected is False)[1] else None)
        assert time.monotonic() - link.lost_since < 5
    finally:
        raw.close()
        foreign.term()
        link.close()
        if server is not None:
            server.close()
