"""The training steps in flight: sent ahead while the stages work on the ones before, losses handed back in order.

:class:`InFlight` is the runner's collaborator for what happens to a training step once the
runner has split its batch: it sends the step to the backend without waiting
(:meth:`~pipeq.runtime.backend.Backend.submit`), hands the losses back in the order they were
sent (noting the learning rate each step trained with and, with ``fault_tolerance="replicas"``,
the replicas that completed it), settles every step still in flight before anything that needs a
consistent state, and runs :meth:`PipelineRunner.stream`'s loop, which keeps up to ``in_flight``
batches sent ahead.
"""

from __future__ import annotations

import collections
import itertools
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from pipeq.control.exclusive import CallGuard, answer_first
from pipeq.control.stage_inputs import batch_item
from pipeq.errors import PipelineError

if TYPE_CHECKING:
    from pipeq.control.degraded import DegradedSteps
    from pipeq.control.feed import TrainingStep
    from pipeq.control.snapshots import SnapshotSchedule
    from pipeq.runtime.backend import Backend
    from pipeq.schedules import SchedulePolicy

__all__ = ["InFlight", "depth", "peek"]


def peek(batches: Iterable[Any]) -> tuple[Any, Iterable[Any]]:
    """The first of ``batches`` (None: there is none), and every batch again, that one included."""
    rest = iter(batches)
    first = next(rest, None)
    return first, rest if first is None else itertools.chain([first], rest)


def depth(in_flight: int | None, n_stages: int, microbatches: int, queue_capacity: int) -> int:
    """How many batches a stream sends ahead: ``in_flight`` checked against the stages' queues, or
    by default one more than the stages (enough to keep every stage busy)."""
    if in_flight is None:
        return max(1, min(n_stages + 1, queue_capacity // microbatches))
    if type(in_flight) is not int or in_flight < 1:
        raise ValueError(f"in_flight must be a positive integer, got {in_flight!r}")
    if in_flight * microbatches > queue_capacity:
        raise ValueError(
            f"in_flight={in_flight} batches of {microbatches} microbatches can put "
            f"{in_flight * microbatches} messages in a stage's queue, over queue_capacity="
            f"{queue_capacity}: lower in_flight or raise the runner's queue_capacity")
    return in_flight


class InFlight:
    """The training steps a runner has sent and not yet handed back, and what the handed-back ones
    trained with. ``snapshots`` is told of every step sent and every stream drained; ``guard`` is
    the runner's, held while a stream runs (not while its caller has a loss)."""

    def __init__(self, guard: CallGuard, snapshots: SnapshotSchedule) -> None:
        self.guard = guard
        self.snapshots = snapshots
        #: the runner's backend, once it exists (``schedule="auto"``: once the first batch settled it)
        self.backend: Backend | None = None
        self._across = False  # the schedule leaves work between a stream's batches (asynchronous 1F1B)
        self._replicas: DegradedSteps | None = None  # the backend's record of the degraded steps
        self._handed_as: dict[int, int] = {}  # the last steps handed back -> their count from 1
        self._submitted: collections.deque[int] = collections.deque()  # steps whose loss is not back
        self._losses: dict[int, float] = {}  # losses collected early (settle), not yet handed out
        self._undrained = False  # a stream left work behind (see settle)
        #: the learning rate the last step handed back trained with (None: none yet, or no optimizer)
        self.last_lr: float | None = None
        #: how many replicas completed the last step handed back, when fewer than all
        self.last_replicas: int | None = None
        #: the steps handed back that some replica did not complete, by their count from 1
        self.degraded: dict[int, int] = {}
        #: the same steps -> stage -> the replicas that stage summed, for each stage that summed fewer
        self.degraded_stages: dict[int, dict[int, list[int]]] = {}
        self._handed = 0  # training steps handed back

    def attach(self, backend: Backend, schedule: SchedulePolicy, replicas: DegradedSteps | None) -> None:
        """Send through ``backend``, which runs ``schedule``; ``replicas``: the backend's record of
        the steps some replica did not complete (process mode's ``degraded``), None without one."""
        self.backend = backend
        self._across = schedule.streams_across_batches
        self._replicas = replicas

    def sweep(self) -> None:
        """Take the backend's record of the degraded steps handed back (one may be degraded after
        it was handed back: the step before a replica's loss, at its first stages)."""
        if self._replicas is None:
            return
        stages = self._replicas.stages()
        for step, row in stages.items():
            handed = self._handed_as.get(step)
            if handed is not None:
                self.degraded[handed] = min(len(s) for s in row.values())
                self.degraded_stages[handed] = row

    def _backend(self) -> Backend:
        if self.backend is None:
            raise PipelineError("the pipeline is not running; use 'with runner:' or runner.start()")
        return self.backend

    def send(self, step: TrainingStep, stream: bool) -> int:
        """Send a training step (see :meth:`~pipeq.runtime.backend.Backend.submit`), its number
        back; never waits."""
        self._backend().submit(step.step, step.shards, step.x, step.target, stream, step.inputs)
        self._submitted.append(step.step)
        across = stream and self._across
        self.snapshots.sent(whole=not across)
        self._undrained |= across
        return step.step

    def hand_out(self, step: int) -> float:
        """Step ``step``'s loss (waiting for it), noting the learning rate it trained with and the
        replicas that completed it."""
        backend = self._backend()
        if step in self._losses:
            loss = self._losses.pop(step)
        else:
            self._submitted.remove(step)
            loss = backend.result(step)
        self.last_lr = backend.step_lrs.pop(step, None)
        self._handed += 1
        self._handed_as[step] = self._handed
        if len(self._handed_as) > 64:  # (a late record names one of the last few steps)
            del self._handed_as[next(iter(self._handed_as))]
        self.sweep()
        self.last_replicas = self.degraded.get(self._handed)
        return loss

    def settle(self) -> None:
        """Wait until every step sent so far is done (their losses are kept for their stream),
        and drain what a stream left (asynchronous 1F1B's last backwards)."""
        while self._submitted:
            step = self._submitted.popleft()
            self._losses[step] = self._backend().result(step)
        if self._undrained:
            self._undrained = False
            self._backend().drain()
            self.snapshots.drained()

    def stream(self, batches: Iterator[Any], in_flight: int, submit: Callable[..., int],
               running: Callable[[], bool]) -> Iterator[float]:
        """Each batch's loss, in order, with up to ``in_flight`` batches sent ahead: ``submit(x,
        target, stage_inputs, stream=True)`` sends one and returns its step. Closed early (or the
        data raising), the batches already sent are finished first while the runner is ``running``."""
        mine: collections.deque[int] = collections.deque()
        exhausted = False
        try:
            while True:
                with self.guard.held("stream"):
                    while not exhausted and len(mine) < in_flight and not self._backend().failing:
                        try:
                            item = next(batches)
                        except StopIteration:
                            exhausted = True
                            break
                        mine.append(submit(*batch_item(item, "stream"), stream=True))
                    if not mine:
                        break
                    loss = self.hand_out(mine.popleft())
                yield loss
        except BaseException as exc:
            # closed early (break), or the data raised: the batches already sent are finished, so
            # the runner is consistent again. A pipeline failure has already stopped everything;
            # Ctrl-C does not wait for them either (anything needing a consistent state still does).
            if not isinstance(exc, (PipelineError, KeyboardInterrupt)) and running():
                with self.guard.held("stream"):
                    self.settle()
            if isinstance(exc, PipelineError):
                raise answer_first(exc)
            raise
        with self.guard.held("stream"):
            self.settle()  # the end of the batches: drained once
