"""The batches through ``runner.stream`` in segments that end where the run needs a consistent state,
and the run's step of each step number the stages name."""

from __future__ import annotations

import collections
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from pipeq.launch.data import Batches, samples_of
from pipeq.launch.signals import StopSignals

__all__ = ["StepDone", "EpochEnd", "StepNumbers", "train_steps", "segment_end"]


@dataclass
class StepDone:
    """One trained batch, as the stream hands it back."""

    step: int
    epoch: int
    batch: int  # its index in the epoch
    size: int  # samples
    loss: float
    seconds: float  # wall time since the previous loss (see train_steps)
    lr: float | None = None  # the learning rate it trained with (runner.last_step_lr)
    # lr_scheduler_interval "epoch": the last step of an epoch that another follows (that epoch's
    # number); the schedulers step after it, before the next epoch's first batch
    next_epoch: int | None = None
    # fault_tolerance = "replicas": how many replicas completed it, when a replica failed in it
    replicas: int | None = None

    def line(self) -> dict[str, Any]:
        """Its line of metrics.jsonl: step, epoch, loss, samples_per_s, lr (when known), and
        ``replicas`` for a step that fewer replicas than the run's completed."""
        line: dict[str, Any] = {"step": self.step, "epoch": self.epoch, "loss": self.loss,
                                "samples_per_s": self.size / self.seconds if self.seconds > 0 else None}
        if self.lr is not None:
            line["lr"] = self.lr
        if self.replicas is not None:
            line["replicas"] = self.replicas
        return line


@dataclass
class EpochEnd:
    """A resumed run starts at the end of ``epoch`` (its checkpoint was written before the
    schedulers stepped for it): they step before ``next_epoch``'s first batch."""

    epoch: int
    next_epoch: int


class StepNumbers:
    """The run's step of each step a runner's stages name in their errors and heartbeat reports
    (``F(step 3, microbatch 2)``, ``(step 3)``): the runner numbers every step it sends from 1,
    training and predict alike (:attr:`PipelineRunner.steps_sent`), each runner anew (a restart's
    first step is its step 1), while the run counts its training steps from its start. Told where
    each segment of training starts and ends (:func:`train_steps`), it rewrites such a text."""

    _STEP = re.compile(r"\bstep (\d+)\b")

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        # (the runner's steps_sent, the run's step, training?): from there on, up to the next entry
        self._marks: list[tuple[int, int, bool]] = []

    def segment(self, step: int, training: bool = True) -> None:
        """A segment of training starts after the run's step ``step`` (False: it ended at ``step``;
        the steps sent from now on are an evaluation's)."""
        self._marks.append((self.runner.steps_sent, step, training))

    def run_step(self, sent: int) -> int | None:
        """The run's step of the runner's step ``sent`` (None: not a training step this knows of)."""
        for base, step, training in reversed(self._marks):
            if sent > base:
                return step + sent - base if training else None
        return None

    def rewrite(self, text: str) -> str:
        """``text`` with each "step N" of the runner's numbering as the run's."""
        def run(m: re.Match[str]) -> str:
            step = self.run_step(int(m[1]))
            return m[0] if step is None else f"step {step}"
        return self._STEP.sub(run, text)


def train_steps(runner: Any, source: Batches, step: int, total: int | None, every: Sequence[int], by_epoch: bool,
                signals: StopSignals, arrived: Callable[[int], None] | None = None,
                numbers: StepNumbers | None = None) -> Iterator[StepDone | EpochEnd]:
    """Train on ``source`` from step ``step`` on with ``runner.stream``: the pipeline stays
    full across batches, and is drained only at the end of each segment, which ends exactly
    at the next multiple of one of ``every`` (the evaluations, the checkpoints), at the last
    step, and (``by_epoch``) at the end of each epoch that another follows. A segment's last
    step is yielded once that stream is done, so what the caller does then (evaluate, save,
    step the schedulers) sees the state of that step; with ``by_epoch`` it says which epoch
    follows (:attr:`StepDone.next_epoch`). After a stop signal no batch is sent. ``arrived(step)``
    is told each step as its loss comes, before it is yielded (a step is yielded once the next
    one's loss is in, or its segment is done). ``numbers`` is told where each segment starts and ends."""
    while total is None or step < total:
        following = source.next_epoch() if by_epoch and not signals.stopping else None
        if following is not None:  # resumed where an epoch ended
            yield EpochEnd(source.epoch, following)
            source.enter(following)
        end = segment_end(step, total, every)
        taken: collections.deque[tuple[int, int, int]] = collections.deque()
        last: StepDone | None = None
        t = time.perf_counter()
        if numbers is not None:
            numbers.segment(step)
        for loss in runner.stream(_take(source, None if end is None else end - step, taken, signals, by_epoch)):
            now = time.perf_counter()
            epoch, index, size = taken.popleft()  # losses come back in the order batches went
            step += 1
            if arrived is not None:
                arrived(step)
            # The stages work on several batches at once, so a batch has no time of its own:
            # its time is the wall time since the previous loss (a segment's first also covers
            # filling the pipeline), hence samples_per_s = its samples / that time.
            done = StepDone(step, epoch, index, size, loss, now - t, runner.last_step_lr,
                            replicas=getattr(runner, "last_step_replicas", None))
            t = now
            if last is not None:
                yield last
            last = done
        if numbers is not None:
            numbers.segment(step, training=False)
        if last is None:  # no batch: the data ran out, or a signal stopped the run
            return
        if by_epoch and step != total and not signals.stopping:
            last.next_epoch = source.next_epoch()
        yield last
        if last.next_epoch is not None:
            source.enter(last.next_epoch)
        elif step != end:  # the data ran out, or a signal stopped the run
            return


def segment_end(step: int, total: int | None, every: Sequence[int]) -> int | None:
    """The first step after ``step`` that needs a consistent state (a multiple of one of
    ``every``, 0s ignored, or the last step); None: none before the data runs out."""
    ends = [total] if total is not None else []
    ends += [(step // n + 1) * n for n in every if n]
    return min(ends, default=None)


def _take(source: Batches, count: int | None, taken: "collections.deque[tuple[int, int, int]]",
          signals: StopSignals, by_epoch: bool = False) -> Iterator[Any]:
    """The next ``count`` batches of ``source`` (None: all), each noted in ``taken`` as it goes;
    none after a stop signal (the stream then finishes the ones sent, and ends), and
    (``by_epoch``) none of the next epoch."""
    sent = 0
    while not signals.stopping and (count is None or sent < count):
        if by_epoch and source.next_epoch() is not None:
            return
        item = source.take()
        if item is None:
            return
        epoch, index, (x, y) = item
        taken.append((epoch, index, samples_of(x)))
        sent += 1
        yield x, y
