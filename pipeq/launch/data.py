"""The job's data as the training loop takes it: batches with their epochs, the run's length, batch sizes."""

from __future__ import annotations

import collections.abc
import itertools
from typing import Any, Iterator

import torch

from pipeq.launch.job import Job

__all__ = ["Batches", "EpochLosses", "DataError", "job_batches", "check_first_batch", "total_steps", "samples_of"]


class DataError(ValueError):
    """The job's data yields something other than (x, target) pairs (said in one line, no traceback)."""


class Batches:
    """The job's batches in order, as (epoch, index in it, batch) triples, with a look at the next
    one: an epoch ends where the next triple belongs to another epoch."""

    def __init__(self, items: Iterator[tuple[int, int, Any]], epoch: int) -> None:
        self._items = items
        self._next: tuple[int, int, Any] | None = None
        self._peeked = False
        self.epoch = epoch  # the epoch under way: the last triple's (at first, the resumed one)

    def peek(self) -> tuple[int, int, Any] | None:
        """The next triple, left there (None: the data is done)."""
        if not self._peeked:
            self._next = next(self._items, None)
            self._peeked = True
        return self._next

    def take(self) -> tuple[int, int, Any] | None:
        """The next triple, taken: its epoch is under way (None: the data is done)."""
        item = self.peek()
        self._next, self._peeked = None, False
        if item is not None:
            self.epoch = item[0]
        return item

    def next_epoch(self) -> int | None:
        """The epoch whose first batch comes next, when the one under way is done (None: it goes
        on, or the data is done)."""
        item = self.peek()
        return item[0] if item is not None and item[0] != self.epoch else None

    def enter(self, epoch: int) -> None:
        """The schedulers stepped for the epoch under way: ``epoch`` is under way now."""
        self.epoch = epoch


class EpochLosses:
    """The step losses of the epoch under way: its ``train_loss`` (their mean), which a
    ReduceLROnPlateau may monitor. A resumed run starts from the ones metrics.jsonl holds."""

    def __init__(self, epoch: int, losses: list[float]) -> None:
        self.epoch = epoch
        self.losses = list(losses)

    def add(self, epoch: int, loss: float) -> None:
        """A step of ``epoch`` trained with ``loss`` (a new epoch starts a new list)."""
        if epoch != self.epoch:
            self.epoch, self.losses = epoch, []
        self.losses.append(loss)

    def mean(self, epoch: int) -> float:
        """``epoch``'s train_loss: the mean of its step losses."""
        if epoch != self.epoch or not self.losses:
            raise ValueError(f"lr_scheduler_monitor = 'train_loss': no step loss of epoch {epoch + 1} to average")
        return sum(self.losses) / len(self.losses)


def job_batches(job: Job, epoch: int, skip: int) -> Iterator[tuple[int, int, Any]]:
    """(epoch, index in epoch, batch), from ``epoch`` with its first ``skip`` batches skipped."""
    for e in itertools.count(epoch):
        if job.epochs is not None and e >= job.epochs:
            return
        empty = True
        for i, item in enumerate(job.batches(e)):
            empty = False
            if e == epoch and i < skip:
                continue
            _check_pair(job, item, e, i)
            yield e, i, item
        if empty:
            return


def _check_pair(job: Job, item: Any, epoch: int, index: int) -> None:
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        third = (" (pipeq launch takes no stage_inputs: train with runner.stream((x, target, stage_inputs) "
                 "...) for those)" if isinstance(item, (tuple, list)) and len(item) == 3 else "")
        raise DataError(f"data = {job.data!r} must yield (x, target) pairs, got {type(item).__name__}{third} "
                        f"(epoch {epoch + 1}, batch {index})")


def check_first_batch(job: Job) -> None:
    """The first batch of the job's data, checked before any stage starts when the data is a
    sequence (a list: its first item is there to look at); a generator's is checked as it comes."""
    batches = job.batches(0)
    if isinstance(batches, collections.abc.Sequence) and len(batches) > 0:
        _check_pair(job, batches[0], 0, 0)


def total_steps(job: Job) -> int | None:
    """The steps the job trains: its steps, or its epochs' batches (None: the data's generator
    ends it)."""
    if job.steps is not None:
        return job.steps
    try:
        per_epoch = len(job.batches(0))  # type: ignore[arg-type]
    except TypeError:
        return None  # a generator: the epochs end it
    return per_epoch * (job.epochs or 1)


def samples_of(x: Any) -> int:
    """The samples of a batch's x: dim 0 of a tensor, or of the first tensor of a tuple / dict, or
    of each microbatch of a ``pipeq.Microbatches`` (a batch that is not one the runner checks and
    refuses, naming what is wrong)."""
    from pipeq.stage.microbatch import Microbatches
    from pipeq.tree import tensors_of

    if isinstance(x, Microbatches):  # a batch given as its microbatches: theirs together
        return sum(samples_of(v) for v in x)
    tensors = [x] if isinstance(x, torch.Tensor) else tensors_of(x) if isinstance(x, (tuple, list, dict)) else []
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() > 0 else 0
