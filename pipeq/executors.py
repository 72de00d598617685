"""Which executor runs a stage: the schedule decides how its compute actions behave.

Plain backprop schedules (fill-drain, 1F1B, your own) use :class:`~pipeq.stage.StageExecutor`;
interlocking ones :class:`~pipeq.interlock.InterlockExecutor` (auxiliary heads, their own
gradient routing); asynchronous 1F1B :class:`~pipeq.asyncpipe.AsyncExecutor` (a step per
microbatch, weight stashing); Associated Learning :class:`~pipeq.al.ALExecutor` (local losses only). The worker process and the simulated engine both build theirs here.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .al import ALExecutor
from .asyncpipe import AsyncExecutor
from .interlock import InterlockExecutor
from .schedules import AssociatedLearning, AsyncOneFOneB, Interlock
from .stage import StageExecutor


def make_executor(
    schedule: Any,
    index: int,
    n_stages: int,
    module: nn.Module,
    optimizer_factory: Callable,
    loss_fn: Callable | None,
    device: torch.device,
    lr_scheduler: Callable | None = None,
    extras: dict[str, Any] | None = None,
) -> StageExecutor:
    extras = extras or {}
    if isinstance(schedule, Interlock):
        return InterlockExecutor(index, n_stages, module, optimizer_factory, loss_fn, device,
                                 lr_scheduler, schedule=schedule, aux_head=extras.get("aux_head"),
                                 aux_loss=extras.get("aux_loss"))
    if isinstance(schedule, AssociatedLearning) or schedule == "al":
        layer = schedule.inference_layer if isinstance(schedule, AssociatedLearning) else None
        criterion = extras.get("al_criterion", loss_fn)  # every layer's local losses use it
        return ALExecutor(index, n_stages, module, optimizer_factory, criterion, device, lr_scheduler,
                          first_loss=extras.get("al_first_loss", "ce"), inference_layer=layer)
    if isinstance(schedule, AsyncOneFOneB) or schedule == "async":
        return AsyncExecutor(index, n_stages, module, optimizer_factory, loss_fn, device, lr_scheduler,
                             weight_stashing=extras.get("weight_stashing", True))
    return StageExecutor(index, n_stages, module, optimizer_factory, loss_fn, device, lr_scheduler)
