"""The runner's stream: batches sent ahead while the stages work on the ones before, losses handed back in order."""

from __future__ import annotations

import collections
from typing import Any, Iterable, Iterator

from pipeq.control.exclusive import CallGuard, answer_first, exclusive
from pipeq.control.stage_inputs import batch_item
from pipeq.errors import PipelineError

__all__ = ["RunnerStream"]


class RunnerStream:
    """``stream`` and the bookkeeping of the steps in flight (mixed into the runner, which sends
    each batch with ``_submit``)."""

    _backend: Any
    _running: bool
    _queue_capacity: int
    _submitted: "collections.deque[int]"  # steps whose loss is not back
    _losses: dict[int, float]  # losses collected early (settle), not yet handed out
    _undrained: bool  # a stream left work behind (see _settle)
    _last_step_lr: float | None
    _guard: CallGuard  # one thread at a time, each time the stream is resumed too
    n_stages: int
    microbatches: int

    def _require_running(self) -> None:
        raise NotImplementedError

    def _submit(self, x: Any, target: Any, given: Any = None, stream: bool = False) -> int:
        raise NotImplementedError

    @exclusive
    def stream(self, batches: Iterable[tuple[Any, ...]], *, in_flight: int | None = None) -> Iterator[float]:
        """Train on every ``(x, target)`` of ``batches`` (any iterable; a DataLoader works), or
        ``(x, target, stage_inputs)`` (see :meth:`step`), and yield each batch's loss, in order,
        while the stages work on the batches behind it.

        The pipeline is filled once and drained once: at the end of ``batches``, when the
        iterator is closed (``break``: the batches already taken are finished first), and
        before anything that needs a consistent state (``step``, ``predict``, ``state_dict``,
        ``save``...). Every stage runs its batches in order, starting the next as soon as its
        own work and update for the previous one are done, so the losses and weights are those
        of ``[runner.step(x, y) for x, y in batches]``. At most ``in_flight`` batches are sent
        ahead (default: one more than the stages, enough to keep every stage busy), so memory
        stays bounded for an endless iterable.
        """
        batches = self._before_stream(batches)
        self._require_running()
        if in_flight is None:
            in_flight = max(1, min(self.n_stages + 1, self._queue_capacity // self.microbatches))
        elif type(in_flight) is not int or in_flight < 1:
            raise ValueError(f"in_flight must be a positive integer, got {in_flight!r}")
        elif in_flight * self.microbatches > self._queue_capacity:
            raise ValueError(
                f"in_flight={in_flight} batches of {self.microbatches} microbatches can put "
                f"{in_flight * self.microbatches} messages in a stage's queue, over queue_capacity="
                f"{self._queue_capacity}: lower in_flight or raise the runner's queue_capacity")
        return self._stream(iter(batches), in_flight)

    def _before_stream(self, batches: Iterable[tuple[Any, ...]]) -> Iterable[tuple[Any, ...]]:
        """What the runner needs of the batches before a stream starts (``schedule="auto"``: the first)."""
        return batches

    def _stream(self, batches: Iterator[tuple[Any, ...]], in_flight: int) -> Iterator[float]:
        mine: collections.deque[int] = collections.deque()
        exhausted = False
        guard = self._guard  # held while the stream runs, not while the caller has its loss
        try:
            while True:
                with guard.held("stream"):
                    while not exhausted and len(mine) < in_flight and not self._backend.failing:
                        try:
                            item = next(batches)
                        except StopIteration:
                            exhausted = True
                            break
                        mine.append(self._submit(*batch_item(item, "stream"), stream=True))
                    if not mine:
                        break
                    loss = self._hand_out(mine.popleft())
                yield loss
        except BaseException as exc:
            # closed early (break), or the data raised: the batches already sent are finished, so
            # the runner is consistent again. A pipeline failure has already stopped everything;
            # Ctrl-C does not wait for them either (anything needing a consistent state still does).
            if not isinstance(exc, (PipelineError, KeyboardInterrupt)) and self._running:
                with guard.held("stream"):
                    self._settle()
            if isinstance(exc, PipelineError):
                raise answer_first(exc)
            raise
        with guard.held("stream"):
            self._settle()  # the end of the batches: drained once

    def _result(self, step: int) -> float:
        if step in self._losses:
            return self._losses.pop(step)
        self._submitted.remove(step)
        return self._backend.result(step)

    def _hand_out(self, step: int) -> float:
        """Step ``step``'s loss, noting the learning rate it trained with (:attr:`last_step_lr`)
        and the replicas that completed it (:attr:`degraded_steps`)."""
        loss = self._result(step)
        self._last_step_lr = self._backend.step_lrs.pop(step, None)
        self._trained = getattr(self, "_trained", 0) + 1
        replicas = getattr(self._backend, "degraded", {}).pop(step, None)
        self._last_step_replicas = replicas
        if replicas is not None:
            self._degraded_steps = {**getattr(self, "_degraded_steps", {}), self._trained: replicas}
        return loss

    @property
    def degraded_steps(self) -> dict[int, int]:
        """``fault_tolerance="replicas"``: the training steps some replica did not complete (it
        failed), each with how many replicas did, e.g. ``{5: 1}``. Steps count from 1, in the
        order this runner handed their losses back (``step`` calls and stream batches alike)."""
        return dict(getattr(self, "_degraded_steps", {}))

    @property
    def last_step_replicas(self) -> int | None:
        """How many replicas completed the last step handed back, when fewer than all (a replica
        failed in it, ``fault_tolerance="replicas"``); None when every replica did."""
        return getattr(self, "_last_step_replicas", None)

    @property
    def replica_failures(self) -> list[PipelineError]:
        """``fault_tolerance="replicas"``: the failures the run carried on after, in order (each
        names the stage and replica; the replica was rebuilt)."""
        loss = getattr(self._backend, "replica_loss", None)  # (process mode's)
        return list(loss.failures) if loss is not None else []

    def _settle(self) -> None:
        """Wait until every step sent so far is done (their losses are kept for their stream),
        and drain what a stream left (asynchronous 1F1B's last backwards)."""
        while self._submitted:
            step = self._submitted.popleft()
            self._losses[step] = self._backend.result(step)
        if self._undrained:
            self._undrained = False
            self._backend.drain()
            self._snapshot_after_drain()  # type: ignore[attr-defined]  # (RunnerSnapshots)
