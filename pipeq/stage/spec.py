"""What a stage is built from: a :class:`StageSpec`, or the :class:`StageBuilder` that makes one.

A :class:`StageSpec` is one stage's part of the model and training setup. It reaches a stage
process pickled at process start (an embedded runner's modules), or the process builds it
itself from importable names (a :class:`StageBuilder`, e.g. a job file's recipe; nothing but
plain data crosses hosts). :func:`pipeq.runtime.executors.make_executor` then picks the executor
that runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["StageSpec", "StageBuilder"]


@dataclass
class StageSpec:
    """Everything stage k's executor is made of (see :mod:`pipeq.runtime.executors`)."""

    module: nn.Module
    optimizer: Callable[..., torch.optim.Optimizer]  # called with the stage's parameters
    loss_fn: Callable | None = None  # the last stage's; every stage's local criterion with AL
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    aux_head: nn.Module | None = None  # interlocking: the head reading this stage's output
    aux_loss: Callable | None = None
    # "epoch": stepped by scheduler_step only (see pipeq.stage.lr_schedulers)
    lr_scheduler_interval: str = "step"


class StageBuilder:
    """Builds a :class:`StageSpec` inside the stage process, instead of receiving a pickle."""

    def build(self, stage: int, n_stages: int) -> StageSpec:
        """Stage ``stage``'s spec, built in its own process."""
        raise NotImplementedError(f"{type(self).__name__} must define build(stage, n_stages) -> StageSpec")

    def prepared(self, multi_host: bool = False) -> "StageBuilder":
        """This builder with what must be decided once, in the launching process, decided (a
        job's measured balance): the stage processes are sent the result. ``multi_host``: other
        nodes build from their own copy of the job, so nothing may be decided here alone."""
        return self

    def for_stage(self, stage: int) -> "StageBuilder":
        """What the process of stage ``stage`` is handed (a builder holding what was made for it
        once, in the launching process: :meth:`prepared`); by default this builder."""
        return self

    def for_schedule(self, schedule: Any) -> "StageBuilder":
        """This builder for a run of ``schedule`` (a recipe asks it which stages get the loss)."""
        return self

    def seed_for(self, stage: int) -> int:
        """The seed of stage ``stage``'s torch RNG (dropout...), the same on every host."""
        return stage

    def describe(self) -> dict[str, Any]:
        """Plain data that two hosts compare to make sure they build the same job."""
        return {}
