"""Associated learning in stage processes: the same numbers as the one-process reference, and the refusals a stage process makes."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import pipeq
from pipeq import schedules
from pipeq.research.al.executor import ALLayer, build_al
from pipeq.errors import PipelineError

pytestmark = pytest.mark.timeout(300)

N_CLASSES = 4
IN = 10

ADAM = functools.partial(torch.optim.Adam, lr=1e-2)
SGD_MOMENTUM = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
SGD = functools.partial(torch.optim.SGD, lr=0.1)


# -- models and data ---------------------------------------------------------------------------
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


# -- the reference, written out in one process -------------------------------------------------
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


# -- 1. equivalence with the reference -----------------------------------------------------------
@pytest.mark.parametrize("mode", ["simulated", "process"])
@pytest.mark.parametrize("opt_name", ["adam", "sgd-momentum"])
@pytest.mark.parametrize("steps,micro", [(1, 10), (2, 5)])
def test_pipelined_al_equals_the_one_process_reference(mode, opt_name, steps, micro):
    factory = ADAM if opt_name == "adam" else SGD_MOMENTUM
    layers = make_layers()
    x, y = make_data(40)
    ref_layers, ref_losses = al_reference(layers, x.split(4), y.split(4), factory)
    with runner(layers, mode, factory, micro) as r:
        per = 40 // steps
        losses = [r.step(x[i * per:(i + 1) * per], y[i * per:(i + 1) * per]) for i in range(steps)]
        state = r.state_dict()
    want = flat_state(ref_layers)
    assert_states_close(state, want)
    init = flat_state(layers)
    for k in init:  # every parameter of every layer trained
        assert not torch.equal(state[k], init[k]), f"{k} did not change"
    for i, loss in enumerate(losses):  # the last layer's mean associated loss over the step
        assert loss == pytest.approx(sum(ref_losses[i * micro:(i + 1) * micro]) / micro, abs=1e-5)


# -- 3. inference: the decode path -------------------------------------------------------------
@pytest.mark.parametrize(
    "mode,first_loss,top",
    [
        ("simulated", "ce", None),
        ("simulated", "ce", 0),
        ("simulated", "ce", 1),
        ("simulated", "ce", 3),
        ("simulated", "mse", None),
        ("simulated", "mse", 1),
        ("process", "ce", None),
        ("process", "ce", 1),
        ("process", "mse", 2),
    ],
)
def test_predict_decodes_through_b_and_the_hs_like_the_reference(mode, first_loss, top):
    layers = make_layers()
    x, y = make_data(16, seed=3)
    ref_layers, _ = al_reference(layers, x.split(4), y.split(4), ADAM, first_loss=first_loss)
    xt, _ = make_data(23, seed=4)  # 23 rows in 4 microbatches (6, 6, 6, 5)
    with runner(layers, mode, ADAM, 4, first_loss=first_loss, inference_layer=top) as r:
        r.step(x, y)  # the inference layer does not change training
        assert_states_close(r.state_dict(), flat_state(ref_layers))
        out = r.predict(xt)
        again = r.predict(xt)
    want = al_reference_predict(ref_layers, xt, top, first_loss)
    assert isinstance(out, torch.Tensor) and out.shape == (23, N_CLASSES)
    assert (out - want).abs().max().item() <= 1e-5
    # same numbers again (process mode may differ in the last bit: unaligned received buffers)
    assert (out - again).abs().max().item() <= 1e-6
    if first_loss == "ce":
        assert out.abs().max() < 1
    else:  # no tanh: the reference with tanh would differ
        assert (out - torch.tanh(want)).abs().max().item() > 1e-3
    if top is not None and top != 3:  # the shortcut is another function than the full depth
        full = al_reference_predict(ref_layers, xt, None, first_loss)
        assert (out - full).abs().max().item() > 1e-3


@pytest.mark.parametrize("mode", ["simulated", "process"])
def test_float_targets_are_refused_with_a_clear_error(mode):
    x, y = make_data(8)
    with runner(make_layers(), mode) as r:
        with pytest.raises((ValueError, PipelineError), match="class indices"):
            r.step(x, y.float())
