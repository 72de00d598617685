"""The research schedules' executors on CUDA stages: asynchronous 1F1B without weight stashing
(its recompute saves and restores the stage's CUDA RNG state), interlocking backpropagation
and associated learning (their received tensors moved to the device, non_blocking).

Their update rules are not plain backprop, so the one-device reference is the same runner in
simulated mode on cuda:0: every stage in one process, on one device (the CPU tests show that
simulated mode equals their hand-written references). Process mode, one stage per GPU, must
give the same numbers (the CPU tests' bound for these: 1e-6; here FP32_TOL, 1e-5).
"""

from __future__ import annotations

import copy
import functools
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import pipeq
from gpu_cases import CUDA, FP32_TOL, assert_states_close, round_robin
from pipeq import schedules

pytestmark = [*CUDA, pytest.mark.timeout(300)]


def async_case():
    from async_cases import tutorial_data
    from models import TutorialStage0, TutorialStage1

    torch.manual_seed(40)
    xs, ys = tutorial_data(10)
    return SimpleNamespace(stages=[TutorialStage0(), TutorialStage1()], heads=None, loss_fn=nn.BCELoss(),
                           opt=functools.partial(torch.optim.SGD, lr=0.5),
                           schedule=schedules.AsyncOneFOneB(weight_stashing=False), microbatches=10,
                           data=[(torch.cat(xs), torch.cat(ys))])


def interlock_case():
    from interlock_cases import MOMENTUM, batches, linear_heads, linear_stages

    return SimpleNamespace(stages=linear_stages(), heads=linear_heads(), loss_fn=nn.CrossEntropyLoss(), opt=MOMENTUM,
                           schedule="local", microbatches=3, data=batches(3, size=11, seed=7))


def al_case():
    from al_cases import ADAM, make_data, make_layers

    x, y = make_data(40)
    return SimpleNamespace(stages=make_layers(), heads=None, loss_fn=None, opt=ADAM,
                           schedule=schedules.AssociatedLearning(), microbatches=5,
                           data=[(x[:20], y[:20]), (x[20:], y[20:])])


def run(case, mode: str, devices: list[str]):
    runner = pipeq.PipelineRunner(copy.deepcopy(case.stages), case.loss_fn, case.opt, case.schedule,
                                  case.microbatches, mode=mode, devices=devices, aux_heads=copy.deepcopy(case.heads))
    x_eval = case.data[0][0][:7]
    with runner:
        losses = [runner.step(x, y) for x, y in case.data]
        return losses, runner.state_dict(), runner.predict(x_eval)


@pytest.mark.parametrize("make_case", [async_case, interlock_case, al_case], ids=["async-no-stash", "interlock-local",
                                                                                 "al"])
def test_process_mode_on_cuda_equals_simulated_on_one_device(make_case):
    case = make_case()
    n = len(case.stages)
    want = run(case, "simulated", ["cuda:0"] * n)
    got = run(case, "process", round_robin(n))
    assert got[0] == pytest.approx(want[0], abs=FP32_TOL)
    assert_states_close(got[1], want[1], FP32_TOL)
    torch.testing.assert_close(got[2], want[2], atol=FP32_TOL, rtol=0)
