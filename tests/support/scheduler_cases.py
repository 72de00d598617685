"""LR scheduler cases: the stages, epochs of data, the one-process reference and the by-epoch training loop."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau

import pipeq
from models import reference_train
from pipeq import checkpoint

SGD = functools.partial(torch.optim.SGD, lr=0.2, momentum=0.5)
PLATEAU = functools.partial(ReduceLROnPlateau, patience=0, factor=0.5)
#: the metric fed at the end of each epoch: better (than inf), no better (the lr halves), better
PLATEAU_METRICS = [1.0, 1.0, 0.5]


def make_stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(6, 8), nn.Tanh()), nn.Linear(8, 3)]


def epochs_of_data(epochs: int = 3, batches: int = 2, size: int = 8) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(size, 6, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(batches)]
            for _ in range(epochs)]


def reference(scheduler, metrics_fed, data) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process: the flat model, one optimizer, ``scheduler`` stepped after each epoch (with
    that epoch's metric, if any); the final state and the lr each epoch trained with."""
    model = checkpoint.flat_model(make_stages())
    opt = SGD(model.parameters())
    sched = scheduler(opt)
    lrs = []
    for epoch, batches in enumerate(data):
        lrs.append(opt.param_groups[0]["lr"])
        reference_train([], nn.functional.cross_entropy, SGD, batches, model=model, opt=opt)
        sched.step(*([metrics_fed[epoch]] if metrics_fed else []))
    return model.state_dict(), lrs


def train_by_epoch(runner: pipeq.PipelineRunner, metrics_fed, data) -> list[float]:
    """runner.stream each epoch, then runner.scheduler_step; the lr each epoch trained with."""
    lrs = []
    for epoch, batches in enumerate(data):
        rates = runner.learning_rates()
        assert all(r == rates[0] for r in rates), rates  # every stage alike
        lrs.append(rates[0][0])
        for _ in runner.stream(batches):
            assert runner.last_step_lr == lrs[-1]  # constant within the epoch
        runner.scheduler_step(*([metrics_fed[epoch]] if metrics_fed else []))
    return lrs


def assert_close(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert sorted(state) == sorted(ref)
    for k in ref:
        assert torch.allclose(state[k], ref[k], atol=1e-5), (k, (state[k] - ref[k]).abs().max())
