"""The transport: keyed queues, stage-to-stage data, the control channel both ways, the agent's link."""

from __future__ import annotations

import time

import msgpack
import pytest
import torch
import zmq

from pipeq.errors import CodecError
from pipeq.wire.messages import Kind, Message
from pipeq.wire.keys import JobSecret
from pipeq.wire.control_link import AGENT, STAGE, ControlServer, DriverLink, Peer
from pipeq.wire.errors import PeerUnreachable, ProtocolError
from pipeq.wire.queues import KeyedQueue
from pipeq.wire.security import WireAuth
from pipeq.wire.sockets import BindTo, make_ipc_dir, remove_ipc_dir
from one_stage import OneStage

AUTH = WireAuth(JobSecret.generate(), "encrypt")


def encode_frames(msg: Message) -> list[bytes]:
    """A tensor-less message as a foreign peer would write it, by hand (no pipeq codec)."""
    return [msgpack.packb([1, int(msg.kind), msg.step, msg.microbatch, [], msg.extra or None])]


def msg(step: int, mb: int) -> Message:
    return Message(Kind.ACTIVATION, step, mb)


def test_keyed_queue_is_order_free_and_bounded():
    q = KeyedQueue("stage 1 forward", capacity=3)
    for key in [(1, 2), (1, 0), (2, 0)]:  # any arrival order
        q.put(key, msg(*key))
    assert q.pop((1, 0)).microbatch == 0
    assert q.pop((1, 1)) is None
    q.put((1, 1), msg(1, 1))
    with pytest.raises(ProtocolError, match="stage 1 forward queue is full"):
        q.put((3, 0), msg(3, 0))
    with pytest.raises(ProtocolError, match="duplicate message for step 1 microbatch 2"):
        q.put((1, 2), msg(1, 2))
    assert len(q) == 3


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["ipc", "tcp-encrypt", "tcp-authenticate"])
def test_activation_and_gradient_between_two_stages(kind):
    where = make_ipc_dir() if kind == "ipc" else "127.0.0.1"
    bind = BindTo.ipc(where) if kind == "ipc" else BindTo.tcp(where)
    auth = None if kind == "ipc" else WireAuth(AUTH.secret, kind.split("-")[1])
    a = OneStage(0, "inproc://unused", bind=bind, queue_capacity=4, auth=auth)
    b = OneStage(1, "inproc://unused", bind=bind, queue_capacity=4, auth=auth)
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


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["ipc", "tcp-encrypt", "tcp-authenticate"])
def test_small_received_tensors_sit_where_torch_would_put_them(kind):
    """ZeroMQ hands over a small frame where it lies in its receive buffer, at an address that
    varies with how the bytes arrived, and MKL's matrix products round differently for an operand
    at another address modulo 16: a small received tensor is copied to torch's 64-byte alignment
    (so that a run computes the same bits every time, attacked or not)."""
    where = make_ipc_dir() if kind == "ipc" else "127.0.0.1"
    bind = BindTo.ipc(where) if kind == "ipc" else BindTo.tcp(where)
    auth = None if kind == "ipc" else WireAuth(AUTH.secret, kind.split("-")[1])
    a = OneStage(0, "inproc://unused", bind=bind, queue_capacity=200, auth=auth)
    b = OneStage(1, "inproc://unused", bind=bind, queue_capacity=200, auth=auth)
    try:
        a.connect(b.addresses["forward"], None)
        sent = [torch.randn(n) for n in range(1, 3000, 23)]  # back to back: many share a read
        for mb, x in enumerate(sent):
            a.send_activation(1, mb, [x, x.double()])
        for mb, x in enumerate(sent):
            got = b.wait_data(b.forward_queue, 1, mb).tensors
            assert torch.equal(got[0], x) and torch.equal(got[1], x.double())
            assert [t.data_ptr() % 64 for t in got] == [0, 0], (mb, x.numel())
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
    stage = OneStage(3, server.address, bind=BindTo.ipc(where), queue_capacity=4)
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
    server = ControlServer(BindTo.tcp("127.0.0.1"), AUTH)
    link = DriverLink(server.address, 2, heartbeat_s=(0.1, 0.5), auth=AUTH)
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
        # a key holder whose identity is not one of pipeq's roles is not named as anyone
        public, secret = AUTH.curve("client")
        raw.curve_serverkey, raw.curve_publickey, raw.curve_secretkey = AUTH.curve("server")[0], public, secret
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


# -- who may connect (issue 13) ------------------------------------------------------------------
def test_control_identities_are_taken_exactly_as_pipeq_spells_them():
    from pipeq.wire.control_link import HEARTBEAT, peer_of

    assert peer_of(b"s2") == Peer(STAGE, 2) and peer_of(b"h0") == Peer(HEARTBEAT, 0)
    assert peer_of(b"a13") == Peer(AGENT, 13)
    for forged in (b"s02", b"h02", b"s+2", b"s 2", b"s", b"x2", b"s2\x00", b"s\xd9\xa2", b"s" + b"9" * 30):
        assert peer_of(forged) is None, forged


def test_tcp_sockets_refuse_to_exist_without_the_secret():
    with pytest.raises(ValueError, match="secret"):
        ControlServer(BindTo.tcp("127.0.0.1"))
    with pytest.raises(ValueError, match="secret"):
        OneStage(0, "inproc://unused", bind=BindTo.tcp("127.0.0.1"), queue_capacity=4)
    with pytest.raises(ValueError, match="secret"):
        DriverLink("tcp://127.0.0.1:1", 1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["encrypt", "authenticate"])
def test_a_peer_without_the_keys_is_refused_at_the_handshake(mode):
    """Plain sockets, and sockets holding keys derived from another secret, reach nothing: not the
    control channel, not a stage's data sockets; the legitimate traffic goes on."""
    auth = WireAuth(AUTH.secret, mode)
    other = WireAuth(JobSecret.generate(), mode)
    server = ControlServer(BindTo.tcp("127.0.0.1"), auth)
    stage = OneStage(1, server.address, bind=BindTo.tcp("127.0.0.1"), queue_capacity=8, auth=auth)
    peer0 = OneStage(0, server.address, bind=BindTo.tcp("127.0.0.1"), queue_capacity=8, auth=auth)
    ctx = zmq.Context()
    socks = []
    try:
        peer0.connect(stage.addresses["forward"], None)
        forged = encode_frames(Message(Kind.ERROR, extra={"message": "forged"}))
        for addr, kind in [(server.address, zmq.DEALER), (stage.addresses["forward"], zmq.PUSH),
                           (stage.addresses["backward"], zmq.PUSH)]:
            for keys in (None, other):
                s = ctx.socket(kind)
                s.setsockopt(zmq.LINGER, 0)
                if kind == zmq.DEALER:
                    s.setsockopt(zmq.IDENTITY, b"s1")
                if keys is not None:
                    from pipeq.wire.security import secure_client
                    secure_client(s, keys, addr, data=kind == zmq.PUSH)
                s.connect(addr)
                socks.append((s, forged))
        for s, frames in socks:
            for _ in range(3):
                try:  # refused peers have no pipe to send on (or lose it between poll and send)
                    s.send_multipart(frames, flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
        time.sleep(0.5)
        assert server.recv(200) is None
        assert not stage.pump(200) and len(stage.forward_queue) == 0 and not stage.control_queue
        peer0.send_activation(1, 0, [torch.ones(3)])  # the job's own traffic still flows
        assert torch.equal(stage.wait_data(stage.forward_queue, 1, 0).tensors[0], torch.ones(3))
    finally:
        for s, _ in socks:
            s.close(linger=0)
        ctx.term()
        for t in (peer0, stage):
            t.close()
        server.close()


@pytest.mark.timeout(30)
def test_authenticate_mode_drops_forged_and_replayed_data_messages():
    """Someone who has seen the traffic (and so the PLAIN password) still cannot inject: a message
    is taken only with a valid MAC and a sequence number above the last one."""
    from pipeq.wire.security import secure_client

    auth = WireAuth(AUTH.secret, "authenticate")
    a = OneStage(0, "inproc://unused", bind=BindTo.tcp("127.0.0.1"), queue_capacity=8, auth=auth)
    b = OneStage(1, "inproc://unused", bind=BindTo.tcp("127.0.0.1"), queue_capacity=8, auth=auth)
    ctx = zmq.Context()
    sniffer = ctx.socket(zmq.PUSH)
    sniffer.setsockopt(zmq.LINGER, 0)
    secure_client(sniffer, auth, b.addresses["forward"], data=True)
    sniffer.connect(b.addresses["forward"])
    try:
        a.connect(b.addresses["forward"], None)
        sealed = a.tx.data_frames(Kind.ACTIVATION, 3, 0, [torch.full((4,), 7.0)], a.tx.forward)
        copies = [bytes(memoryview(f)) for f in sealed]
        a.tx.forward.sock.send_multipart(sealed)
        assert torch.equal(b.wait_data(b.forward_queue, 3, 0).tensors[0], torch.full((4,), 7.0))
        tampered = list(copies)
        tampered[2] = bytes(torch.full((4,), 9.0).numpy().tobytes())
        unsigned = copies[1:]
        for frames in (copies, tampered, unsigned, [b"\0" * 24, *copies[1:]], [b"junk"]):
            sniffer.send_multipart(frames)
        wait_for(lambda: True if (b.pump(50), b.dropped == 5)[1] else None)
        a.send_activation(3, 1, [torch.ones(4)])  # the real next message
        assert torch.equal(b.wait_data(b.forward_queue, 3, 1).tensors[0], torch.ones(4))
        assert b.forward_queue.pop((3, 0)) is None and len(b.forward_queue) == 0 and b.dropped == 5
    finally:
        sniffer.close()
        ctx.term()
        a.close()
        b.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["encrypt", "authenticate"])
def test_an_oversized_frame_is_refused_before_it_is_buffered(mode):
    auth = WireAuth(AUTH.secret, mode)
    a = OneStage(0, "inproc://unused", bind=BindTo.tcp("127.0.0.1"), queue_capacity=8, auth=auth,
                       max_frame_bytes=1 << 20)
    b = OneStage(1, "inproc://unused", bind=BindTo.tcp("127.0.0.1"), queue_capacity=8, auth=auth,
                       max_frame_bytes=1 << 20)
    try:
        a.connect(b.addresses["forward"], None)
        big = torch.zeros(2 << 20, dtype=torch.uint8)
        with pytest.raises(ValueError, match=r"stage process 0: the activation of step 1 microbatch 0 .*2\.0 MiB "
                                             r".*shape \[2097152\].*max_message_mb"):
            a.send_activation(1, 0, [big])
        a.tx.max_frame_bytes = 4 << 20  # a misconfigured (or hostile) key holder sends it anyway
        a.send_activation(1, 0, [big])
        a.send_activation(1, 1, [torch.ones(2)])
        assert not b.pump(500) or len(b.forward_queue) == 0  # libzmq dropped the connection
        assert b.forward_queue.pop((1, 0)) is None
    finally:
        a.close()
        b.close()


def test_the_ipc_directory_must_be_private(tmp_path):
    import os

    from pipeq.wire.sockets import check_private_dir

    where = make_ipc_dir()
    try:
        assert os.stat(where).st_mode & 0o777 == 0o700
        check_private_dir(where)
        os.chmod(where, 0o755)
        with pytest.raises(PermissionError, match="open to others .*0700"):
            OneStage(0, "inproc://unused", bind=BindTo.ipc(where), queue_capacity=4)
    finally:
        remove_ipc_dir(where)
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(PermissionError, match="not a directory"):
        check_private_dir(str(link))


# -- a group link (tied weights' channel) ------------------------------------------------------------
def _tie_pair(bind, auth=None, server_addr="inproc://unused"):
    """Stages 0 and 2 of replica 0 (processes 0 and 2), linked as tie peers (a GroupLink)."""
    from pipeq.wire.tie_link import TieLink

    stages = [OneStage(k, server_addr, bind=bind, queue_capacity=4, auth=auth) for k in (0, 2)]
    links = [TieLink(t.rx, bind, stage=k, replica=0, peers=[2 - k], capacity=8) for k, t in zip((0, 2), stages)]
    for link in links:
        link.connect([links[0].address, None, links[1].address])
    return stages, links


def _close(stages, links):
    for link in links:
        link.close()
    for t in stages:
        t.close()


@pytest.mark.timeout(30)
def test_a_group_link_exchanges_tagged_tensors_and_an_exit_interrupts_a_wait():
    from pipeq.wire.errors import Stopped

    where = make_ipc_dir()
    server = ControlServer(BindTo.ipc(where))
    stages, links = _tie_pair(BindTo.ipc(where), server_addr=server.address)
    try:
        a, b = links
        assert a.address.startswith("ipc://") and a.address != b.address
        a.send(2, 1, [torch.arange(5.0)])
        a.send(2, 0, [torch.ones(3), torch.zeros(2, dtype=torch.int64)])
        b.send(2, 0, [torch.full((3,), 4.0)])
        got = b.wait(0, 2, 0)  # out of order: filed under (sender, step, index)
        assert torch.equal(got[0], torch.ones(3)) and torch.equal(got[1], torch.zeros(2, dtype=torch.int64))
        assert torch.equal(b.wait(0, 2, 1)[0], torch.arange(5.0))
        got = a.wait(2, 2, 0)[0]
        got.add_(1)  # the receiver's own buffer, writable (the tied sum goes there)
        assert torch.equal(got, torch.full((3,), 5.0))
        # nothing comes for (3, 0): the driver's EXIT ends the wait, other commands queue up
        stages[1].send_control(Message(Kind.READY))  # connect the stage's control socket
        wait_for(lambda: server.recv(100))
        server.send_many([(2, Message(Kind.STOP, -1)), (2, Message(Kind.EXIT, -1))])
        t0 = time.monotonic()
        with pytest.raises(Stopped):
            b.wait(0, 3, 0)
        assert time.monotonic() - t0 < 5
        assert [m.kind for m in stages[1].control_queue] == [Kind.STOP, Kind.EXIT]
    finally:
        _close(stages, links)
        server.close()
        remove_ipc_dir(where)


@pytest.mark.timeout(30)
def test_a_group_link_refuses_duplicates_and_a_full_inbox():
    where = make_ipc_dir()
    stages, links = _tie_pair(BindTo.ipc(where))
    try:
        a, b = links
        b.capacity = 2
        a.send(1, 0, [torch.ones(1)])
        a.send(1, 0, [torch.ones(1)])
        with pytest.raises(ProtocolError, match="duplicate message \\(1, 0\\) from stage 0"):
            b.wait(0, 1, 1)
        stages2, links2 = _tie_pair(BindTo.ipc(where))
        try:
            links2[1].capacity = 2
            for i in range(3):
                links2[0].send(1, i, [torch.ones(1)])
            with pytest.raises(ProtocolError, match="running ahead"):
                links2[1].wait(0, 2, 0)
        finally:
            _close(stages2, links2)
    finally:
        _close(stages, links)
        remove_ipc_dir(where)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["encrypt", "authenticate"])
def test_nobody_without_the_keys_joins_a_group_link(mode):
    """A plain socket, keys from another secret, and (authenticate mode) a sniffer that knows the
    PLAIN password but not the MAC key: refused at the handshake, or dropped; a message sealed for
    another link (replayed to the wrong stage) is dropped too. The peers' own traffic flows."""
    from pipeq.wire.codec import encode
    from pipeq.wire.security import secure_client

    auth = WireAuth(AUTH.secret, mode)
    other = WireAuth(JobSecret.generate(), mode)
    stages, links = _tie_pair(BindTo.tcp("127.0.0.1"), auth)
    ctx = zmq.Context()
    socks = []
    try:
        a, b = links
        assert b.address.startswith("tcp://")
        forged = [b"\0\0\0\0", *[bytes(memoryview(f)) for f in encode(Kind.TIE, 1, 0, [torch.full((4,), 1e6)])]]
        for keys in (None, other, auth if mode == "authenticate" else None):
            s = ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            if keys is not None:
                secure_client(s, keys, b.address, data=True)
            s.connect(b.address)
            socks.append(s)
        a.send(1, 0, [torch.ones(4)], to=[2])
        assert torch.equal(b.wait(0, 1, 0)[0], torch.ones(4))
        for s in socks:
            for frames in (forged, [forged[0], b"\0" * 40, *forged[1:]], [b"junk"], [b"\0\0\0\7", *forged[1:]]):
                try:  # refused peers have no pipe to send on (or lose it between poll and send)
                    s.send_multipart(frames, flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
        if mode == "authenticate":
            from pipeq.wire.security import FrameMac as _FrameMac

            wrong_link = _FrameMac(auth, "T0.0:2>0")  # sealed (validly) for the other direction
            socks[2].send_multipart([b"\0\0\0\0", *wrong_link.seal(forged[1:])])
        time.sleep(0.5)
        a.send(1, 1, [torch.full((4,), 2.0)], to=[2])  # the next genuine one
        assert torch.equal(b.wait(0, 1, 1)[0], torch.full((4,), 2.0))
        assert len(b.queue) == 0  # nothing forged was filed
        if mode == "authenticate":
            assert b.dropped == 5  # the sniffer's four (one with a bad origin) and the misdirected one
        else:
            assert b.dropped == 0  # refused at the handshake: never seen
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()
        _close(stages, links)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dead,gives_up", [([2], True), ([0], False)])
def test_a_lost_replicas_own_stage_reads_its_lost_in_a_wait(dead, gives_up):
    """Replica 1 is lost (LOST naming it, from round 3) while its stage 1, alive, has not issued
    its sum of round 2 and waits (for anything): the LOST is read there, once
    (:mod:`pipeq.parallel.membership`). With a dead stage downstream (stage 2) the wait ends
    (Stopped: the round is given up); with only the previous stage dead (stage 0) it goes on (the
    round can still be finished), and its sends to that stage are dropped from then on: a send
    never waits for room there."""
    from pipeq.parallel.membership import Membership
    from pipeq.wire import control
    from pipeq.wire.errors import Stopped

    where = make_ipc_dir()
    server = ControlServer(BindTo.ipc(where))
    stage = OneStage(3, server.address, bind=BindTo.ipc(where), queue_capacity=4)
    try:
        rounds = Membership(None, stage.rx.control_queue, stage.tx.send_control, stage.tx, stage=1, replica=1,
                            replicas=2)
        stage.rx.inbox.on_check(rounds.check_parting)
        stage.send_control(Message(Kind.READY))  # connect the stage's control socket
        wait_for(lambda: server.recv(100))
        server.send_many([(3, control.message(control.Lost(replica=1, from_round=3, dead=dead), -9))])
        wait_for(lambda: stage.pump(50) or None if not stage.control_queue else True)
        if gives_up:
            with pytest.raises(Stopped, match="gives gradient round 2 up"):
                stage.inbox.check_exit()
        else:
            stage.inbox.check_exit()
            assert rounds.parting is not None and stage.tx.backward_gone
        assert not stage.control_queue  # taken, once
    finally:
        stage.close()
        server.close()
        remove_ipc_dir(where)
