"""Stages of fixed, known cost: for measuring schedules and bubbles (tests, benchmarks, reports).

    stages = [pipeq.testing.SleepStage(16, forward_s=0.01, backward_s=0.02) for _ in range(4)]

A sleep costs no CPU, so several such stages on a small machine still overlap perfectly: what a
trace of them shows is the schedule and the runtime's own overhead, nothing else.
"""

from __future__ import annotations

import time

import torch
from torch import nn


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps ``forward_s`` and whose backward sleeps ``backward_s``."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):  # type: ignore[override]
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        time.sleep(ctx.backward_s)
        return g, None, None


class SleepStage(nn.Module):
    """``x + bias`` whose forward takes ``forward_s`` and backward ``backward_s`` seconds.

    The bias makes every stage, the first one too, run a backward.
    """

    def __init__(self, width: int, forward_s: float, backward_s: float) -> None:
        super().__init__()
        if forward_s < 0 or backward_s < 0:
            raise ValueError(f"sleep times must be >= 0, got forward_s={forward_s}, backward_s={backward_s}")
        self.bias = nn.Parameter(torch.zeros(width))
        self.forward_s = forward_s
        self.backward_s = backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x + self.bias, self.forward_s, self.backward_s)
