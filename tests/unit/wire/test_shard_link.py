"""The shard link (pipeq.wire.shard_link): a tensor-parallel stage's shard 0 shares every message
its event loop consumes, and the other shards follow it, in this process.

``torch.distributed.broadcast`` is replaced by an in-memory one: what shard 0 broadcasts, the
followers receive in the same order (as gloo's broadcast over the stage's group does). A message
the lead received on its GPU is shared as host copies (the codec refuses device tensors): CUDA
tensors are stand-ins here, and so is the worker's pinned_copies.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed

from pipeq.errors import CodecError
from pipeq.wire.messages import Kind, Message
from pipeq.wire.shard_link import MAX_FRAMES, FollowerTransport, LeadTransport, ShardLink, host_tensors


class Group:
    """One shard's view of the stage's group: broadcasts from rank 0 queue up for the others."""

    def __init__(self, sent: collections.deque, rank: int) -> None:
        self.sent, self.rank = sent, rank


def broadcast(tensor: torch.Tensor, src: int, group: Group) -> None:
    if group.rank == src:
        group.sent.append(tensor.clone())
    else:
        got = group.sent.popleft()
        assert got.shape == tensor.shape and got.dtype == tensor.dtype, "a broadcast of another size"
        tensor.copy_(got)


@pytest.fixture
def links(monkeypatch):
    """(shard 0's link, shard 1's link) of one stage, with frames of up to 1 MiB."""
    monkeypatch.setattr(torch.distributed, "broadcast", broadcast)
    sent: collections.deque = collections.deque()
    return (ShardLink(Group(sent, 0), 0, 2, "stage 1, shard 0", max_bytes=1 << 20),
            ShardLink(Group(sent, 1), 1, 2, "stage 1, shard 1", max_bytes=1 << 20))


def same(a: Message, b: Message) -> bool:
    return ((a.kind, a.step, a.microbatch, a.extra) == (b.kind, b.step, b.microbatch, b.extra)
            and len(a.tensors) == len(b.tensors)
            and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a.tensors, b.tensors)))


MESSAGES = [
    Message(Kind.TRAIN, 3, 0, [torch.randn(4, 5), torch.arange(4)], {"sizes": [2, 2], "weights": [0.5, 0.5]}),
    Message(Kind.ACTIVATION, 3, 1, [torch.randn(2, 7).to(torch.bfloat16)]),
    Message(Kind.GRADIENT, 3, 0, [torch.randn(3, 1, 2)]),
    Message(Kind.GET_STATE, -4),
    Message(Kind.ACTIVATION, 0, 0, [torch.zeros(0, 3), torch.tensor(1.5)]),  # empty and 0-d tensors
]


def test_followers_receive_every_shared_message_whole_and_in_order(links) -> None:
    lead, follower = links
    for c, msg in enumerate(MESSAGES):
        lead.share(msg, c % 2)
    for c, msg in enumerate(MESSAGES):
        chunk, got = follower.receive()
        assert chunk == c % 2 and same(got, msg)


class Inner:
    """Shard 0's own transport (a process of two stages): commands and data as they arrive;
    what it sends is recorded."""

    def __init__(self) -> None:
        self.commands = [(1, Message(Kind.TRAIN, 0, 0, [], {"sizes": [1]})), None, (0, Message(Kind.STOP, -1))]
        self.data = {(0, 0): Message(Kind.ACTIVATION, 0, 0, [torch.ones(2)]),
                     (0, 1): Message(Kind.GRADIENT, 0, 1, [torch.ones(3)])}
        self.sent: list = []
        self.device_payloads = False

    def shm_waits(self, c):
        return 5

    def addresses(self, c):
        return {}

    def next_command(self, ready, timeout_ms):
        return self.commands.pop(0)

    def wait_activation(self, c, step, mb):
        return self.data[(step, mb)]

    def wait_gradient(self, c, step, mb):
        return self.data[(step, mb)]

    def send_activation(self, *args, **kwargs):
        self.sent.append(("act", args))

    def send_gradient(self, *args):
        self.sent.append(("grad", args))

    def send_control(self, c, msg):
        self.sent.append(("control", c, msg.kind))

    def connect(self, *addresses):
        self.sent.append(("connect", addresses))


def test_a_follower_sees_what_the_lead_consumed_and_sends_nothing(links) -> None:
    lead_link, follower_link = links
    inner, theirs = Inner(), Inner()
    lead, follower = LeadTransport(inner, lead_link), FollowerTransport(theirs, follower_link)
    # the lead's event loop: a command, a poll that found nothing, its data, another command
    got = [lead.next_command([0, 1], 10), lead.next_command([0, 1], 10), lead.wait_activation(1, 0, 0),
           lead.wait_gradient(0, 0, 1), lead.next_command([0], 10)]
    assert got[1] is None and lead.shm_waits(0) == 5
    # the follower's, the same calls: the same messages, for the same chunks (nothing for the empty poll)
    c, cmd = follower.next_command([0, 1], 10)
    assert c == 1 and same(cmd, got[0][1])
    assert same(follower.wait_activation(1, 0, 0), got[2])
    assert same(follower.wait_gradient(0, 0, 1), got[3])
    c, cmd = follower.next_command([0], 10)
    assert c == 0 and same(cmd, got[4][1])
    # a follower's outputs and replies go nowhere: shard 0 sends the stage's
    follower.send_activation(0, 0, 0, [torch.ones(1)])
    follower.send_gradient(0, 0, 0, [torch.ones(1)])
    follower.send_control(0, Message(Kind.LOSS, 0))
    follower.connect(0, "ipc://a", "ipc://b")
    assert theirs.sent == [] and follower.shm_waits(0) == 0
    lead.send_control(1, Message(Kind.LOSS, 0))
    assert inner.sent == [("control", 1, Kind.LOSS)]


@pytest.mark.parametrize("waited, shared", [
    ((Kind.ACTIVATION, 0, 1), Message(Kind.ACTIVATION, 0, 0, [torch.ones(1)])),  # another microbatch
    ((Kind.ACTIVATION, 0, 0), Message(Kind.GRADIENT, 0, 0, [torch.ones(1)])),  # another channel
    ((Kind.GRADIENT, 1, 0), Message(Kind.GRADIENT, 0, 0, [torch.ones(1)])),  # another step
    ((Kind.GRADIENT, 0, 0, 1), Message(Kind.GRADIENT, 0, 0, [torch.ones(1)])),  # another chunk
])
def test_a_follower_out_of_step_with_its_lead_fails_saying_so(links, waited, shared) -> None:
    lead_link, follower_link = links
    theirs = Inner()
    follower = FollowerTransport(theirs, follower_link)
    lead_link.share(shared)
    kind, step, mb, *chunk = waited
    wait = follower.wait_activation if kind is Kind.ACTIVATION else follower.wait_gradient
    with pytest.raises(RuntimeError, match="out of step") as info:
        wait(chunk[0] if chunk else 0, step, mb)
    assert "stage 1, shard 1" in str(info.value)


def test_a_follower_refuses_a_command_for_a_stage_that_is_not_ready(links) -> None:
    lead_link, follower_link = links
    follower = FollowerTransport(Inner(), follower_link)
    lead_link.share(Message(Kind.STOP, -1), 1)  # chunk 1 of the lead's process was ready, not the follower's
    with pytest.raises(RuntimeError, match="chunk 1, which is not ready here .*out of step"):
        follower.next_command([0], 10)


def test_a_shared_message_larger_than_allowed_is_refused_before_it_is_read(links) -> None:
    lead, _ = links
    follower = ShardLink(Group(lead.group.sent, 1), 1, 2, "stage 1, shard 1", max_bytes=1024)
    lead.share(Message(Kind.ACTIVATION, 0, 0, [torch.zeros(1024)]))
    with pytest.raises(CodecError, match=r"a message of 2 frames, 4\d\d\d bytes \(.*, 1024 bytes\)"):
        follower.receive()
    assert len(lead.group.sent) == 1  # its body: never taken in


def head(n: int, total: int) -> torch.Tensor:
    return torch.tensor([n, total, 0], dtype=torch.int64)


@pytest.mark.parametrize("frames, body, message", [
    (0, torch.zeros(0, dtype=torch.uint8), "of 0 frames"),
    (MAX_FRAMES + 1, torch.zeros(64, dtype=torch.uint8), f"at most {MAX_FRAMES} frames"),
    (9, torch.zeros(64, dtype=torch.uint8), "cannot hold 9 frame lengths"),
    (1, torch.tensor([100, 0, 0, 0, 0, 0, 0, 0] + [0] * 56, dtype=torch.uint8), "runs past"),
])
def test_a_corrupt_shared_message_is_a_codec_error_naming_the_shard(links, frames, body, message) -> None:
    lead, follower = links
    lead.group.sent.extend([head(frames, body.numel()), body])
    with pytest.raises(CodecError, match=message) as info:
        follower.receive()
    assert "stage 1, shard 1" in str(info.value)


# -- messages the lead received on its device (CUDA IPC from a neighbour) ----------------------------
class OnDevice:
    """A stand-in for a tensor on ``device`` (a CUDA one needs no GPU here): what the lead's
    transport hands it after a CUDA slot. ``host`` is its value; ``.cpu()`` is the way off a
    device other than CUDA."""

    def __init__(self, host: torch.Tensor, device: str) -> None:
        self.host, self.device = host, torch.device(device)

    def cpu(self) -> torch.Tensor:
        return self.host.clone()


class Pinned:
    """A stand-in for the worker's pinned_copies (pipeq.stage.transfer), recording its calls:
    [(device, how many tensors)]."""

    def __init__(self) -> None:
        self.calls: list = []

    def __call__(self, tensors, device):
        self.calls.append((device, len(tensors)))
        return [t.host.clone() for t in tensors]


def test_cpu_tensors_are_shared_as_they_are() -> None:
    tensors, pinned = [torch.randn(3), torch.arange(4)], Pinned()
    assert host_tensors(tensors, pinned) is tensors  # no copy, not even a new list
    assert host_tensors((), pinned) == ()
    assert pinned.calls == []


def test_device_tensors_are_copied_to_the_host_by_device_in_order() -> None:
    a, b, c = torch.randn(2, 3), torch.arange(5), torch.randn(4).to(torch.bfloat16)
    d, e = torch.ones(1), torch.zeros(2)
    tensors, pinned = [a, OnDevice(b, "cuda:1"), OnDevice(c, "cuda:0"), d, OnDevice(e, "cuda:1")], Pinned()
    out = host_tensors(tensors, pinned)
    assert out[0] is a and out[3] is d  # the CPU ones as they are
    assert all(x.device.type == "cpu" and torch.equal(x, y) for x, y in zip(out, [a, b, c, d, e]))
    # CUDA through the copier given (the worker's: pinned memory), one call (one wait) per device
    assert pinned.calls == [(torch.device("cuda:1"), 2), (torch.device("cuda:0"), 1)]
    assert tensors[1].device.type == "cuda"  # the caller's list untouched
    # without a copier, and off any other device: .cpu()
    meta, cuda = OnDevice(torch.randn(3), "meta"), OnDevice(torch.randn(2), "cuda:0")
    out = host_tensors([meta, cuda])
    assert torch.equal(out[0], meta.host) and torch.equal(out[1], cuda.host)
    assert torch.equal(host_tensors([meta], pinned)[0], meta.host) and len(pinned.calls) == 2


def test_the_lead_shares_host_copies_of_what_it_received_on_its_device(links) -> None:
    """The codec refuses device tensors: the lead shares host copies, and its own event loop
    gets the message as received (device tensors)."""
    lead_link, follower_link = links
    lead_link.host_copies = pinned = Pinned()
    x, y, g = torch.randn(2, 7), torch.arange(2), torch.randn(3, 1, 2)
    inner, theirs = Inner(), Inner()
    inner.data = {(0, 0): Message(Kind.ACTIVATION, 0, 0, [OnDevice(x, "cuda:0"), y], {"tree": [1, 2]}),
                  (0, 1): Message(Kind.GRADIENT, 0, 1, [OnDevice(g, "cuda:0")])}
    lead, follower = LeadTransport(inner, lead_link), FollowerTransport(theirs, follower_link)
    act = lead.wait_activation(0, 0, 0)
    grad = lead.wait_gradient(0, 0, 1)
    assert act is inner.data[(0, 0)] and isinstance(act.tensors[0], OnDevice)
    assert grad is inner.data[(0, 1)] and isinstance(grad.tensors[0], OnDevice)
    assert pinned.calls == [(torch.device("cuda:0"), 1)] * 2
    assert same(follower.wait_activation(0, 0, 0), Message(Kind.ACTIVATION, 0, 0, [x, y], {"tree": [1, 2]}))
    assert same(follower.wait_gradient(0, 0, 1), Message(Kind.GRADIENT, 0, 1, [g]))


def test_a_real_tensor_on_another_device_is_moved_before_encoding(links) -> None:
    """A "meta" tensor: no data to copy, so the move itself fails (torch's own error), not the codec."""
    lead, _ = links
    with pytest.raises(NotImplementedError, match="meta"):
        lead.share(Message(Kind.ACTIVATION, 0, 0, [torch.empty(3, device="meta")]))
