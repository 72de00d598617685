"""Asynchronous 1F1B's schedule: an optimizer step after every backward, and no drain between batches.

PipeDream (Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN Training",
SOSP 2019), as the data/tensor/pipeline-parallel tutorial this project started from runs it.
Pure: the executor (:mod:`pipeq.research.async1f1b.executor`) is imported when a stage asks.
"""

from __future__ import annotations

import re
from typing import Any

from pipeq.errors import ScheduleError
from pipeq.schedules.actions import STEP, Action, B, F, Schedule
from pipeq.schedules.basic import check_counts
from pipeq.schedules.protocol import SchedulePolicy

__all__ = ["AsyncCursor", "AsyncOneFOneB"]


class AsyncCursor:
    """Where one stage is in an asynchronous 1F1B stream of microbatches (numbered 0, 1, ...
    across batches): ``warmup`` forwards, then one backward (and STEP) and one forward in turn.

    :meth:`take` hands out the next actions, up to the first forward of a microbatch that has not
    been :meth:`add`-ed yet (its batch has not arrived); with ``drain`` it also runs the
    backwards left at the end. A stream is thus one long asynchronous plan over all its
    microbatches, cut into pieces as batches arrive; a step that drains is one batch's plan.
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.commanded = 0  # microbatches whose batch has arrived
        self.next_f = 0
        self.next_b = 0

    def add(self, count: int) -> int:
        """``count`` more microbatches arrived; returns the number of the first."""
        self.commanded += count
        return self.commanded - count

    def take(self, drain: bool = False) -> list[Action]:
        acts: list[Action] = []
        while True:
            ahead = self.next_f - self.next_b  # forwards whose backward is still to come
            if self.next_f < self.commanded and ahead < self.warmup:
                acts.append(F(self.next_f))
                self.next_f += 1
            elif ahead > 0 and (ahead >= self.warmup or drain and self.next_f == self.commanded):
                acts += [B(self.next_b), STEP]
                self.next_b += 1
            else:
                return acts


class AsyncOneFOneB(SchedulePolicy):
    """Asynchronous 1F1B (PipeDream): a step after every backward, and under ``runner.stream``
    no drain between batches.

    Stage 0 runs ``warmup`` (W) forwards before its first backward, stage k < N-1 runs W - k, the
    last stage alternates from its first microbatch (W = N, the default, gives N - k on every
    stage); then each stage alternates one backward (followed by its optimizer step) and one
    forward. ``runner.step`` drains at the end of its batch; ``runner.stream`` keeps going into
    the next batch (:class:`AsyncCursor`). The backward of microbatch j may run after updates
    made since its forward; with ``weight_stashing=True`` (default, PipeDream) it uses the
    weights its forward used, without it the newest ones (see
    :mod:`pipeq.research.async1f1b.executor`)::

        stage 0 | F0 F1 F2 F3 .  .  .  B0 ST F4 B1 ST F5 ...
        stage 3 | .  .  .  F0 B0 ST F1 B1 ST F2 B2 ST ...
    """

    per_microbatch_steps = True  # check_consistency: one STEP after each backward
    plain_backprop = False
    streams_across_batches = True
    option_names = ("warmup", "weight_stashing")

    def __init__(self, warmup: int | None = None, weight_stashing: bool = True) -> None:
        if warmup is not None and (type(warmup) is not int or warmup < 1):
            raise ValueError(f"AsyncOneFOneB(warmup=...) must be a positive integer or None, got {warmup!r}")
        if type(weight_stashing) is not bool:
            raise ValueError(f"AsyncOneFOneB(weight_stashing=...) must be True or False, got {weight_stashing!r}")
        self.warmup = warmup
        self.weight_stashing = weight_stashing

    @property
    def name(self) -> str:  # type: ignore[override]
        """"async", or "async(warmup=W)" (in traces, and ``pipeq report`` rebuilds the plan from it)."""
        return "async" if self.warmup is None else f"async(warmup={self.warmup})"

    @classmethod
    def from_label(cls, label: str) -> "AsyncOneFOneB | None":
        m = re.fullmatch(r"async\(warmup=(\d+)\)", label)
        if m:
            return cls(warmup=int(m.group(1)))
        return cls() if label == "async" else None

    def warmup_of(self, stage: int, n_stages: int) -> int:
        """How many forwards stage ``stage`` runs before its first backward."""
        w = n_stages if self.warmup is None else self.warmup
        if w < n_stages - 1:
            raise ScheduleError(f"AsyncOneFOneB(warmup={w}) with {n_stages} stages would deadlock: stage "
                                f"{n_stages - 2} needs at least one forward ahead; use warmup >= {n_stages - 1}")
        return 1 if stage == n_stages - 1 else w - stage

    def plan(self, n_stages: int, n_microbatches: int) -> Schedule:
        check_counts(n_stages, n_microbatches)
        out = []
        for k in range(n_stages):
            cursor = AsyncCursor(self.warmup_of(k, n_stages))
            cursor.add(n_microbatches)
            out.append(cursor.take(drain=True))
        return out

    @property
    def options(self) -> dict[str, int | bool | None]:
        return {"warmup": self.warmup, "weight_stashing": self.weight_stashing}

    def with_options(self, **options: Any) -> "AsyncOneFOneB":
        return AsyncOneFOneB(**options) if options else self

    def cursor(self, stage: int, n_stages: int) -> AsyncCursor:
        return AsyncCursor(self.warmup_of(stage, n_stages))

    def executor(self, index: int, n_stages: int, spec: Any, device: Any) -> Any:
        from pipeq.research.async1f1b.executor import AsyncExecutor

        return AsyncExecutor(index, n_stages, spec, device, self)
