"""Which executor runs a stage: the schedule decides.

A stage is built from a :class:`~pipeq.stage.spec.StageSpec` (or a
:class:`~pipeq.stage.spec.StageBuilder` makes one in the stage process; both are importable
from here too). :func:`make_executor` picks the executor the schedule needs:

    fill-drain, 1F1B, your own     StageExecutor      (pipeq.stage.executor)
      ... with tensor_parallel     ShardedStageExecutor (pipeq.parallel.tensor)
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
from pipeq.schedules import AssociatedLearning, AsyncOneFOneB, Interlock
from pipeq.stage.executor import StageExecutor
from pipeq.stage.numerics import Numerics
from pipeq.stage.spec import StageBuilder, StageSpec

__all__ = ["StageSpec", "StageBuilder", "make_executor"]


def make_executor(schedule: Any, index: int, n_stages: int, spec: StageSpec, device: torch.device,
                  numerics: Numerics | None = None, sharded: bool = False) -> StageExecutor:
    """Stage ``index``'s executor; ``numerics`` (precision, clipping...) apply to plain backprop's
    (the runner refuses them with the other schedules). ``sharded``: the module is split over
    its tensor-parallel shards (plain backprop only: pipeq.parallel.tensor)."""
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
