"""What a stage is built from, and which executor runs it: the schedule decides.

A :class:`StageSpec` is one stage's part of the model and training setup. It reaches a stage
process pickled at process start (an embedded runner's modules), or the process builds it
itself from importable names (a :class:`StageBuilder`, e.g. a job file's recipe; nothing but
plain data crosses hosts). :func:`make_executor` builds the executor the schedule asks for
(:meth:`pipeq.schedules.SchedulePolicy.executor`): plain backprop's
:class:`~pipeq.stage.executor.StageExecutor` with the run's numerics when it names none, the
tensor-parallel one (:mod:`pipeq.parallel.tensor`) when the stage is sharded. The worker process
and the simulated engine both build theirs here.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeq.stage.numerics import Numerics
from pipeq.schedules.protocol import SchedulePolicy
from pipeq.schedules.registry import resolve
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


def make_executor(schedule: "SchedulePolicy | str", index: int, n_stages: int, spec: StageSpec, device: torch.device,
                  numerics: Numerics | None = None, sharded: bool = False) -> StageExecutor:
    """Stage ``index``'s executor; ``numerics`` (precision, clipping...) apply to plain backprop's
    (the runner refuses them with the other schedules). ``sharded``: the module is split over
    its tensor-parallel shards (plain backprop only: pipeq.parallel.tensor)."""
    if sharded:
        from pipeq.parallel.tensor import ShardedStageExecutor

        return ShardedStageExecutor(index, n_stages, spec, device)
    ex = resolve(schedule).executor(index, n_stages, spec, device)
    if ex is None:
        ex = StageExecutor(index, n_stages, spec, device)
        if numerics is not None:
            ex.set_numerics(numerics)
    return ex
