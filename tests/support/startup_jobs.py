"""A job whose stages function splits a model with pipeq.split (traced) and notes each call in a
file (the job's ``stages_args``), so that a test can count who called it."""

from __future__ import annotations

import os

import torch
from torch import nn

import pipeq

WIDTH = 6


class Net(nn.Module):
    """Three tanh blocks and a head: pipeq.split cuts it before blocks.1 and blocks.2."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(3)])
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def stages(calls: str, n_stages: int = 3) -> "pipeq.split.Split":
    """The model split into ``n_stages``; the caller's pid appended to the file ``calls``."""
    with open(calls, "a") as f:
        f.write(f"{os.getpid()}\n")
    return pipeq.split(Net(), (torch.zeros(2, WIDTH),), n_stages=n_stages)


def batches(epoch: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(epoch)
    return [(torch.randn(4, WIDTH, generator=g), torch.randn(4, 2, generator=g)) for _ in range(4)]


JOB = """\
stages = "startup_jobs:stages"
stages_args = {{ calls = "{calls}" }}
loss = "torch.nn:MSELoss"
optimizer = "torch.optim:SGD"
optimizer_args = {{ lr = 0.1 }}
data = "startup_jobs:batches"
microbatches = 2
steps = 4
seed = 3
"""


def per_stage(k: int, n: int, calls: str) -> nn.Module:
    """The ``stages(k, n)`` form: stage k only, built in its own process."""
    with open(calls, "a") as f:
        f.write(f"{os.getpid()}\n")
    return nn.Linear(WIDTH, WIDTH)


def unpicklable(calls: str) -> list[nn.Module]:
    """Stages that do not pickle (a lambda in one): each stage process builds its own."""
    with open(calls, "a") as f:
        f.write(f"{os.getpid()}\n")
    odd = nn.Linear(WIDTH, WIDTH)
    odd.hook = lambda x: x  # type: ignore[assignment]
    return [nn.Linear(WIDTH, WIDTH), odd]
