"""A tensor-parallel stage's shards: shard 0 talks to the pipeline, the others follow it.

With ``tensor_parallel=T`` every stage runs on T processes (shards) that compute together
(torch's DTensor over a mesh of the T, see :mod:`pipeq.parallel.tensor`). Only shard 0, the *lead*,
is wired into the pipeline: it gets the driver's commands and the neighbours' activations and
gradients, and sends its own. Activations cross stages once per stage, not T times::

    stage k-1 lead ──F──▶ stage k lead ──F──▶ stage k+1 lead
                            │  share (gloo broadcast, one host)
                            ▼
                         stage k shard 1..T-1   (same actions, same order, sends dropped)

Every message the lead's event loop consumes (a command, an activation, a gradient) is shared
with the followers in the order it was consumed, as the wire codec's frames (msgpack header plus
raw tensor bytes, validated on arrival like any other message: no pickles). The followers run the
very same event loop on what they are shared, so they take every action, and every collective
inside the stage's forward and backward, in the lead's order. What a follower would send (its
outputs, replies) is dropped: after the plan's all-reduce its outputs are the lead's.

The shards of a stage share one host (placement sees to it): the broadcast is gloo over loopback,
on the CPU group of the stage's tp row (:mod:`pipeq.parallel.mesh`). A follower waits for it
through its process's inbox, so that the driver's EXIT, and a LOST sent to it directly
(``fault_tolerance="replicas"``: each shard sums with the same shard of the other replicas, and
is told itself), still reach it; a LOST is the only command the lead does not share.
A message the lead received on its device (CUDA IPC from a neighbour, :mod:`pipeq.wire.shm`) is
shared as host copies of its device tensors (:func:`host_tensors`; the worker has them made
through pinned memory); its event loop keeps the device tensors. CPU tensors are shared as they
are, without a copy.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

from pipeq.errors import CodecError
from pipeq.wire import codec
from pipeq.wire.frames import frames_of
from pipeq.wire.messages import Kind, Message
from pipeq.wire.transport import ProcessTransport

__all__ = ["ShardLink", "LeadTransport", "FollowerTransport", "MAX_FRAMES", "HostCopies", "host_tensors"]

_ALIGN = 64  # every frame starts at a multiple of this in the shared buffer (torch's alignment)
MAX_FRAMES = codec.MAX_TENSORS + 1


def _round(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


#: ``copies(tensors, device)``: CPU copies of ``tensors`` (all on CUDA ``device``), complete when
#: returned (the worker's: pipeq.stage.transfer.pinned_copies, through pinned memory)
HostCopies = Callable[[Sequence[torch.Tensor], torch.device], Sequence[torch.Tensor]]


def _plain_copies(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    return [t.cpu() for t in tensors]


def host_tensors(tensors: Sequence[torch.Tensor], copies: HostCopies | None = None) -> Sequence[torch.Tensor]:
    """``tensors`` on the CPU, as the codec takes them: ``tensors`` itself when all are there (no
    copy), else a list of the CPU ones as they are and host copies of the others, in order: a CUDA
    device's by one call of ``copies`` per device (default: ``.cpu()``), any other device's by
    ``.cpu()``."""
    away: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.device.type != "cpu":
            away.setdefault(t.device, []).append(i)
    if not away:
        return tensors
    out = list(tensors)
    for device, where in away.items():
        copy = copies if copies is not None and device.type == "cuda" else _plain_copies
        for i, t in zip(where, copy([tensors[i] for i in where], device)):
            out[i] = t
    return out


class ShardLink:
    """Shard 0 of a stage :meth:`share`\\ s messages; every other shard :meth:`receive`\\ s them,
    in order, over the stage's CPU process group ``group`` (gloo). ``host_copies``: how shard 0
    copies the CUDA tensors of a message it shares to the host (see :func:`host_tensors`)."""

    def __init__(self, group: Any, shard: int, shards: int, where: str, max_bytes: int,
                 host_copies: HostCopies | None = None, wait: Callable[[Callable[[], bool]], None] | None = None,
                 src: int = 0) -> None:
        """``wait(done)``: how a follower waits for a broadcast (its process's inbox; None: blocking);
        ``src``: shard 0's rank in the process's default group (its mesh's slice)."""
        import torch.distributed as dist

        self._dist = dist
        self.wait = wait
        self.src = src
        self.group = group
        self.shard = shard
        self.shards = shards
        self.where = where
        self.max_bytes = max_bytes  # the most a shared message may carry (frames and lengths)
        self.host_copies = host_copies
        self._head = torch.empty(3, dtype=torch.int64)

    def share(self, msg: Message, chunk: int = 0) -> None:
        """Shard 0: hand ``msg``, which its chunk ``chunk`` consumed, to the other shards (two
        broadcasts: its size and chunk, its frames); its device tensors as host copies
        (:func:`host_tensors`), ``msg`` itself left as it is."""
        tensors = host_tensors(msg.tensors, self.host_copies)
        frames = frames_of(msg if tensors is msg.tensors else dataclasses.replace(msg, tensors=tensors))
        views = [memoryview(f).cast("B") for f in frames]
        start = _round(8 * len(views))
        offsets = []
        end = start
        for v in views:
            offsets.append(end)
            end = _round(end + v.nbytes)
        buf = torch.empty(end, dtype=torch.uint8)
        raw = buf.numpy()
        raw[:8 * len(views)].view("<i8")[:] = [v.nbytes for v in views]
        for off, v in zip(offsets, views):
            raw[off:off + v.nbytes] = v
        self._head[0], self._head[1], self._head[2] = len(views), end, chunk
        self._dist.broadcast(self._head, self.src, group=self.group)
        self._dist.broadcast(buf, self.src, group=self.group)

    def _broadcast_in(self, t: torch.Tensor) -> None:
        """Receive shard 0's broadcast into ``t``, waiting through :attr:`wait`."""
        if self.wait is None:
            self._dist.broadcast(t, self.src, group=self.group)
            return
        work = self._dist.broadcast(t, self.src, group=self.group, async_op=True)
        self.wait(work.is_completed)
        work.wait()

    def receive(self) -> tuple[int, Message]:
        """Another shard: the next message shard 0 shared and the chunk it was for, checked as
        any message from the wire."""
        head = torch.empty(3, dtype=torch.int64)
        self._broadcast_in(head)
        n, total, chunk = int(head[0]), int(head[1]), int(head[2])
        if not 1 <= n <= MAX_FRAMES or not 0 <= total <= self.max_bytes:
            raise CodecError(f"{self.where}: shard 0 shared a message of {n} frames, {total} bytes "
                             f"(at most {MAX_FRAMES} frames, {self.max_bytes} bytes)")
        buf = torch.empty(total, dtype=torch.uint8)
        self._broadcast_in(buf)
        raw = buf.numpy()
        start = _round(8 * n)
        if start > total:
            raise CodecError(f"{self.where}: a shared message of {total} bytes cannot hold {n} frame lengths")
        lengths = raw[:8 * n].view("<i8").tolist()
        frames = []
        off = start
        for length in lengths:
            if length < 0 or off + length > total:
                raise CodecError(f"{self.where}: a shared message's frame of {length} bytes runs past its "
                                 f"{total} bytes")
            frames.append(memoryview(raw[off:off + length]))
            off = _round(off + length)
        return chunk, codec.decode(frames)


class LeadTransport:
    """Shard 0's transport: the process's own (a :class:`~pipeq.wire.transport.ProcessTransport`),
    sharing every message it hands the event loop, with the chunk it is for."""

    def __init__(self, transport: ProcessTransport, link: ShardLink) -> None:
        self._inner = transport
        self.link = link
        # sends, replies and wiring: the process's own, bound once (the event loop calls them per action)
        self.send_activation = transport.send_activation
        self.send_gradient = transport.send_gradient
        self.send_control = transport.send_control
        self.connect = transport.connect
        self.addresses = transport.addresses
        self.shm_waits = transport.shm_waits
        self.device_payloads = transport.device_payloads

    def next_command(self, ready: Sequence[int], timeout_ms: int) -> tuple[int, Message] | None:
        got = self._inner.next_command(ready, timeout_ms)
        if got is not None and got[1].kind is not Kind.LOST:  # (each shard is told of a loss itself)
            self.link.share(got[1], got[0])
        return got

    def wait_activation(self, c: int, step: int, mb: int) -> Message:
        msg = self._inner.wait_activation(c, step, mb)
        self.link.share(msg, c)
        return msg

    def wait_gradient(self, c: int, step: int, mb: int) -> Message:
        msg = self._inner.wait_gradient(c, step, mb)
        self.link.share(msg, c)
        return msg


class FollowerTransport:
    """Shard s > 0's transport as its event loop sees it: commands and data are what shard 0
    shares, in its order; sends and replies go nowhere (shard 0 makes them). Errors and
    heartbeats still reach the driver on the process's own control channels (the worker's)."""

    def __init__(self, transport: ProcessTransport, link: ShardLink) -> None:
        self._inner = transport
        self.link = link
        self.addresses = transport.addresses
        self.device_payloads = False

    def next_command(self, ready: Sequence[int], timeout_ms: int) -> tuple[int, Message] | None:
        c, msg = self.link.receive()
        if c not in ready:
            raise RuntimeError(f"{self.link.where}: shard 0 shared a command for chunk {c}, which is not ready "
                               f"here (chunks {list(ready)}): the shards are out of step")
        return c, msg

    def wait_activation(self, c: int, step: int, mb: int) -> Message:
        return self._follow(Kind.ACTIVATION, c, step, mb)

    def wait_gradient(self, c: int, step: int, mb: int) -> Message:
        return self._follow(Kind.GRADIENT, c, step, mb)

    def _follow(self, kind: Kind, c: int, step: int, mb: int) -> Message:
        got, msg = self.link.receive()
        if msg.kind is not kind or msg.step != step or msg.microbatch != mb or got != c:
            raise RuntimeError(f"{self.link.where}: waited for {kind.name} ({step}, {mb}) of chunk {c}, shard 0 "
                               f"shared {msg.kind.name} ({msg.step}, {msg.microbatch}) of chunk {got}: the shards "
                               "are out of step")
        return msg

    def shm_waits(self, c: int) -> int:
        return 0

    def send_control(self, c: int, msg: Message) -> None:
        pass

    def send_activation(self, c: int, step: int, mb: int, tensors: Sequence[torch.Tensor], tree: Any = None) -> None:
        pass

    def send_gradient(self, c: int, step: int, mb: int, tensors: Sequence[torch.Tensor]) -> None:
        pass

    def connect(self, c: int, next_forward: str | None, prev_backward: str | None) -> None:
        pass
