"""Associated learning of sequence models (LSTM state tuples, embeddings) in stage processes: the same numbers as the reference."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import pipeq
from pipeq import schedules
from pipeq.research.al.executor import build_al, build_al_lstm

pytestmark = pytest.mark.timeout(120)

VOCAB, CLASSES, LENGTH = 17, 3, 7
ADAM = functools.partial(torch.optim.Adam, lr=1e-2)


def tokens(n: int = 24, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids (0 = padding) of lengths 2..LENGTH, and class labels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
    lengths = torch.randint(2, LENGTH + 1, (n,), generator=g)
    x[torch.arange(LENGTH).expand(n, LENGTH) >= lengths[:, None]] = 0
    return x, torch.randint(0, CLASSES, (n,), generator=g)


# -- the reference: AL written out in one process, pipeq's conventions spelled out ---------------
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


# -- 1. equality with the reference -------------------------------------------------------------
@pytest.mark.parametrize("mode", ["simulated", "process"])
def test_lstm_al_with_tuple_state_equals_the_reference(mode):
    """Embedding first layer (int64 tokens), then two bidirectional LSTM layers, the second one
    starting from the first one's (h, c): (out, mask, (h, c)) travels between the stages."""
    layers = lstm_layers()
    x, y = tokens(24)
    batches = [(x[:12], y[:12]), (x[12:], y[12:])]
    state, scores = run(layers, batches, mode)
    ref = al_reference(layers, x.split(3), y.split(3), ADAM)
    assert_close(state, nn.Sequential(*ref).state_dict())
    init = nn.Sequential(*layers).state_dict()
    assert all(not torch.equal(state[k], init[k]) for k in init if k.split(".")[1] in "fbgh"
               and not k.endswith("embed.weight")), "every part trains"
    assert torch.allclose(scores, reference_predict(ref, x[:12]), atol=1e-5)


def test_embedding_first_layer_through_build_al_equals_the_reference():
    """The issue's own case: build_al over an nn.Embedding block (its output flattened): the
    label path's one-hot is float whatever the integer input is."""
    torch.manual_seed(2)
    blocks = [nn.Embedding(VOCAB, 3), nn.Sequential(nn.Linear(3 * LENGTH, 8), nn.ReLU())]
    layers = build_al(blocks, [3 * LENGTH, 8], CLASSES, label_widths=[5, 4])
    x, y = tokens(20, seed=7)
    state, _ = run(layers, [(x, y)], "process", microbatches=5)
    assert_close(state, nn.Sequential(*al_reference(layers, x.split(4), y.split(4), ADAM)).state_dict())
