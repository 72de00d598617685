"""Asynchronous 1F1B cases: the tutorial's data, the no-stashing reference written out, a runner and a state check."""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

import pipeq
from models import flat_state
from pipeq import schedules
from pipeq.schedules import Op


def tutorial_data(n_micro: int = 20):
    """The tutorial's data: rand(320, 16) inputs, random binary targets, microbatches of 32."""
    torch.manual_seed(40)
    x = torch.rand([320, 16])
    y = torch.randint(0, 2, [320, 1], dtype=torch.float32)
    xs = [x[(32 * j) % 320:(32 * j) % 320 + 32] for j in range(n_micro)]
    ys = [y[(32 * j) % 320:(32 * j) % 320 + 32] for j in range(n_micro)]
    return xs, ys


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
