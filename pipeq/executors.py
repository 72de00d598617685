"""What a stage is built from, and which executor runs it: the schedule decides.

A :class:`StageSpec` is one stage's part of the model and training setup. It reaches a stage
process pickled at process start (an embedded runner's modules), or the process builds it
itself from importable names (a :class:`StageBuilder`, e.g. a job file's recipe; nothing but
plain data crosses hosts). :func:`make_executor` picks the executor the schedule needs:

    fill-drain, 1F1B, your own     StageExecutor      (pipeq.stage)
    Interlock(...)                 InterlockExecutor  (auxiliary heads, its own gradient routing)
    AsyncOneFOneB(...)             AsyncExecutor      (a step per microbatch, weight stashing)
    AssociatedLearning(...)        ALExecutor         (local losses only)

The worker process and the simulated engine both build theirs here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .al import ALExecutor
from .asyncpipe import AsyncExecutor
from .interlock import InterlockExecutor
from .schedules import AssociatedLearning, AsyncOneFOneB, Interlock
from .stage import StageExecutor


@dataclass
class StageSpec:
    """Everything stage k's executor is made of."""

    module: nn.Module
    optimizer: Callable[..., torch.optim.Optimizer]  # called with the stage's parameters
    loss_fn: Callable | None = None  # the last stage's; every stage's local criterion with AL
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    aux_head: nn.Module | None = None  # interlocking: the head reading this stage's output
    aux_loss: Callable | None = None


class StageBuilder:
    """Builds a :class:`StageSpec` inside the stage process, instead of receiving a pickle."""

    def build(self, stage: int, n_stages: int) -> StageSpec:
        raise NotImplementedError

    def seed_for(self, stage: int) -> int:
        """The seed of stage ``stage``'s torch RNG (dropout...), the same on every host."""
        return stage

    def describe(self) -> dict[str, Any]:
        """Plain data that two hosts compare to make sure they build the same job."""
        return {}


def make_executor(schedule: Any, index: int, n_stages: int, spec: StageSpec, device: torch.device) -> StageExecutor:
    common = (index, n_stages, spec.module, spec.optimizer, spec.loss_fn, device, spec.lr_scheduler)
    if isinstance(schedule, Interlock):
        return InterlockExecutor(*common, schedule=schedule, aux_head=spec.aux_head, aux_loss=spec.aux_loss)
    if isinstance(schedule, AssociatedLearning):
        return ALExecutor(*common, first_loss=schedule.first_loss, inference_layer=schedule.inference_layer)
    if isinstance(schedule, AsyncOneFOneB):
        return AsyncExecutor(*common, weight_stashing=schedule.weight_stashing)
    return StageExecutor(*common)
