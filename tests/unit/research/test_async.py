"""Asynchronous 1F1B: a step after every microbatch, with and without weight stashing."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import pipeq
from launch_util import ROOT
from models import TutorialStage0, TutorialStage1, flat_state
from pipeq import schedules
from pipeq.schedules import Op

pytestmark = pytest.mark.timeout(180)


def tutorial_data(n_micro: int = 20):
    """The tutorial's data: rand(320, 16) inputs, random binary targets, microbatches of 32."""
    torch.manual_seed(40)
    x = torch.rand([320, 16])
    y = torch.randint(0, 2, [320, 1], dtype=torch.float32)
    xs = [x[(32 * j) % 320:(32 * j) % 320 + 32] for j in range(n_micro)]
    ys = [y[(32 * j) % 320:(32 * j) % 320 + 32] for j in range(n_micro)]
    return xs, ys


def test_stashed_copies_are_bounded_by_the_pipeline_depth() -> None:
    stages = [TutorialStage0(), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), TutorialStage1()]
    xs, ys = tutorial_data(12)
    runner = pipeq.PipelineRunner(stages, nn.BCELoss(), functools.partial(torch.optim.SGD, lr=0.1),
                                  "async", 12, mode="simulated")
    with runner:
        runner.step(torch.cat(xs), torch.cat(ys))
        held = [ex.max_copies for ex in runner._backend.executors]
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

def recompute_reference(stages, xs, ys, lr, loss_fn=None, seeds=None):
    """``weight_stashing=False`` written out in one process, following the async schedule's
    action order. F(j) runs the stage once without a graph: its RNG state is recorded, its
    BatchNorm counts it, its output is sent (the last stage reports its loss). B(j) runs the
    stage again on the same input with the stage's *newest* weights and the RNG state of F(j)
    (so the same dropout mask as the output that was sent), backpropagates, puts the buffers
    back as F(j) left them (running statistics count F(j) only) and SGD steps.

    ``seeds``: each stage's own RNG stream (process mode: stage k is seeded with ``seeds[k]``);
    None: one stream shared by every stage, torch's global one, drawn in the simulated engine's
    order (each stage runs until it waits for a message). Returns the stages, the reported losses
    and the RNG states the stages' streams end in."""
    loss_fn = loss_fn or nn.BCELoss()
    n = len(stages)
    live = [copy.deepcopy(s) for s in stages]
    opts = [torch.optim.SGD(s.parameters(), lr=lr) for s in live]
    lists = [[a for a in acts if a.op in (Op.FORWARD, Op.BACKWARD)] for acts in schedules.AsyncOneFOneB()(n, len(xs))]
    streams = None
    if seeds is not None:
        outer = torch.get_rng_state()
        streams = []
        for s in seeds:
            torch.manual_seed(s)
            streams.append(torch.get_rng_state())
        torch.set_rng_state(outer)
    pos = [0] * n
    acts_in: dict = {}
    grads_in: dict = {}
    saved: dict = {}
    losses = []
    while any(pos[k] < len(lists[k]) for k in range(n)):
        for k in range(n):
            while pos[k] < len(lists[k]):
                a = lists[k][pos[k]]
                j = a.microbatch
                if a.op is Op.FORWARD and k > 0 and (k, j) not in acts_in:
                    break
                if a.op is Op.BACKWARD and k < n - 1 and (k, j) not in grads_in:
                    break
                if streams is not None:  # stage k's own stream
                    outer = torch.get_rng_state()
                    torch.set_rng_state(streams[k])
                if a.op is Op.FORWARD:
                    inp = xs[j] if k == 0 else acts_in.pop((k, j))
                    rng = torch.get_rng_state()
                    with torch.no_grad():
                        out = live[k](inp)
                    if k == n - 1:
                        losses.append(nn.BCELoss()(out, ys[j]).item())
                    else:
                        acts_in[(k + 1, j)] = out
                    saved[(k, j)] = (inp, rng)
                else:
                    inp, rng = saved.pop((k, j))
                    if k > 0:
                        inp = inp.detach().requires_grad_()
                    buffers = {name: b.clone() for name, b in live[k].named_buffers()}
                    now = torch.get_rng_state()
                    torch.set_rng_state(rng)
                    out = live[k](inp)  # the newest weights, F(j)'s dropout mask
                    torch.set_rng_state(now)  # the stream goes on as if F(j) had run once
                    opts[k].zero_grad()
                    if k == n - 1:
                        nn.BCELoss()(out, ys[j]).backward()
                    else:
                        out.backward(grads_in.pop((k, j)))
                    if k > 0:
                        grads_in[(k - 1, j)] = inp.grad.detach()
                    with torch.no_grad():
                        for name, b in live[k].named_buffers():
                            b.copy_(buffers[name])  # running statistics: F(j) counted, not this
                    opts[k].step()
                if streams is not None:
                    streams[k] = torch.get_rng_state()
                    torch.set_rng_state(outer)
                pos[k] += 1
    return live, losses, streams


def no_stash_runner(stages, loss_fn, m, mode="simulated"):
    return pipeq.PipelineRunner(stages, loss_fn, functools.partial(torch.optim.SGD, lr=0.5),
                                schedules.AsyncOneFOneB(weight_stashing=False), m, mode=mode,
                                start_method="forkserver")


def assert_state_equal(got, ref):
    want = flat_state(ref)
    assert list(got) == list(want)
    for name, t in want.items():
        assert torch.allclose(got[name], t, atol=1e-6), name


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
        counted = runner._backend.executors[-1].loss_fn
        assert counted.calls == 6
        runner.step(torch.cat(xs), torch.cat(ys))
        assert counted.calls == 12
    assert loss == pytest.approx(sum(losses) / len(losses), rel=1e-5)
