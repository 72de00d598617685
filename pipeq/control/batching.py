"""Sizing microbatches and weighting their losses: what makes a pipelined step equal one
full-batch step.

A batch of n samples becomes ``min(m, n)`` near-equal microbatches (larger ones first); with R
data-parallel replicas it is first split into R shards, each then into microbatches. Each
microbatch's loss is weighted by its share of the *whole* batch's loss denominator, its tokens
or its rows as ``loss_weighting`` says (:func:`pipeq.stage.loss.microbatch_weights`), the
auxiliary heads' losses likewise under their own reduction, so the accumulated (and all-reduced)
gradients are the full batch's::

    batch of 10, m = 4, R = 1:  sizes [3, 3, 2, 2]     weights [0.3, 0.3, 0.2, 0.2] (mean loss, no ignored target)
    batch of 10, m = 2, R = 2:  shards [5 | 5] -> sizes [3, 2 | 3, 2], weights [0.3, 0.2 | 0.3, 0.2]

A batch given as its microbatches (:class:`~pipeq.stage.microbatch.Microbatches`, which may
differ in length and rows) keeps them: K of them, ``K = R * k`` with ``1 <= k <= m`` (replica r
trains on microbatches ``r*k .. r*k + k - 1``), each checked and named on its own.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from pipeq.stage import microbatch
from pipeq import schedules
from pipeq.schedules import SchedulePolicy
from pipeq.runtime.backend import Shard  # one replica's part of a step (what a backend is sent)
from pipeq.stage.loss import microbatch_weights
from pipeq.stage.microbatch import Microbatches
from pipeq.tree import tensors_of


def split_sizes(batch: int, microbatches: int) -> list[int]:
    """Sizes of ``min(microbatches, batch)`` near-equal microbatches (larger ones first)."""
    m = min(microbatches, batch)
    base, rem = divmod(batch, m)
    return [base + 1] * rem + [base] * (m - rem)


def given_batch(x: Any, target: Any, given: Any) -> tuple[Any, Any, Any]:
    """``runner.step``'s ``(x, target, stage_inputs)`` as the rest of the runner takes them: a
    batch given as a list (or :class:`Microbatches`) of ``(x, target)`` pairs or ``(x, target,
    stage_inputs)`` triples, the target left out, becomes x, the target and the stage inputs as
    :class:`Microbatches` each; anything else is as given."""
    if target is not None:
        return x, target, given
    if not isinstance(x, (list, tuple)) or not x or given is not None:
        raise ValueError("step takes (x, target), or a list of microbatches as (x, target) pairs: "
                         f"pipeq.Microbatches([(x0, y0), (x1, y1), ...]); got x ({type(x).__name__}) "
                         + ("and stage_inputs " if given is not None else "") + "without a target")
    for j, item in enumerate(x):
        if not (isinstance(item, (tuple, list)) and len(item) in (2, 3)):
            got = f"{type(item).__name__} of {len(item)}" if isinstance(item, (tuple, list)) else type(item).__name__
            raise ValueError(f"microbatch {j} is a {got}: a batch given as a list of microbatches holds "
                             "(x, target) pairs or (x, target, stage_inputs) triples")
    inputs = [item[2] if len(item) == 3 else None for item in x]
    return (Microbatches(item[0] for item in x), Microbatches(item[1] for item in x),
            Microbatches(inputs) if any(i is not None for i in inputs) else None)


def check_batch(name: str, value: Any) -> tuple[Any, int]:
    """``value`` (a tensor, or a tuple / list / dict of tensors and constants) as CPU tensors,
    and its batch size (ValueError naming the part at fault otherwise)."""
    return microbatch.check(name, value)


class Batcher:
    """Splits a runner's batches into microbatches (and replica shards) and weights their losses.

    A microbatch count the schedule has not been checked for (a batch smaller than m) is
    dry-run first, so a schedule that cannot run it is refused before any stage is told.
    """

    def __init__(self, schedule: SchedulePolicy, n_stages: int, microbatches: int, loss_fn: Callable,
                 aux_loss: Callable | None = None, replicas: int = 1, loss_weighting: str = "token",
                 even: str | None = None) -> None:
        """``even``: why every replica must run as many microbatches (a setting that makes each
        microbatch a collective of the replicas), or None."""
        self.schedule = schedules.resolve(schedule)
        self.even = even
        self.n_stages = n_stages
        self.microbatches = microbatches
        self.loss_fn = loss_fn
        self.aux_loss = aux_loss
        self.replicas = replicas
        self.loss_weighting = loss_weighting
        schedules.build(schedule, n_stages, microbatches)  # refuse a schedule that cannot run
        self._checked = {microbatches}

    def sizes(self, batch: int) -> list[int]:
        sizes = split_sizes(batch, self.microbatches)
        if len(sizes) not in self._checked:
            schedules.build(self.schedule, self.n_stages, len(sizes))
            self._checked.add(len(sizes))
        return sizes

    def given_sizes(self, x: Microbatches, training: bool = True) -> list[int]:
        """The rows of each microbatch of a batch given as its microbatches (checked), their
        count checked against ``microbatches`` (a training batch's: per replica; a prediction
        runs on one)."""
        k, r, m = len(x), self.replicas if training else 1, self.microbatches
        if k % r or not 1 <= k // r <= m:
            held = (f"{k} microbatches, not a multiple of data_parallel={r}" if k % r
                    else f"{k // r} microbatches per replica (data_parallel={r}: {k} in all)" if r > 1
                    else f"{k} microbatches")
            raise ValueError(f"a batch given as Microbatches holds {held}; it must hold 1 to microbatches={m}"
                             + (f" per replica, the same number for each of the {r}" if r > 1 else "")
                             + ": give fewer, or raise the runner's microbatches")
        if k // r not in self._checked:
            schedules.build(self.schedule, self.n_stages, k // r)
            self._checked.add(k // r)
        return [microbatch.rows(v) for v in x]

    def first(self, x: Any, batch: int) -> Any:
        """The first microbatch of the checked batch ``x`` of ``batch`` samples."""
        if isinstance(x, Microbatches):
            return x[0]
        return microbatch.narrow(x, 0, self.sizes(batch)[0])

    def training_pair(self, x: Any, target: Any) -> tuple[Any, Any, int]:
        """``x`` and ``target`` checked (see :mod:`pipeq.stage.microbatch`), and their batch size."""
        if isinstance(x, Microbatches) or isinstance(target, Microbatches):
            return self._split_pair(x, target)
        x, n = check_batch("x", x)
        target, n_target = check_batch("target", target)
        if n != n_target:
            raise ValueError(f"x has {n} samples but target has {n_target}: they must split alike on dim 0")
        self.check_input(x)
        self.schedule.check_target(target)
        if n < self.replicas:
            raise ValueError(f"a batch of {n} samples cannot be split over "
                             f"data_parallel={self.replicas} replicas")
        return x, target, n

    def _split_pair(self, x: Any, target: Any) -> tuple[Microbatches, Microbatches, int]:
        """A batch given as its microbatches: both parts so, as many, each pair alike on dim 0."""
        for name, value in (("x", x), ("target", target)):
            if not isinstance(value, Microbatches):
                other = "target" if name == "x" else "x"
                raise ValueError(f"{other} is a pipeq.Microbatches, but {name} is a {type(value).__name__}: give both "
                                 f"as Microbatches of as many microbatches (or pairs: Microbatches([(x0, y0), ...]))")
        if len(x) != len(target):
            raise ValueError(f"x holds {len(x)} microbatches but target holds {len(target)}: give one target per "
                             "microbatch of x")
        x, _ = check_batch("x", x)
        target, _ = check_batch("target", target)
        for j, (xj, tj) in enumerate(zip(x, target)):
            if microbatch.rows(xj) != microbatch.rows(tj):
                raise ValueError(f"microbatch {j}: x has {microbatch.rows(xj)} samples "
                                 f"({microbatch.describe(tensors_of(xj))}) but its target has "
                                 f"{microbatch.rows(tj)} ({microbatch.describe(tensors_of(tj))}): "
                                 "each microbatch's x and target must split alike on dim 0")
            self.schedule.check_target(tj)
        self.check_input(x)
        return x, target, sum(self.given_sizes(x))

    def check_input(self, x: Any) -> None:
        """Only plain backprop's schedules (fill-drain, 1F1B, zero-bubble, interleaved, DualPipeV, your own)
        take x that is not one tensor."""
        if not isinstance(x, torch.Tensor) and not self.schedule.plain_backprop:
            raise ValueError(
                f"schedule {self.schedule.name!r} takes x as one tensor, got a "
                f"{type(x).__name__}: tuples and dicts of inputs, and batches given as Microbatches, run with the "
                f"backprop schedules (fill-drain, 1F1B, "
                f"the zero-bubble, interleaved and DualPipeV ones, and your own)")

    def shards(self, target: Any, batch: int) -> list[Shard]:
        """Replica r's microbatch sizes and loss weights, relative to the whole batch."""
        if isinstance(target, Microbatches):
            flat, k = self.given_sizes(target), len(target) // self.replicas
            per = [flat[r * k:(r + 1) * k] for r in range(self.replicas)]
        else:
            per = [self.sizes(n) for n in split_sizes(batch, self.replicas)]
            flat = [s for sizes in per for s in sizes]
            if self.even is not None and len({len(sizes) for sizes in per}) > 1:
                raise ValueError(
                    f"{self.even}: the replicas must run as many microbatches each, but a batch of {batch} samples "
                    f"over data_parallel={self.replicas} gives them {[len(sizes) for sizes in per]}: give a batch "
                    f"of at least microbatches x data_parallel = {self.microbatches * self.replicas} samples")
        weights = microbatch_weights(self.loss_fn, target, flat, self.loss_weighting)
        aux = (microbatch_weights(self.aux_loss, target, flat, self.loss_weighting)
               if self.aux_loss is not None else None)
        out: list[Shard] = []
        i = 0
        for sizes in per:
            part = slice(i, i + len(sizes))
            out.append((sizes, weights[part], aux[part] if aux is not None else None))
            i += len(sizes)
        return out
