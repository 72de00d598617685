"""Asynchronous 1F1B: a step after every microbatch, with and without weight stashing."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pipeq
from pipeq.testing import backend_of
from async_cases import assert_state_equal, no_stash_runner, recompute_reference, tutorial_data
from launch_util import ROOT
from models import TutorialStage0, TutorialStage1
from pipeq import schedules
from pipeq.schedules import Op

pytestmark = pytest.mark.timeout(180)


def test_stashed_copies_are_bounded_by_the_pipeline_depth() -> None:
    stages = [TutorialStage0(), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), TutorialStage1()]
    xs, ys = tutorial_data(12)
    runner = pipeq.PipelineRunner(stages, nn.BCELoss(), functools.partial(torch.optim.SGD, lr=0.1),
                                  "async", 12, mode="simulated")
    with runner:
        runner.step(torch.cat(xs), torch.cat(ys))
        held = [ex.max_copies for ex in backend_of(runner).executors]
    assert held == [3, 2, 1]  # min(m, N - k): stage k's microbatches in flight


def test_without_stashing_the_backward_uses_the_newest_weights() -> None:
    """No copies: microbatch j's gradient is that of the weights at its backward."""
    torch.manual_seed(0)
    stages = [TutorialStage0(), TutorialStage1()]
    xs, ys = tutorial_data(6)
    sgd = functools.partial(torch.optim.SGD, lr=0.5)
    results = {}
    for stash in (True, False):
        with pipeq.PipelineRunner(stages, nn.BCELoss(), sgd, pipeq.schedules.AsyncOneFOneB(weight_stashing=stash),
                                  6, mode="simulated") as runner:
            runner.step(torch.cat(xs), torch.cat(ys))
            results[stash] = runner.state_dict()
    # stage 0 has 2 microbatches in flight: its forward and backward weights differ without stashing
    assert not torch.allclose(results[True]["0.w1.weight"], results[False]["0.w1.weight"])


def test_async_learns_the_tutorial_task_and_the_schedule_is_checked() -> None:
    torch.manual_seed(40)
    xs, ys = tutorial_data(10)
    runner = pipeq.PipelineRunner([TutorialStage0(), TutorialStage1()], nn.BCELoss(),
                                  functools.partial(torch.optim.SGD, lr=0.5), "async", 10, mode="simulated")
    with runner:
        losses = [runner.step(torch.cat(xs), torch.cat(ys)) for _ in range(150)]
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.05
    lowered = schedules.build("async", 2, 4)
    steps = [sum(1 for a in acts if a.op is Op.STEP) for acts in lowered]
    assert steps == [4, 4]  # a step after every backward


def test_the_async_example_runs_and_its_loss_falls() -> None:
    import os
    import sys

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from async_mlp import train

    curve = train(updates=2000, mode="simulated", every=500, verbose=False)
    assert [c[0] for c in curve] == [0, 500, 1000, 1500]
    assert curve[-1][1] < curve[0][1] - 0.05


# -- weight_stashing=False: one forward per microbatch, recomputed with the same RNG state ----------


def test_without_stashing_batchnorm_counts_each_microbatch_once() -> None:
    torch.manual_seed(5)
    stages = [nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8), nn.ReLU()),
              nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU()),
              nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 1), nn.Sigmoid())]
    xs, ys = tutorial_data(6)
    ref, losses, _ = recompute_reference(stages, xs, ys, lr=0.5)
    with no_stash_runner(stages, nn.BCELoss(), 6) as runner:
        loss = runner.step(torch.cat(xs), torch.cat(ys))
        got = runner.state_dict()
    for layer in (1, 4, 6):  # each stage's BatchNorm1d
        assert int(got[f"{layer}.num_batches_tracked"]) == 6, layer  # one forward per microbatch, not 2
    assert_state_equal(got, ref)  # running_mean and running_var of one forward per microbatch
    assert loss == pytest.approx(sum(losses) / len(losses), rel=1e-5)


class CountingBCE(nn.BCELoss):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, out, target):
        self.calls += 1
        return super().forward(out, target)


def test_without_stashing_the_last_stage_evaluates_its_loss_once_per_microbatch() -> None:
    torch.manual_seed(7)
    stages = [TutorialStage0(), TutorialStage1()]
    xs, ys = tutorial_data(6)
    ref, losses, _ = recompute_reference(stages, xs, ys, lr=0.5)
    with no_stash_runner(stages, CountingBCE(), 6) as runner:
        loss = runner.step(torch.cat(xs), torch.cat(ys))
        counted = backend_of(runner).executors[-1].loss_fn
        assert counted.calls == 6
        runner.step(torch.cat(xs), torch.cat(ys))
        assert counted.calls == 12
    assert loss == pytest.approx(sum(losses) / len(losses), rel=1e-5)
