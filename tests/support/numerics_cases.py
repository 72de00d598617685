"""Numerics cases: a small MLP, its data, the one-process reference (clipping, autocast, scaler) and a runner."""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

import pipeq
from models import flat_state, reference_train

SGD = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.5)


def mlp(seed: int = 0, width: int = 16) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(6, width), nn.Tanh()), nn.Sequential(nn.Linear(width, width), nn.Tanh()),
            nn.Linear(width, 4)]


def data(steps: int, n: int = 12, scale: float = 3.0):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(n, 6, generator=g) * scale, torch.randint(0, 4, (n,), generator=g)) for _ in range(steps)]


def reference(stages, batches, *, clip=None, norm_type=2.0, autocast=None, scaler=None):
    """Single-process training of the whole model, as a user writes it (:func:`models.reference_train`)."""
    model, _ = reference_train(stages, nn.functional.cross_entropy, SGD, batches, clip, norm_type=norm_type,
                               autocast=autocast, scaler=scaler)
    return flat_state(model)


def run(stages, batches, mode="simulated", **kw):
    runner = pipeq.PipelineRunner(copy.deepcopy(stages), nn.CrossEntropyLoss(), SGD, kw.pop("schedule", "1f1b"),
                                  kw.pop("microbatches", 3), mode=mode, **kw)
    with runner:
        losses = [runner.step(x, y) for x, y in batches]
        return runner.state_dict(), losses, runner.stats()


def assert_close(got, want, atol):
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=atol, rtol=0, msg=k)
