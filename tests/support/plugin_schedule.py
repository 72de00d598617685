"""A schedule defined outside pipeq, with its own executor: what a user's plug-in looks like.

``ReverseDrain`` runs every forward, then the backwards in reverse order, then the step (the
same numbers as fill-drain: gradients add up in any order). Its stages run
``HalvedStepExecutor``, plain backprop's executor whose optimizer step sees half the gradients:
with plain SGD that is training at half the learning rate, which a test can check against one
process.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeq.schedules import STEP, B, F, SchedulePolicy
from pipeq.stage.executor import StageExecutor


class HalvedStepExecutor(StageExecutor):
    """Plain backprop, with every gradient halved before the optimizer step."""

    def optimizer_step(self) -> None:
        with torch.no_grad():
            for p in self.optimizer_params():
                if p.grad is not None:
                    p.grad.mul_(0.5)
        super().optimizer_step()


class ReverseDrain(SchedulePolicy):
    """Every forward, the backwards last to first, then the optimizer step."""

    name = "reverse-drain"

    def plan(self, n_stages: int, n_microbatches: int) -> list[list[Any]]:
        m = n_microbatches
        return [[F(j) for j in range(m)] + [B(j) for j in reversed(range(m))] + [STEP] for _ in range(n_stages)]

    def executor(self, index: int, n_stages: int, spec: Any, device: Any) -> StageExecutor:
        return HalvedStepExecutor(index, n_stages, spec, device)
