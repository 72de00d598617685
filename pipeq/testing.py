"""Stages of fixed, known cost: for measuring schedules and bubbles (tests, benchmarks, reports).

    stages = [pipeq.testing.SleepStage(16, forward_s=0.01, backward_s=0.02) for _ in range(4)]
    split = [pipeq.testing.SleepStage(16, 0.01, 0.01, weight_s=0.01) for _ in range(4)]  # F, I, W

With ``weight_s`` the backward is split as zero-bubble schedules split it: the input gradient
(``I``) sleeps ``backward_s`` and the weight gradient (``W``) ``weight_s``, each on its own branch
of the graph, so that differentiating with respect to the input alone does not run the weight's
part (a whole backward sleeps both; stage 0, which has no input gradient, sleeps ``weight_s``).

A sleep costs no CPU, so several such stages on a small machine still overlap perfectly: what a
trace of them shows is the schedule and the runtime's own overhead, nothing else.

For tests, :func:`backend_of` reaches the backend that runs a runner's stages, to check what no
user needs to see (every replica's state, the processes' handles, the control channel).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch import nn

from pipeq.errors import PipelineError

if TYPE_CHECKING:
    from pipeq.control.runner import PipelineRunner
    from pipeq.runtime.backend import Backend

__all__ = ["SleepStage", "backend_of", "sleep"]


def backend_of(runner: PipelineRunner) -> Backend:
    """For tests: the backend that runs ``runner``'s stages, a :class:`~pipeq.runtime.backend.Backend`.

    In process mode a :class:`~pipeq.control.driver.ProcessBackend`: besides the protocol, its
    ``processes`` (their start and teardown), ``procs`` (each stage process's handle), ``ipc_dir``,
    ``server`` (the control channel) and ``ask_each`` (one command to any of the processes, every
    replica's too); in simulated mode a :class:`~pipeq.runtime.simulated.SimulatedBackend` and its
    ``executors``. It is the tests' seam into the runtime, which changes with it: a program uses the
    runner's own methods (:attr:`~pipeq.PipelineRunner.stage_processes` for the processes' pids)."""
    backend = runner._pipeline.backend  # the one place outside the runner that reads it: this hook's job
    if backend is None:
        raise PipelineError("the runner has no backend yet: with schedule='auto' it is built at the first batch")
    return backend


def sleep(seconds: float) -> None:
    """A :class:`SleepStage`'s sleep: ``time.sleep(seconds)``, skipped at 0 (a zero sleep is still
    a system call through the scheduler: 50-70 us with the kernel's default timer slack, about
    15 us at 1 ns, a turn given away where processes outnumber cores; a cost the stage does not
    declare)."""
    if seconds > 0:
        time.sleep(seconds)


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps ``forward_s`` and whose backward sleeps ``backward_s``."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):  # type: ignore[override]
        ctx.backward_s = backward_s
        sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        sleep(ctx.backward_s)
        return g, None, None


class SleepStage(nn.Module):
    """``x + bias`` whose forward takes ``forward_s`` and backward ``backward_s`` seconds; with
    ``weight_s``, ``backward_s`` is the input gradient's and ``weight_s`` the bias's (see the module).

    The bias makes every stage, the first one too, run a backward.
    """

    def __init__(self, width: int, forward_s: float, backward_s: float, *, weight_s: float | None = None) -> None:
        super().__init__()
        if forward_s < 0 or backward_s < 0 or (weight_s is not None and weight_s < 0):
            raise ValueError(f"sleep times must be >= 0, got forward_s={forward_s}, backward_s={backward_s}"
                             + (f", weight_s={weight_s}" if weight_s is not None else ""))
        self.bias = nn.Parameter(torch.zeros(width))
        self.forward_s = forward_s
        self.backward_s = backward_s
        self.weight_s = weight_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_s is None:
            return _Sleep.apply(x + self.bias, self.forward_s, self.backward_s)
        return _Sleep.apply(x, self.forward_s, self.backward_s) + _Sleep.apply(self.bias, 0.0, self.weight_s)
