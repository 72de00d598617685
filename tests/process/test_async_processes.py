"""Asynchronous 1F1B in stage processes: weight stashing and recomputation give the reference's numbers."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.func import functional_call

import pipeq
from async_cases import assert_state_equal, no_stash_runner, recompute_reference, tutorial_data
from models import TutorialStage0, TutorialStage1
from pipeq import schedules
from pipeq.schedules import Op

pytestmark = pytest.mark.timeout(180)


def stashing_reference(stages, xs, ys, lr):
    """The update rule written out in one process: each stage runs its actions in the async
    schedule's order; the forward of j uses a copy of the stage's weights as they are then, its
    backward the gradient of that copy, and SGD applies it to the live weights right away."""
    n, m = len(stages), len(xs)
    live = [copy.deepcopy(s) for s in stages]
    opts = [torch.optim.SGD(s.parameters(), lr=lr) for s in live]
    # any order that respects each stage's list and the messages gives the same numbers: the
    # stages share no weights. Walk the lists, running whatever is ready.
    lists = [[a for a in acts if a.op in (Op.FORWARD, Op.BACKWARD)] for acts in schedules.AsyncOneFOneB()(n, m)]
    pos = [0] * n
    acts_in: dict = {}
    grads_in: dict = {}
    saved: dict = {}
    losses = []
    while any(pos[k] < len(lists[k]) for k in range(n)):
        for k in range(n):
            if pos[k] == len(lists[k]):
                continue
            a = lists[k][pos[k]]
            j = a.microbatch
            if a.op is Op.FORWARD:
                if k > 0 and (k, j) not in acts_in:
                    continue
                weights = {name: p.detach().clone().requires_grad_() for name, p in live[k].named_parameters()}
                inp = xs[j] if k == 0 else acts_in.pop((k, j)).requires_grad_()
                out = functional_call(live[k], weights, (inp,))
                if k == n - 1:
                    out = nn.BCELoss()(out, ys[j])
                    losses.append(out.item())
                else:
                    acts_in[(k + 1, j)] = out.detach()
                saved[(k, j)] = (inp, out, weights)
            else:
                if k < n - 1 and (k, j) not in grads_in:
                    continue
                inp, out, weights = saved.pop((k, j))
                out.backward(grads_in.pop((k, j)) if k < n - 1 else None)
                if k > 0:
                    grads_in[(k - 1, j)] = inp.grad.detach()
                for name, p in live[k].named_parameters():
                    p.grad = weights[name].grad
                opts[k].step()
            pos[k] += 1
    return live, losses


@pytest.mark.parametrize("mode", ["simulated", "process"])
def test_async_with_weight_stashing_equals_the_reference_on_the_tutorial_mlp(mode: str) -> None:
    torch.manual_seed(40)
    stages = [TutorialStage0(), TutorialStage1()]
    xs, ys = tutorial_data(20)
    ref, losses = stashing_reference(stages, xs, ys, lr=0.5)
    runner = pipeq.PipelineRunner(stages, nn.BCELoss(), functools.partial(torch.optim.SGD, lr=0.5),
                                  "async", 20, mode=mode, start_method="forkserver")
    with runner:
        loss = runner.step(torch.cat(xs), torch.cat(ys))  # 20 microbatches: 20 updates per stage
        got = runner.state_dict()
    assert loss == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    for k, s in enumerate(ref):
        for name, p in s.state_dict().items():
            assert torch.allclose(got[f"{k}.{name}"], p, atol=1e-6), (k, name)
    # and it is not plain synchronous training (the test can fail)
    sync = copy.deepcopy(stages)
    opt = [torch.optim.SGD(s.parameters(), lr=0.5) for s in sync]
    for x, y in zip(xs, ys):
        for o in opt:
            o.zero_grad()
        nn.BCELoss()(sync[1](sync[0](x)), y).backward()
        for o in opt:
            o.step()
    assert not torch.allclose(sync[0].w1.weight, got["0.w1.weight"], atol=1e-6)


# -- weight_stashing=False: one forward per microbatch, recomputed with the same RNG state ----------


@pytest.mark.parametrize("mode", ["simulated", "process"])
def test_without_stashing_the_recompute_backpropagates_the_dropout_mask_that_was_sent(mode: str) -> None:
    """Dropout on every stage: B(j) recomputes with the newest weights and F(j)'s RNG state, so the
    mask it backpropagates is the one of the output sent on, and each stage's stream advances as
    if every forward had run once."""
    torch.manual_seed(3)
    stages = [nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 8)),
              nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.ReLU()),
              nn.Sequential(nn.Linear(8, 1), nn.Dropout(0.5), nn.Sigmoid())]
    if mode == "simulated":
        # stage 0 only draws: the engine's order interleaves the stages' draws differently from
        # process mode's private streams; the reference walks the engine's order, shared stream
        stages[1][1].p = stages[2][1].p = 0.0
    xs, ys = tutorial_data(6)
    seeds = None
    if mode == "process":  # the driver seeds stage k with base + k, base drawn from our RNG
        torch.manual_seed(11)
        base = int(torch.randint(0, 2**62, ()).item())
        seeds = [base + k for k in range(3)]
    torch.manual_seed(11)
    ref, losses, _ = recompute_reference(stages, xs, ys, lr=0.5, seeds=seeds)
    ref_rng = torch.get_rng_state()
    torch.manual_seed(11)
    with no_stash_runner(stages, nn.BCELoss(), 6, mode) as runner:
        loss = runner.step(torch.cat(xs), torch.cat(ys))
        if mode == "simulated":  # the shared stream: F draws, B puts it back
            assert torch.equal(torch.get_rng_state(), ref_rng)
        got = runner.state_dict()
    assert loss == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    assert_state_equal(got, ref)
