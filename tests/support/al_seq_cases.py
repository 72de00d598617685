"""Sequence AL cases: token data, the one-process reference, a runner and LSTM layers."""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn
from torch.nn import functional as F

import pipeq
from pipeq import schedules
from pipeq.research import build_al_lstm

VOCAB, CLASSES, LENGTH = 17, 3, 7
ADAM = functools.partial(torch.optim.Adam, lr=1e-2)


def tokens(n: int = 24, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids (0 = padding) of lengths 2..LENGTH, and class labels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
    lengths = torch.randint(2, LENGTH + 1, (n,), generator=g)
    x[torch.arange(LENGTH).expand(n, LENGTH) >= lengths[:, None]] = 0
    return x, torch.randint(0, CLASSES, (n,), generator=g)


def spread(m: nn.Module, v):
    return m(*v) if isinstance(v, tuple) else m(v)


def detached(v):
    if isinstance(v, torch.Tensor):
        return v.detach()
    return tuple(detached(e) for e in v)


def al_reference(layers, xs, ys, factory, label_index=False):
    """One microbatch after the other; every layer updates right after its two local losses."""
    layers = copy.deepcopy(layers)
    opts = [(factory([*lay.f.parameters(), *lay.b.parameters()]), factory([*lay.g.parameters(), *lay.h.parameters()]))
            for lay in layers]
    for x, y in zip(xs, ys):
        s_in = x
        onehot = F.one_hot(y, CLASSES).float()
        t_in = y if label_index else onehot
        for i, lay in enumerate(layers):
            s = spread(lay.f, s_in)
            t = lay.g(t_in)
            assoc = F.mse_loss(spread(lay.b, s), t.detach())
            ae = F.cross_entropy(torch.tanh(lay.h(t)), y) if i == 0 else F.mse_loss(lay.h(t), t_in)
            for o in opts[i]:
                o.zero_grad()
            (assoc + ae).backward()
            for o in opts[i]:
                o.step()
            s_in, t_in = detached(s), t.detach()
    return layers


def reference_predict(layers, x):
    with torch.no_grad():
        s = x
        for lay in layers:
            lay.eval()
            s = spread(lay.f, s)
        t = spread(layers[-1].b, s)
        for lay in reversed(layers):
            t = lay.h(t)
        return torch.tanh(t)


def assert_close(got: dict, want: dict, atol: float = 1e-5) -> None:
    assert list(got) == list(want)
    for k in want:
        diff = (got[k].double() - want[k].double()).abs().max().item()
        assert diff <= atol, f"{k}: max abs difference {diff:.3g} > {atol}"


def run(layers, batches, mode, microbatches=4):
    r = pipeq.PipelineRunner(layers, None, ADAM, schedule=schedules.AssociatedLearning(), microbatches=microbatches,
                             mode=mode, start_method="forkserver")
    with r:
        for x, y in batches:
            r.step(x, y)
        return r.state_dict(), r.predict(batches[0][0])


def lstm_layers(seed=0, bidirectional=True):
    torch.manual_seed(seed)
    return build_al_lstm(VOCAB, CLASSES, embed_dim=6, hidden=5, lstm_layers=2, bidirectional=bidirectional,
                         label_width=4)
