"""Associated learning cases: the layers and data, the one-process reference, and a runner."""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn
from torch.nn import functional as F

import pipeq
from pipeq import schedules
from pipeq.research import ALLayer, build_al

N_CLASSES = 4
IN = 10

ADAM = functools.partial(torch.optim.Adam, lr=1e-2)
SGD = functools.partial(torch.optim.SGD, lr=0.1)


def make_layers(seed: int = 0, dtype: torch.dtype = torch.float32, dropout: bool = False) -> list[ALLayer]:
    """Four AL layers of mixed blocks (widths 12, 12, 8, 8; label widths 6, 6, 5, 5)."""
    torch.manual_seed(seed)
    blocks = [
        nn.Sequential(nn.Linear(IN, 12), nn.ReLU()),
        nn.Sequential(nn.Linear(12, 12), nn.Dropout(0.5) if dropout else nn.Identity(), nn.Tanh()),
        nn.Linear(12, 8),
        nn.Sequential(nn.Linear(8, 8), nn.ReLU()),
    ]
    layers = build_al(blocks, [12, 12, 8, 8], N_CLASSES, label_widths=[6, 6, 5, 5])
    return [layer.to(dtype) for layer in layers]


def make_data(n: int = 40, seed: int = 1, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN, generator=g, dtype=dtype)
    y = torch.randint(0, N_CLASSES, (n,), generator=g)
    return x, y


def first_linear(m: nn.Module) -> nn.Linear:
    return next(mod for mod in m.modules() if isinstance(mod, nn.Linear))


def al_reference(layers, xs, ys, factory, first_loss="ce", criterion=None):
    """Associated Learning, one microbatch after the other, every layer updated right after it
    computes its two local losses (one optimizer over f+b, one over g+h).

    Returns the trained copies of the layers and the last layer's associated loss per microbatch.
    """
    layers = copy.deepcopy(layers)
    crit = criterion if criterion is not None else nn.MSELoss()
    opts = [
        (factory([*lay.f.parameters(), *lay.b.parameters()]), factory([*lay.g.parameters(), *lay.h.parameters()]))
        for lay in layers
    ]
    n_classes = first_linear(layers[0].g).in_features
    last_assoc = []
    for x, y in zip(xs, ys):
        s_in, t_in = x, F.one_hot(y, n_classes).to(x.dtype)
        for i, lay in enumerate(layers):
            s = lay.f(s_in)
            t = lay.g(t_in)
            assoc = crit(lay.b(s), t.detach())
            if i == 0 and first_loss == "ce":
                ae = F.cross_entropy(torch.tanh(lay.h(t)), y)
            else:
                ae = crit(lay.h(t), t_in)
            for o in opts[i]:
                o.zero_grad()
            (assoc + ae).backward()
            for o in opts[i]:
                o.step()
            s_in, t_in = s.detach(), t.detach()
        last_assoc.append(assoc.item())
    return layers, last_assoc


def al_reference_predict(layers, x, top=None, first_loss="ce"):
    """f_0 .. f_top, then b_top, then h_top, ..., h_0 (tanh on h_0 with the CE first loss)."""
    top = len(layers) - 1 if top is None else top
    for lay in layers:
        lay.eval()
    with torch.no_grad():
        s = x
        for lay in layers[: top + 1]:
            s = lay.f(s)
        t = layers[top].b(s)
        for i in range(top, -1, -1):
            t = layers[i].h(t)
        return torch.tanh(t) if first_loss == "ce" else t


def flat_state(layers) -> dict[str, torch.Tensor]:
    return nn.Sequential(*layers).state_dict()


def assert_states_close(got: dict, want: dict, atol: float = 1e-5) -> None:
    assert list(got) == list(want)
    for k in want:
        diff = (got[k].double() - want[k].double()).abs().max().item()
        assert diff <= atol, f"{k}: max abs difference {diff:.3g} > {atol}"


def runner(layers, mode="simulated", optimizer=SGD, microbatches=4, first_loss="ce", inference_layer=None, **kw):
    schedule = schedules.AssociatedLearning(first_loss=first_loss, inference_layer=inference_layer)
    return pipeq.PipelineRunner(layers, kw.pop("loss_fn", None), optimizer, schedule=schedule,
                                microbatches=microbatches, mode=mode, start_method="forkserver", **kw)
