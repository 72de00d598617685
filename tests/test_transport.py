"""The transport's keyed queues and a stage-to-stage round trip over real ZeroMQ sockets."""

from __future__ import annotations

import pytest
import torch

from pipeq.messages import Kind, Message
from pipeq.transport import BindTo, KeyedQueue, ProtocolError, StageTransport, make_ipc_dir, remove_ipc_dir


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
