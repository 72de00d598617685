"""Data parallelism beside the pipeline: the replicas' gradients summed with torch's collectives.

Every replica runs its own share of the batch through its own pipeline; each microbatch's loss is
weighted by its share of the *whole* batch, so the sum of the replicas' gradients is the full
batch's. A stage's copies in the replicate slices (:mod:`pipeq.parallel.mesh`) sum theirs with a
ring all-reduce of torch's (gloo on the CPU, NCCL on CUDA: the buckets never leave the device),
in flat buckets of at most :data:`BUCKET_BYTES`: :class:`GradSync`. A bucket is issued as soon as
the step's last backward has made its gradients final (a hook on each parameter's gradient
accumulation, armed for that backward only), overlapped with the rest of the backward, the
stage's last sends and the other stages' work; the optimizer step waits for them all. A sharded
stage (FSDP2) reduce-scatters first, over its slice, and the replicate slices then all-reduce
their pieces (HSDP), as torch's own HSDP does.

At start (the driver's PEERS) the replicate group is made and slice 0's parameters and buffers
are broadcast to the others (:func:`broadcast_weights`): replicas never start apart.

With ``fault_tolerance="replicas"`` a replica may be lost mid-step: the group is rebuilt without
its slice and the survivors agree on each round's sum (:mod:`pipeq.parallel.membership`); a
sum made without some replicas is scaled by :func:`survivor_scale`, the whole batch's loss weight
over the weight of the replicas summed, so that it is the gradient of the mean loss over their
samples.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from pipeq.stage.memory import local
from pipeq.stage.transfer import pinned_copies

__all__ = ["BUCKET_BYTES", "FlatLayout", "to_host", "survivor_scale", "GradSync", "broadcast_weights", "Replicas",
           "rejoin_tag", "laid_out"]

BUCKET_BYTES = 25 << 20


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
            hint = "do both hold the same tied weights?"
            raise RuntimeError(f"{sender_is} {sender} sent {what} bucket {b} as [{desc}], expected one flat "
                               f"{self.dtypes[b]} tensor of {self.numels[b]} elements: {hint}")
        return got[0]


def to_host(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` on the CPU, ready to send (tied weights' exchange): a CUDA tensor goes through pinned memory."""
    if flat.device.type == "cpu":
        return flat
    if flat.device.type == "cuda" and torch.cuda.is_available():
        return pinned_copies([flat], flat.device)[0]
    return flat.to("cpu")


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




def laid_out(p: torch.Tensor) -> None:
    """``p``'s gradient laid out as ``p`` is (tensor parallelism): DTensor's backward may leave one
    otherwise (an embedding split by rows gets a replicated gradient), and what follows (the
    replicas' sums, tied weights, norms, the optimizer) works on each process's piece of ``p``."""
    g = p.grad
    if g is not None and hasattr(p, "placements") and hasattr(g, "placements") and \
            tuple(g.placements) != tuple(p.placements):
        p.grad = g.redistribute(p.device_mesh, p.placements)  # type: ignore[attr-defined]


class _Grads:
    """``params[i]``'s gradient piece, as :meth:`FlatLayout.gather` reads ``tensors[i]``."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = params

    def __getitem__(self, i: int) -> torch.Tensor:
        return local(self.params[i].grad)  # type: ignore[arg-type]


class GradSync:
    """Sums the parameters' gradients over the replicate slices, in buckets, without blocking.

    ``group``: the stage's :class:`~pipeq.parallel.mesh.ReplicaGroup`; ``rounds``: with
    ``fault_tolerance="replicas"``, the :class:`~pipeq.parallel.membership.Membership` that says
    who is summed each round (None: every replica, always); ``replicas``: R, the batch's replicas,
    ``shard_size`` of them in each replicate slice (the group's members are slices). Each :meth:`start` / :meth:`finish` is one round, numbered
    from 1 alike on every replica. ``hooks``: issue each bucket as the step's last backward makes
    its gradients final (off for a sharded stage, whose pieces are final only after its
    reduce-scatter)."""

    def __init__(self, params: Sequence[torch.Tensor], group: Any, replicas: int, shard_size: int = 1,
                 rounds: Any = None, bucket_bytes: int = BUCKET_BYTES, hooks: bool = True) -> None:
        self.params = list(params)
        self.group, self.rounds, self.replicas, self.shard_size = group, rounds, replicas, shard_size
        self.layout = FlatLayout([local(p) for p in self.params], bucket_bytes)
        self.round = 0
        self.started = False
        self.armed = False
        self._flat: list[torch.Tensor | None] = [None] * len(self.layout)
        self._works: list[Any] = [None] * len(self.layout)
        self._members: list[int] = []  # the group's members when this round's buckets were issued
        self._bucket_of: list[list[int]] = [[] for _ in self.params]
        self._params_of: list[list[int]] = []  # per bucket, the parameters it holds (a piece of)
        for b, pieces in enumerate(self.layout.pieces):
            self._params_of.append(sorted({i for i, _, _ in pieces}))
            for i, _, _ in pieces:
                if b not in self._bucket_of[i]:
                    self._bucket_of[i].append(b)
        self._waiting: list[set[int]] = []
        self.shares: list[list[float]] = []  # fault_tolerance="replicas": the coming rounds' replica shares (TRAIN's)
        self.round_shares: list[float] | None = None
        self.summed: list[int] = list(range(replicas))  # the replicas the last round summed
        self.layout_bytes = sum(n * torch.empty((), dtype=d).element_size()
                                for n, d in zip(self.layout.numels, self.layout.dtypes))
        if hooks:
            for i, p in enumerate(self.params):
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda _p, i=i: self._final(i))

    # -- a round ----------------------------------------------------------------------------------
    def _begin(self) -> None:
        """Start round ``round + 1`` (once): its shares, and its group (a lost replica's left behind)."""
        if self.started:
            return
        self.round += 1
        self.started = True
        self.round_shares = self.shares.pop(0) if self.shares else None
        if self.rounds is not None:
            self.rounds.before_round(self.round)
        self._members = list(self.group.members)
        self._waiting = [{i for i, _, _ in pieces} for pieces in self.layout.pieces]

    def arm(self) -> None:
        """Before the step's last backward: issue each bucket once its gradients are final."""
        self._begin()
        self.armed = True

    def _final(self, i: int) -> None:
        """(A hook.) Parameter ``i``'s gradient is final if the step's last backward is running."""
        if not self.armed:
            return
        for b in self._bucket_of[i]:
            waiting = self._waiting[b]
            waiting.discard(i)
            if not waiting and self._works[b] is None and self._flat[b] is None:
                self._issue(b)

    def _issue(self, b: int) -> None:
        for i in self._params_of[b]:
            laid_out(self.params[i])
        flat = self.layout.gather(b, _Grads(self.params))
        self._flat[b] = flat
        self._works[b] = self.group.all_reduce(flat)

    def start(self) -> None:
        """After the step's last backward: issue every bucket not issued yet."""
        self._begin()
        self.armed = False
        for p in self.params:  # a parameter this replica did not use still takes part (zeros)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for b in range(len(self.layout)):
            if self._flat[b] is None:
                self._issue(b)
        if self.rounds is not None:
            self.rounds.sent_round = self.round

    def finish(self) -> None:
        """Before the optimizer step: wait for the sums, scale them if replicas were left out, put
        them back into the gradients."""
        self.start()
        while True:
            try:
                self.group.finish(self._works, f"the gradients' all-reduce (round {self.round})")
                ok = True
            except Exception as exc:
                from pipeq.parallel.mesh import CollectiveError

                if not isinstance(exc, CollectiveError) or self.rounds is None:
                    raise
                ok = False
            if self.rounds is None or self.rounds.settle(self.round, ok, self._members) == "keep":
                break
            self._members = list(self.group.members)  # redo the round on the group rebuilt without the lost
            self._flat = [None] * len(self.layout)
            for b in range(len(self.layout)):
                self._issue(b)
        s = self.shard_size
        self.summed = sorted(r for m in self._members for r in range(m * s, (m + 1) * s))
        scale = survivor_scale(self.round_shares, self.summed, self.replicas)
        with torch.no_grad():
            grads = _Grads(self.params)
            for b, flat in enumerate(self._flat):
                assert flat is not None
                if scale != 1.0:
                    flat.mul_(scale)
                self.layout.scatter(b, flat, grads)  # type: ignore[arg-type]
        self._flat = [None] * len(self.layout)
        self._works = [None] * len(self.layout)
        self.started = False
        if self.rounds is not None:
            self.rounds.round_done(self.round, self.summed)


def broadcast_weights(group: Any, tensors: Sequence[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> None:
    """Slice 0's ``tensors`` (its parameters' and buffers' pieces) to every other slice, in place."""
    if group is None or group.backend is None:
        return
    with torch.no_grad():
        tensors = [local(t.detach()) for t in tensors]
        layout = FlatLayout(tensors, bucket_bytes)
        for b in range(len(layout)):
            flat = layout.gather(b, tensors)
            group.finish([group.broadcast(flat, 0)], "replica 0's weights")
            if group.me != 0:
                layout.scatter(b, flat, tensors)


class Replicas:
    """A stage's place among its replicate slices: its ``group``, the :class:`GradSync` its
    executor's reductions call, and with ``fault_tolerance="replicas"`` its ``rounds``
    (:class:`~pipeq.parallel.membership.Membership`). ``weights``: its parameters and buffers,
    which slice 0's replace at start."""

    def __init__(self, group: Any, sync: GradSync, rounds: Any, weights: Sequence[torch.Tensor], slice_: int,
                 slices: int) -> None:
        self.group, self.sync, self.rounds, self.weights = group, sync, rounds, list(weights)
        self.slice, self.slices = slice_, slices

    def join(self, rejoin_round: int | None = None) -> None:
        """Make the group of every slice (the driver's PEERS) and start from slice 0's weights; a
        rebuilt replica (``rejoin_round``: the rounds the others have made) gets no weights (the
        driver restores a healthy replica's state into it) and counts rounds on from there."""
        if rejoin_round is None:
            self.group.form(range(self.slices), "start")
            broadcast_weights(self.group, self.weights)
            return
        self.group.form(range(self.slices), rejoin_tag(self.slice, rejoin_round))
        self.sync.round = rejoin_round
        if self.rounds is not None:
            self.rounds.done_round = self.rounds.sent_round = rejoin_round


def rejoin_tag(slice_: int, after_round: int) -> str:
    """The name of the group that slice ``slice_`` rebuilt after round ``after_round`` meets in."""
    return f"rejoin{slice_}@{after_round}"
