"""What a stage is built from, and which executor runs it: the schedule decides.

A :class:`StageSpec` is one stage's part of the model and training setup. It reaches a stage
process pickled at process start (an embedded runner's modules), or the process builds it
itself from importable names (a :class:`StageBuilder`, e.g. a job file's recipe; nothing but
plain data crosses hosts). :func:`make_executor` picks the executor the schedule needs:

    fill-drain, 1F1B, your own     StageExecutor      (pipeq.stage)
      ... with tensor_parallel     ShardedStageExecutor (pipeq.tensorpar)
    Interlock(...)                 InterlockExecutor  (auxiliary heads, its own gradient routing)
    AsyncOneFOneB(...)             AsyncExecutor      (a step per microbatch, weight stashing)
    AssociatedLearning(...)        ALExecutor         (local losses only)

The worker process and the simulated engine both build theirs here.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeq.research.al.executor import ALExecutor
from pipeq.research.async1f1b.executor import AsyncExecutor
from pipeq.research.interlock.executor import InterlockExecutor
from pipeq.stage.numerics import Numerics
from pipeq.schedules import AssociatedLearning, AsyncOneFOneB, Interlock
from pipeq.stage.executor import StageExecutor, StageSpec

__all__ = ["StageSpec", "StageBuilder", "make_executor"]


class StageBuilder:
    """Builds a :class:`StageSpec` inside the stage process, instead of receiving a pickle."""

    def build(self, stage: int, n_stages: int) -> StageSpec:
        raise NotImplementedError

    def prepared(self, multi_host: bool = False) -> "StageBuilder":
        """This builder with what must be decided once, in the launching process, decided (a
        job's measured balance): the stage processes are sent the result. ``multi_host``: other
        nodes build from their own copy of the job, so nothing may be decided here alone."""
        return self

    def seed_for(self, stage: int) -> int:
        """The seed of stage ``stage``'s torch RNG (dropout...), the same on every host."""
        return stage

    def describe(self) -> dict[str, Any]:
        """Plain data that two hosts compare to make sure they build the same job."""
        return {}


def make_executor(schedule: Any, index: int, n_stages: int, spec: StageSpec, device: torch.device,
                  numerics: Numerics | None = None, sharded: bool = False) -> StageExecutor:
    """Stage ``index``'s executor; ``numerics`` (precision, clipping...) apply to plain backprop's
    (the runner refuses them with the other schedules). ``sharded``: the module is split over
    its tensor-parallel shards (plain backprop only: pipeq.tensorpar)."""
    if sharded:
        from pipeq.parallel.tensor import ShardedStageExecutor

        return ShardedStageExecutor(index, n_stages, spec, device)
    ex: StageExecutor | None = None
    for kind, executor in ((Interlock, InterlockExecutor), (AssociatedLearning, ALExecutor),
                           (AsyncOneFOneB, AsyncExecutor)):
        if isinstance(schedule, kind):
            ex = executor(index, n_stages, spec, device, schedule)
    if ex is None:
        ex = StageExecutor(index, n_stages, spec, device)
        if numerics is not None:
            ex.set_numerics(numerics)
    return ex
