"""A split backward (I then W) gives exactly a whole backward's (B) gradients, on every stage, with and without recompute; sleep stages split alike."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import pipeq.testing
from pipeq.stage.executor import StageExecutor
from pipeq.stage.loss import microbatch_weights
from pipeq.stage.numerics import Numerics
from pipeq.stage.spec import StageSpec

pytestmark = pytest.mark.timeout(60)

SGD = functools.partial(torch.optim.SGD, lr=0.1)
SIZES = [3, 3, 2]


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Dropout(0.3), nn.Linear(7, 5), nn.BatchNorm1d(5))


def _executor(index: int, recompute: bool) -> StageExecutor:
    loss = nn.MSELoss() if index == 2 else None
    ex = StageExecutor(index, 3, StageSpec(_mlp(index), SGD, loss), torch.device("cpu"))
    ex.set_numerics(Numerics(recompute=(recompute,) * 3))
    return ex


def _run(index: int, split: bool, recompute: bool) -> tuple[list, list, list]:
    """Stage ``index`` of 3 through one step of 3 microbatches, forwards then backwards in
    reverse order: its outputs, input gradients and parameter gradients."""
    torch.manual_seed(5)
    ex = _executor(index, recompute)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 5, generator=g)
    y = torch.randn(8, 5, generator=g)
    ex.begin(0, SIZES, True, x=x if index == 0 else None, target=y if index == 2 else None,
             weights=microbatch_weights(nn.MSELoss(), y, SIZES))
    received = [None if index == 0 else (torch.randn(n, 5, generator=g),) for n in SIZES]
    grads = [None if index == 2 else (torch.randn(n, 5, generator=g),) for n in SIZES]
    outs, ins = [], []
    for j in range(3):
        outs.append(ex.forward(j, received[j]))
    for j in (2, 0, 1):
        if split:
            ins.append(ex.input_grad(j, grads[j]))
        else:
            ins.append(ex.backward(j, grads[j]))
    if split:
        assert all(p.grad is None for p in ex.module.parameters())  # I leaves the weights alone
        for j in (0, 2, 1):
            ex.weight_grad(j)
        assert not ex.backprop.pending  # freed
    return outs, ins, [p.grad.clone() for p in ex.module.parameters()]


def _same(a, b) -> None:
    if a is None or b is None:
        assert a is None and b is None
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert len(a) == len(b)
        for u, v in zip(a, b):
            _same(u, v)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("index", [0, 1, 2])
def test_input_then_weight_gradient_equals_the_whole_backward_bitwise(index, recompute):
    whole = _run(index, split=False, recompute=recompute)
    split = _run(index, split=True, recompute=recompute)
    _same(split, whole)  # outputs, input gradients (None on stage 0), every parameter's gradient
    if index > 0:
        assert all(t[0].abs().sum() > 0 for t in split[1])


def test_W_before_its_I_and_I_without_forward_are_named():
    ex = _executor(1, False)
    ex.begin(4, SIZES, True)
    with pytest.raises(ValueError, match=r"stage 1, step 4: action W0 before I0"):
        ex.weight_grad(0)
    with pytest.raises(ValueError, match=r"stage 1, step 4: action I2 has no forward of microbatch 2"):
        ex.input_grad(2, (torch.zeros(2, 5),))


def test_a_new_step_forgets_what_an_unfinished_split_kept():
    ex = _executor(1, False)
    ex.begin(0, SIZES, True)
    ex.forward(0, (torch.randn(3, 5),))
    ex.input_grad(0, (torch.randn(3, 5),))
    assert list(ex.backprop.pending) == [0]
    ex.begin(1, SIZES, True)
    assert not ex.backprop.pending and not ex.stash


def test_the_last_stage_I_differentiates_the_loss_and_a_weightless_microbatch_gives_zeros():
    ex = copy.deepcopy(_executor(2, False))
    x = torch.randn(2, 5)
    ex.begin(0, [2], True, target=torch.randn(2, 5), weights=[0.0])
    ex.forward(0, (x,))
    (gin,) = ex.input_grad(0, None)
    assert torch.equal(gin, torch.zeros_like(x))
    ex.weight_grad(0)
    assert all(p.grad is None for p in ex.module.parameters())


def test_a_split_sleep_stage_sleeps_I_in_the_input_gradient_and_W_in_the_weight_gradient(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(pipeq.testing.time, "sleep", slept.append)
    spec = StageSpec(pipeq.testing.SleepStage(4, 0.1, 0.2, weight_s=0.3), SGD)
    ex = StageExecutor(1, 3, spec, torch.device("cpu"))
    ex.begin(0, [2], True)
    ex.forward(0, (torch.randn(2, 4),))
    assert slept == [0.1]  # (the bias's branch sleeps 0 in the forward: no system call at all)
    ex.input_grad(0, (torch.ones(2, 4),))
    assert slept[1:] == [0.2]
    ex.weight_grad(0)
    assert slept[2:] == [0.3]
    assert torch.equal(ex.module.bias.grad, torch.full((4,), 2.0))
    ex.begin(1, [2], True)
    ex.forward(0, (torch.randn(2, 4),))
    del slept[:]
    ex.backward(0, (torch.ones(2, 4),))
    assert sorted(slept) == [0.2, 0.3]  # a whole backward sleeps both
