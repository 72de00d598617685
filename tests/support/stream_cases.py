"""runner.stream cases: the data, and each schedule's model, optimizer and runner arguments."""

from __future__ import annotations

import functools

import torch
from torch import nn

from pipeq.research import build_al
from models import mlp_stages

FAST = dict(start_method="forkserver")
MOMENTUM = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
ADAM = functools.partial(torch.optim.Adam, lr=0.01)
WIDTHS = (8, 12, 12, 10, 3)  # four stages


def batches(n: int, size: int = 12, seed: int = 0, width: int = 8, classes: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, width, generator=g), torch.randint(0, classes, (size,), generator=g))
            for _ in range(n)]


def model_for(schedule: str):
    """(stages, optimizer, extra runner kwargs) for one schedule of the equality list."""
    if schedule == "al":
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(8, 12), nn.ReLU()), nn.Linear(12, 10), nn.Sequential(nn.Linear(10, 8), nn.Tanh())]
        return build_al(blocks, [12, 10, 8], 3, label_widths=[6, 5, 5]), None, ADAM, {}
    stages = mlp_stages(WIDTHS, seed=1)
    kw = {}
    if schedule in ("global", "local", "pairwise", "nwise"):
        torch.manual_seed(2)
        kw["aux_heads"] = [nn.Linear(w, 3) for w in WIDTHS[1:-1]]
    return stages, nn.CrossEntropyLoss(), MOMENTUM, kw
