"""Job modules for tests/unit/stage/test_balance.py and tests/launch/test_balance_launch.py (not a test module): an unevenly sized nn.Sequential,
a sample of its input and training batches. Job files name them as ``balance_jobs:NAME``."""

from __future__ import annotations

import torch
from torch import nn

FEATURES, CLASSES, HEAVY = 8, 3, 384


def uneven_model() -> nn.Sequential:
    """Six layers; the second and the fifth cost far more than the four others together."""
    return nn.Sequential(
        nn.Linear(FEATURES, 16), nn.Sequential(nn.Linear(16, HEAVY), nn.Tanh(), nn.Linear(HEAVY, 16)),
        nn.ReLU(), nn.Linear(16, 16), nn.Sequential(nn.Linear(16, HEAVY), nn.Tanh(), nn.Linear(HEAVY, 16)),
        nn.Linear(16, CLASSES))


def sample() -> torch.Tensor:
    """One microbatch of the model's input."""
    return torch.randn(16, FEATURES)


def train_batches(epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Eight batches of points labelled by a fixed linear teacher."""
    g = torch.Generator().manual_seed(epoch)
    x = torch.randn(8 * 16, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(99))).argmax(1)
    return list(zip(x.split(16), y.split(16)))
