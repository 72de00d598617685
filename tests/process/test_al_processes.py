"""Associated learning in stage processes: the same numbers as the one-process reference, and the refusals a stage process makes."""

from __future__ import annotations

import functools

import pytest
import torch

from al_cases import (
    ADAM, N_CLASSES, al_reference, al_reference_predict, assert_states_close, flat_state, make_data,
    make_layers, runner
)
from pipeq.errors import PipelineError

pytestmark = pytest.mark.timeout(300)

SGD_MOMENTUM = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


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
