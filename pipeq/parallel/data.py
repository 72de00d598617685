"""Data parallelism beside the pipeline: R replicas of every stage, gradients summed.

Stage k of replica r talks to stage k of every other replica over a
:class:`~pipeq.wire.replica_link.ReplicaLink`: pipeq's own ZeroMQ transport, authenticated like
the pipeline's data channels (ipc in the run's private directory on one host; tcp with the job's
keys otherwise), with no torch.distributed and no port that anyone else can join. Each replica
runs its own shard of the batch through its own pipeline; the loss of every microbatch is weighted
by its share of the *whole* batch, so the sum of the replicas' gradients is the full-batch gradient.

When the driver has told the replicas where their siblings are (PEERS), replica 0 sends its
parameters and buffers to the others, which load them before anything else: replicas never start
apart. Then every step, :class:`GradSync` sends the stage's gradients, in flat buckets, to every
other replica as soon as the stage's last backward of the step is done (without blocking: the
stage still sends its last gradient down meanwhile); the optimizer step waits for the other
replicas' buckets and adds all R of them in replica order 0, 1, ..., R-1
(:func:`~pipeq.stage.transfer.ordered_sum`), so every replica holds the very same bits (for the
small R pipeq runs this moves as many bytes as a ring would)::

    replica 0, stage k | ... B6 B7 [send buckets] ..... [wait, add 0+1] ST
    replica 1, stage k | ... B6 B7 [send buckets] ..... [wait, add 0+1] ST
                                    \\________ both ways ________/

With ``fault_tolerance="replicas"`` a replica may be lost mid-step (the driver's LOST says so, and
from which round on: :mod:`pipeq.control.replica_loss`): a stage then sums, in replica order, the
buckets of the replicas whose same stage delivered *all* of its buckets for the round (never part
of one; a round before the lost replica's first missed one still waits for its buckets, unless
its process of this stage is dead), and scales the
sum by ``survivor_scale``: the whole batch's loss weight over the weight of the replicas summed,
``fsum(shares) / fsum(shares[r] for r summed)`` (each replica's share, the sum of its microbatches'
weights, rides in TRAIN). Since every microbatch's loss is weighted by its share of the whole
batch, the scaled sum is the gradient of the mean loss over the samples of the replicas summed.

A CUDA stage copies each bucket to pinned host memory before sending it and adds on the host, so
replicas on different devices add alike; the sum goes back to the device once.
"""

from __future__ import annotations

import collections
import math
from typing import Callable, Sequence

import torch

from pipeq.stage.transfer import ordered_sum, pinned_copies
from pipeq.wire.replica_link import ReplicaLink
from pipeq.wire.sockets import BindTo
from pipeq.wire.stage_inbox import StageInbox
from pipeq.wire.stage_link import StageSender

__all__ = ["BUCKET_BYTES", "WEIGHTS_STEP", "FlatLayout", "to_host", "to_device", "survivor_scale", "GradSync",
           "broadcast_from_replica_0", "Replicas"]

BUCKET_BYTES = 25 << 20
WEIGHTS_STEP = 0  # the message "step" of replica 0's weights at start; GradSync's rounds count from 1


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel shard's own piece of ``t`` (a DTensor; pipeq.parallel.tensor), else ``t``:
    each shard sums its piece with the same shard of the other replicas."""
    return t.to_local() if hasattr(t, "device_mesh") and hasattr(t, "to_local") else t


class FlatLayout:
    """How a list of tensors is packed into flat buckets: one dtype and device per bucket, at most
    ``bucket_bytes`` each, the tensors' elements in order (a tensor larger than a bucket is cut
    across several, so no bucket is over the cap of a data frame)."""

    def __init__(self, tensors: Sequence[torch.Tensor], bucket_bytes: int) -> None:
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, t in enumerate(tensors):
            groups.setdefault((t.dtype, t.device), []).append(i)
        #: per bucket: its pieces (tensor index, first element, end element)
        self.pieces: list[list[tuple[int, int, int]]] = []
        self.dtypes: list[torch.dtype] = []
        self.devices: list[torch.device] = []
        self.numels: list[int] = []
        for (dtype, device), members in groups.items():
            cap = max(1, bucket_bytes // torch.empty((), dtype=dtype).element_size())
            bucket: list[tuple[int, int, int]] = []
            room = cap
            for i in members:
                n, a = tensors[i].numel(), 0
                while a < n:
                    take = min(n - a, room)
                    bucket.append((i, a, a + take))
                    a += take
                    room -= take
                    if room == 0:
                        self._add(bucket, dtype, device)
                        bucket, room = [], cap
            if bucket:
                self._add(bucket, dtype, device)

    def _add(self, pieces: list[tuple[int, int, int]], dtype: torch.dtype, device: torch.device) -> None:
        self.pieces.append(pieces)
        self.dtypes.append(dtype)
        self.devices.append(device)
        self.numels.append(sum(e - a for _, a, e in pieces))

    def __len__(self) -> int:
        return len(self.pieces)

    def gather(self, b: int, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Bucket ``b`` of ``tensors`` as a new flat tensor on their device (never a view of them)."""
        return torch.cat([tensors[i].reshape(-1)[a:e] for i, a, e in self.pieces[b]])

    def scatter(self, b: int, flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Copy flat bucket ``b`` (on the tensors' device) into ``tensors``, in place."""
        offset = 0
        for i, a, e in self.pieces[b]:
            t, src = tensors[i], flat[offset:offset + e - a]
            if t.is_contiguous():
                t.view(-1)[a:e].copy_(src)
            else:  # rare (a parameter made from a transposed view): through a contiguous copy
                whole = t.reshape(-1).clone()
                whole[a:e].copy_(src)
                t.copy_(whole.view(t.shape))
            offset += e - a

    def check(self, b: int, got: Sequence[torch.Tensor], sender: int, what: str,
              sender_is: str = "replica") -> torch.Tensor:
        """The one flat tensor of bucket ``b`` that ``sender`` (a replica, or what ``sender_is``
        says) sent, checked against the plan."""
        if (len(got) != 1 or got[0].dim() != 1 or got[0].dtype != self.dtypes[b]
                or got[0].numel() != self.numels[b]):
            desc = ", ".join(f"{list(t.shape)} {t.dtype}" for t in got)
            hint = "do the replicas hold the same stage?" if sender_is == "replica" else \
                "do both hold the same tied weights?"
            raise RuntimeError(f"{sender_is} {sender} sent {what} bucket {b} as [{desc}], expected one flat "
                               f"{self.dtypes[b]} tensor of {self.numels[b]} elements: {hint}")
        return got[0]


def to_host(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` on the CPU, ready to send: a CUDA tensor goes through pinned memory."""
    if flat.device.type == "cpu":
        return flat
    if flat.device.type == "cuda" and torch.cuda.is_available():
        return pinned_copies([flat], flat.device)[0]
    return flat.to("cpu")


def to_device(flat: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A received (host) bucket on ``device``; the copy is complete when this returns."""
    return flat if device.type == "cpu" else flat.to(device)


def survivor_scale(shares: Sequence[float] | None, summed: Sequence[int], replicas: int) -> float:
    """What a gradient summed over the replicas ``summed`` only is multiplied by, so that it is
    the gradient of the mean loss over their samples: the whole batch's loss weight over theirs,
    ``fsum(shares) / fsum(shares[r] for r in summed)`` (each sum rounded once; 1.0 when every
    replica is summed). Without ``shares``, equal shares: ``replicas / len(summed)``."""
    if len(summed) == replicas:
        return 1.0
    if not summed:
        raise ValueError("no replica to sum")
    if shares is None:
        return replicas / len(summed)
    if len(shares) != replicas:
        raise ValueError(f"{len(shares)} shares for {replicas} replicas")
    part = math.fsum(shares[r] for r in summed)
    if not part > 0:
        raise ValueError(f"the replicas {list(summed)} summed hold no loss weight ({part})")
    return math.fsum(shares) / part


class GradSync:
    """Sums the parameters' gradients over the replicas, in buckets, without blocking.

    Each call of :meth:`start` (and its :meth:`finish`) is one round, numbered from 1 alike on
    every replica: the messages are tagged ``(round, bucket)``."""

    def __init__(self, params: Sequence[torch.Tensor], link: ReplicaLink, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.params = list(params)
        self.link = link
        # a tensor-parallel shard sums its own pieces (pipeq.parallel.tensor); else the tensors as they are
        self.local = _local if any(hasattr(p, "device_mesh") for p in self.params) else (lambda t: t)
        self.layout = FlatLayout([self.local(p) for p in self.params], bucket_bytes)
        self.round = 0
        self.started = False
        self.pending: list[torch.Tensor] = []  # this replica's buckets of the round (host), as sent
        # fault_tolerance="replicas": each coming round's replica shares (TRAIN's), in order
        self.shares: collections.deque[list[float]] = collections.deque()
        self.round_shares: list[float] | None = None
        self.summed: list[int] = list(range(link.replicas))  # the replicas the last round summed
        # told True as the round starts waiting for the other replicas, False when it computes
        # again: waiting for a peer is not being stuck in one's own computation (step_timeout)
        self.note_wait: Callable[[bool], None] | None = None

    def start(self) -> None:
        """After the step's last backward: send every bucket to every other replica."""
        self.round += 1
        self.started = True
        self.round_shares = self.shares.popleft() if self.shares else None
        grads = []
        for p in self.params:  # a parameter this replica did not use still takes part (zeros)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(self.local(p.grad))
        for b in range(len(self.layout)):
            flat = to_host(self.layout.gather(b, grads))
            self.link.send(self.round, b, [flat])
            self.pending.append(flat)
        self.link.sent_round = self.round

    def finish(self) -> None:
        """Before the optimizer step: wait for the other replicas' buckets, add, put the sums back."""
        if not self.started:
            self.start()  # no backward ran (nothing to learn in this step): still take part
        link, layout = self.link, self.layout
        if self.note_wait is not None:
            self.note_wait(True)
        try:
            received = self._receive()
        finally:
            if self.note_wait is not None:
                self.note_wait(False)
        summed = self.summed = sorted([link.replica, *received])
        scale = survivor_scale(self.round_shares, summed, link.replicas)
        with torch.no_grad():
            grads = [self.local(p.grad) for p in self.params]
            for b, mine in enumerate(self.pending):
                got = [mine if r == link.replica else received[r][b] for r in summed]
                acc = ordered_sum(got, summed.index(link.replica)) if len(got) > 1 else mine.clone()
                if scale != 1.0:
                    acc.mul_(scale)
                layout.scatter(b, to_device(acc, layout.devices[b]), grads)
        self.pending.clear()
        self.started = False
        link.round_done(self.round, summed)  # (a LOST that waited for this round is ACKed)

    def _receive(self) -> dict[int, list[torch.Tensor]]:
        """The round's buckets of every other replica that delivered them all: a replica lost
        (LOST) for this round before its last bucket came is left out of the whole round."""
        link, layout = self.link, self.layout
        received: dict[int, list[torch.Tensor]] = {}
        for r in link.others():
            mine: list[torch.Tensor] = []
            for b in range(len(self.pending)):
                got = link.wait_replica(r, self.round, b)
                if got is None:
                    break
                mine.append(layout.check(b, got, r, "gradient"))
            if len(mine) == len(self.pending):
                received[r] = mine
        return received


def broadcast_from_replica_0(link: ReplicaLink, tensors: Sequence[torch.Tensor],
                             bucket_bytes: int = BUCKET_BYTES) -> None:
    """Replica 0 sends ``tensors`` (its parameters and buffers); the others load them, in place."""
    with torch.no_grad():
        tensors = [_local(t.detach()) for t in tensors]
    layout = FlatLayout(tensors, bucket_bytes)
    with torch.no_grad():
        for b in range(len(layout)):
            if link.replica == 0:
                link.send(WEIGHTS_STEP, b, [to_host(layout.gather(b, tensors))])
            else:
                flat = layout.check(b, link.wait(0, WEIGHTS_STEP, b), 0, "weight")
                layout.scatter(b, to_device(flat, layout.devices[b]), tensors)


class Replicas:
    """Stage k's place among its replicas: the link to them, the start-up broadcast, the
    :class:`GradSync` the executor calls.

    Made before the stage reports READY (its link is bound: :attr:`address` travels in READY);
    :meth:`join` runs when the driver's PEERS names the other replicas' addresses.
    """

    def __init__(self, receiver: StageInbox, sender: StageSender, bind: BindTo, *, stage: int, replica: int,
                 replicas: int, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor], shard: int = 0) -> None:
        # a bucket is one data frame: never over the frame cap
        self.bucket_bytes = min(BUCKET_BYTES, receiver.max_frame_bytes)
        self.params = list(params)
        self.weights = self.params + list(buffers)
        n_grads = len(FlatLayout([_local(p) for p in self.params], self.bucket_bytes))
        n_weights = len(FlatLayout([_local(w) for w in self.weights], self.bucket_bytes))
        # what may wait, per sibling: its weights and a round of buckets, or two rounds (a replica
        # is never more than one round ahead of another: each round waits for everyone's buckets)
        self.link = ReplicaLink(receiver, sender, bind, stage=stage, replica=replica, replicas=replicas, shard=shard,
                                capacity=(replicas - 1) * (n_weights + 2 * n_grads + 1))
        self.sync = GradSync(self.params, self.link, self.bucket_bytes)

    @property
    def address(self) -> str:
        return self.link.address

    def join(self, addresses: Sequence[str], rejoin_round: int | None = None) -> None:
        """Connect to the other replicas and start from replica 0's parameters and buffers; a
        rebuilt replica (``rejoin_round``: the rounds the others have made) gets no weights from
        replica 0 (the driver restores a healthy replica's state into it) and goes on counting
        rounds from there."""
        self.link.connect(addresses)
        if rejoin_round is None:
            broadcast_from_replica_0(self.link, self.weights, self.bucket_bytes)
        else:
            self.sync.round = self.link.done_round = self.link.sent_round = rejoin_round
            self.link.stale_until(rejoin_round)  # (the others' buckets for its lost process)

    def close(self, linger_ms: int = 0) -> None:
        self.link.close(linger_ms)
