"""Sizing microbatches and weighting their losses: what makes a pipelined step equal one
full-batch step.

A batch of n samples becomes ``min(m, n)`` near-equal microbatches (larger ones first); with R
data-parallel replicas it is first split into R shards, each then into microbatches. Each
microbatch's loss is weighted by its share of the *whole* batch's loss denominator
(:func:`pipeq.stage.loss.microbatch_weights`), the auxiliary heads' losses likewise under their own
reduction, so the accumulated (and all-reduced) gradients are the full batch's::

    batch of 10, m = 4, R = 1:  sizes [3, 3, 2, 2]     weights [0.3, 0.3, 0.2, 0.2] (mean loss)
    batch of 10, m = 2, R = 2:  shards [5 | 5] -> sizes [3, 2 | 3, 2], weights [0.3, 0.2 | 0.3, 0.2]
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from pipeq.stage import microbatch
from pipeq import schedules
from pipeq.schedules import SchedulePolicy
from pipeq.runtime.backend import Shard  # one replica's part of a step (what a backend is sent)
from pipeq.stage.loss import microbatch_weights


def split_sizes(batch: int, microbatches: int) -> list[int]:
    """Sizes of ``min(microbatches, batch)`` near-equal microbatches (larger ones first)."""
    m = min(microbatches, batch)
    base, rem = divmod(batch, m)
    return [base + 1] * rem + [base] * (m - rem)


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
                 aux_loss: Callable | None = None, replicas: int = 1) -> None:
        self.schedule = schedules.resolve(schedule)
        self.n_stages = n_stages
        self.microbatches = microbatches
        self.loss_fn = loss_fn
        self.aux_loss = aux_loss
        self.replicas = replicas
        schedules.build(schedule, n_stages, microbatches)  # refuse a schedule that cannot run
        self._checked = {microbatches}

    def sizes(self, batch: int) -> list[int]:
        sizes = split_sizes(batch, self.microbatches)
        if len(sizes) not in self._checked:
            schedules.build(self.schedule, self.n_stages, len(sizes))
            self._checked.add(len(sizes))
        return sizes

    def training_pair(self, x: Any, target: Any) -> tuple[Any, Any, int]:
        """``x`` and ``target`` checked (see :mod:`pipeq.stage.microbatch`), and their batch size."""
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

    def check_input(self, x: Any) -> None:
        """Only plain backprop's schedules (fill-drain, 1F1B, zero-bubble, interleaved, DualPipeV, your own)
        take x that is not one tensor."""
        if not isinstance(x, torch.Tensor) and not self.schedule.plain_backprop:
            raise ValueError(
                f"schedule {self.schedule.name!r} takes x as one tensor, got a "
                f"{type(x).__name__}: tuples and dicts of inputs run with the backprop schedules (fill-drain, 1F1B, "
                f"the zero-bubble, interleaved and DualPipeV ones, and your own)")

    def shards(self, target: Any, batch: int) -> list[Shard]:
        """Replica r's microbatch sizes and loss weights, relative to the whole batch."""
        per = [self.sizes(n) for n in split_sizes(batch, self.replicas)]
        flat = [s for sizes in per for s in sizes]
        weights = microbatch_weights(self.loss_fn, target, flat)
        aux = microbatch_weights(self.aux_loss, target, flat) if self.aux_loss is not None else None
        out: list[Shard] = []
        i = 0
        for sizes in per:
            part = slice(i, i + len(sizes))
            out.append((sizes, weights[part], aux[part] if aux is not None else None))
            i += len(sizes)
        return out
