"""Associated Learning (schedule "al"): the pipelined run against a one-process reference (in
``tests/support/al_cases.py``), the locality of every update (no gradient crosses a layer), the
decode path of ``predict``, a digits model, the errors, and the shape of the schedule."""

from __future__ import annotations

import functools
import time

import pytest
import torch
from torch import nn

import pipeq
from al_cases import (
    ADAM, SGD, al_reference, al_reference_predict, assert_states_close, flat_state, make_data,
    make_layers, runner
)
from pipeq import schedules
from pipeq.research import ALLayer, build_al
from pipeq.errors import PipelineError, ScheduleError
from pipeq.schedules import Op

pytestmark = pytest.mark.timeout(300)


def train_state(layers, batches, optimizer=SGD, microbatches=4, mode="simulated", **kw):
    with runner(layers, mode, optimizer, microbatches, **kw) as r:
        for x, y in batches:
            r.step(x, y)
        return r.state_dict()


def test_uneven_microbatches_are_separate_unweighted_updates():
    """22 samples in 4 microbatches (6, 6, 5, 5): each its own update with its own mean loss;
    the returned loss is the plain mean of the four."""
    layers = make_layers()
    x, y = make_data(22)
    ref_layers, ref_losses = al_reference(layers, x.split([6, 6, 5, 5]), y.split([6, 6, 5, 5]), ADAM)
    with runner(layers, "simulated", ADAM, 4) as r:
        loss = r.step(x, y)
        state = r.state_dict()
    assert_states_close(state, flat_state(ref_layers))
    assert loss == pytest.approx(sum(ref_losses) / 4, abs=1e-6)


def test_float64_with_the_mse_first_loss_equals_the_reference():
    """AssociatedLearning(first_loss="mse"): layer 0's AE loss is MSE(h_0(t_0), onehot(y)); one-hot in x's dtype."""
    layers = make_layers(dtype=torch.float64)
    x, y = make_data(24, dtype=torch.float64)
    ref_layers, ref_losses = al_reference(layers, x.split(4), y.split(4), ADAM, first_loss="mse")
    with runner(layers, "simulated", ADAM, 3, first_loss="mse") as r:
        losses = [r.step(x[:12], y[:12]), r.step(x[12:], y[12:])]
        state = r.state_dict()
    assert all(t.dtype == torch.float64 for t in state.values())
    assert_states_close(state, flat_state(ref_layers), atol=1e-10)
    assert losses == pytest.approx([sum(ref_losses[:3]) / 3, sum(ref_losses[3:]) / 3], abs=1e-10)
    # and the CE first loss is another model (the option is not ignored)
    ce_layers, _ = al_reference(layers, x.split(4), y.split(4), ADAM, first_loss="ce")
    assert not torch.allclose(flat_state(ce_layers)["0.h.weight"], state["0.h.weight"])


def test_state_dict_keys_are_the_flat_al_model_names():
    layers = make_layers()
    with runner(layers, "simulated") as r:
        keys = list(r.state_dict())
    assert keys == list(flat_state(layers))
    for k in ("0.f.0.0.weight", "0.b.0.weight", "0.g.0.weight", "0.h.weight", "1.h.0.weight", "2.f.0.weight"):
        assert k in keys


# -- 2. no gradient crosses a layer --------------------------------------------------------------
def perturbed(layer: int, part: str, seed: int = 0) -> list[ALLayer]:
    layers = make_layers(seed)
    torch.manual_seed(123)
    with torch.no_grad():
        for p in getattr(layers[layer], part).parameters():
            p.add_(0.5 * torch.randn_like(p))
    return layers


def same(a: dict, b: dict, prefix: str) -> bool:
    keys = [k for k in a if k.startswith(prefix)]
    assert keys, prefix
    return all(torch.equal(a[k], b[k]) for k in keys)


TWO_BATCHES = [make_data(16, seed=5), make_data(16, seed=6)]


@pytest.mark.parametrize("part", ["f", "b", "g", "h"])
def test_a_layer_gets_nothing_from_the_next_layers_losses(part):
    """Changing any part of layer 2 leaves layers 0 and 1 bit-identical after two steps of four
    updates, while the change does reach layer 3 (forward)."""
    base = train_state(make_layers(), TWO_BATCHES, ADAM)
    other = train_state(perturbed(2, part), TWO_BATCHES, ADAM)
    for k in (0, 1):
        for p in "fbgh":
            assert same(base, other, f"{k}.{p}."), f"layer {k}'s {p} changed with layer 2's {part}"
    assert not all(same(base, other, f"3.{p}.") for p in "fbgh"), "the change did not reach layer 3"


def test_the_label_path_gets_nothing_from_the_associated_loss():
    """Changing b_1 changes f_1's training, but no g or h of any layer (t never depends on x)."""
    base = train_state(make_layers(), TWO_BATCHES, ADAM)
    other = train_state(perturbed(1, "b"), TWO_BATCHES, ADAM)
    assert not same(base, other, "1.f.")
    for k in range(4):
        assert same(base, other, f"{k}.g."), f"layer {k}'s g got a gradient through b_1"
        assert same(base, other, f"{k}.h."), f"layer {k}'s h got a gradient through b_1"
    for p in "fbgh":
        assert same(base, other, f"0.{p}.")


@pytest.mark.parametrize("k", [0, 1, 3])
def test_the_x_path_gets_nothing_from_the_autoencoder_loss(k):
    """Changing h_k changes g_k's update but not f_k's or b_k's (one update: afterwards g_k moves
    the associated target, which is a forward effect, not a gradient)."""
    x, y = make_data(8, seed=7)
    base = train_state(make_layers(), [(x, y)], ADAM, microbatches=1)
    other = train_state(perturbed(k, "h"), [(x, y)], ADAM, microbatches=1)
    assert not same(base, other, f"{k}.g.")
    for layer in range(4):
        assert same(base, other, f"{layer}.f."), f"f_{layer} got a gradient through h_{k}"
        assert same(base, other, f"{layer}.b."), f"b_{layer} got a gradient through h_{k}"


def test_predict_runs_the_layers_in_eval_mode():
    """Dropout in f_1: predict is deterministic and equals the eval-mode reference; training
    still uses dropout afterwards."""
    layers = make_layers(dropout=True)
    x, y = make_data(16, seed=3)
    with runner(layers, "simulated", ADAM, 4) as r:
        r.step(x, y)
        state = r.state_dict()
        out = r.predict(x)
        again = r.predict(x)
        r.step(x, y)
    local = make_layers(dropout=True)
    nn.Sequential(*local).load_state_dict(state)
    assert torch.equal(out, again)
    assert (out - al_reference_predict(local, x)).abs().max().item() <= 1e-6


# -- 4. digits -------------------------------------------------------------------------------------
def test_al_on_digits_reaches_85_percent_held_out():
    from sklearn.datasets import load_digits

    t0 = time.monotonic()
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32)
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    n_train = 1400
    mean = x[:n_train].mean(0)
    std = x[:n_train].std(0).clamp_min(1.0)
    x = (x - mean) / std
    xtr, ytr, xte, yte = x[:n_train], y[:n_train], x[n_train:], y[n_train:]

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 128), nn.ReLU())] + [
        nn.Sequential(nn.Linear(128, 128), nn.ReLU()) for _ in range(3)
    ]
    layers = build_al(blocks, [128] * 4, 10, label_widths=[64] * 4)
    g = torch.Generator().manual_seed(1)
    with runner(layers, "simulated", functools.partial(torch.optim.Adam, lr=1e-3), 4) as r:
        for _ in range(4):  # ~95% held out after 3-4 epochs (and ~98% after 10)
            order = torch.randperm(n_train, generator=g)
            for i in range(0, n_train, 64):
                idx = order[i:i + 64]
                loss = r.step(xtr[idx], ytr[idx])
                assert loss == loss  # not NaN
        scores = r.predict(xte)
    acc = (scores.argmax(1) == yte).float().mean().item()
    assert scores.shape == (len(xte), 10)
    assert acc > 0.85, f"held-out accuracy {acc:.3f}"
    print(f"digits: held-out accuracy {acc:.3f} in {time.monotonic() - t0:.1f} s")


# -- 5. errors -------------------------------------------------------------------------------------
def test_a_stage_that_is_not_an_al_layer_is_refused_by_index():
    layers = make_layers()
    layers[2] = nn.Linear(12, 8)
    with pytest.raises(ValueError, match=r"stage 2 .*Linear.*ALLayer"):
        runner(layers)


def test_an_unknown_first_loss_is_refused():
    with pytest.raises(ValueError, match=r"AssociatedLearning\(first_loss=...\) must be 'ce' or 'mse', got 'xx'"):
        runner(make_layers(), first_loss="xx")


@pytest.mark.parametrize("bad", [-1, 1.5, "1"])
def test_a_malformed_inference_layer_is_refused_at_construction(bad):
    with pytest.raises(ValueError, match="inference_layer"):
        runner(make_layers(), inference_layer=bad)


@pytest.mark.parametrize("mode", ["simulated", "process"])
def test_an_inference_layer_beyond_the_stages_gives_a_clear_error(mode):
    """At construction or at the latest at predict, naming the option and the stage count."""
    x, y = make_data(8)
    try:
        r = runner(make_layers(), mode, inference_layer=4)
    except ValueError as exc:
        assert "inference_layer" in str(exc) and "4" in str(exc)
        return
    with r:
        r.step(x, y)  # training does not use it
        with pytest.raises((ScheduleError, PipelineError), match=r"inference_layer=4\) but there are only 4 stages"):
            r.predict(x)


def test_an_inference_layer_beyond_the_stages_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"AssociatedLearning\(inference_layer=4\) but there are only 4 AL layers"):
        runner(make_layers(), inference_layer=4)


def test_a_custom_criterion_is_used_by_every_layer():
    layers = make_layers()
    x, y = make_data(16)
    ref_layers, _ = al_reference(layers, x.split(4), y.split(4), SGD, criterion=nn.L1Loss())
    with runner(layers, "simulated", SGD, 4, loss_fn=nn.L1Loss()) as r:
        r.step(x, y)
        state = r.state_dict()
    assert_states_close(state, flat_state(ref_layers))


def test_an_lr_scheduler_is_applied_or_refused():
    """StepLR(gamma=0) zeroes the learning rate after its first step: either the runner refuses
    the scheduler, or the second training step changes nothing."""
    sched = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.0)
    x, y = make_data(16)
    try:
        r = runner(make_layers(), "simulated", SGD, 4, lr_scheduler=sched)
    except ValueError:
        return
    with r:
        r.step(x, y)
        first = r.state_dict()
        r.step(x, y)
        second = r.state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)


# -- 6. the schedule ---------------------------------------------------------------------------
def test_al_training_plan_sends_only_forward_and_steps_after_every_backward():
    plan = schedules.build("al", 3, 4)
    assert len(plan) == 3
    for k, acts in enumerate(plan):
        ops = [a.op for a in acts]
        assert Op.RECV_GRAD not in ops and Op.SEND_GRAD not in ops
        assert ops.count(Op.FORWARD) == ops.count(Op.BACKWARD) == ops.count(Op.STEP) == 4
        for i, op in enumerate(ops):
            if op is Op.BACKWARD:
                assert ops[i + 1] is Op.STEP
            if op is Op.STEP:
                assert ops[i - 1] is Op.BACKWARD
        assert ops.count(Op.RECV_ACT) == (4 if k > 0 else 0)
        assert ops.count(Op.SEND_ACT) == (4 if k < 2 else 0)
        # microbatches in order, each forward before its backward
        assert [a.microbatch for a in acts if a.op is Op.FORWARD] == [0, 1, 2, 3]
        assert [a.microbatch for a in acts if a.op is Op.BACKWARD] == [0, 1, 2, 3]
        for j in range(4):
            f = acts.index(schedules.F(j))
            assert acts.index(schedules.B(j)) > f
            if k < 2:  # s and t leave before the local backward and update
                assert acts.index(schedules.Action(Op.SEND_ACT, j)) < acts.index(schedules.B(j))


@pytest.mark.parametrize("top", [None, 1])
def test_al_inference_plan_decodes_toward_stage_0(top):
    sched = "al" if top is None else schedules.AssociatedLearning(inference_layer=top)
    plan = schedules.build(sched, 3, 4, training=False)
    last = 2 if top is None else top
    for k, acts in enumerate(plan):
        ops = [a.op for a in acts]
        if k > last:
            assert acts == []
            continue
        assert Op.STEP not in ops
        assert ops.count(Op.FORWARD) == ops.count(Op.BACKWARD) == 4
        assert ops.count(Op.RECV_ACT) == (4 if k > 0 else 0)
        assert ops.count(Op.SEND_ACT) == (4 if k < last else 0)
        assert ops.count(Op.RECV_GRAD) == (4 if k < last else 0)  # the decode comes back down
        assert ops.count(Op.SEND_GRAD) == (4 if k > 0 else 0)
        for j in range(4):  # each microbatch's decode after its forward; below the top, after
            assert acts.index(schedules.B(j)) > acts.index(schedules.F(j))  # what came back
            if k < last:
                assert acts.index(schedules.B(j)) > acts.index(schedules.Action(Op.RECV_GRAD, j))


def test_al_inference_plan_through_layer_0_is_stage_0_alone():
    plan = schedules.build(schedules.AssociatedLearning(inference_layer=0), 3, 2, training=False)
    assert plan == [[schedules.F(0), schedules.F(1), schedules.B(0), schedules.B(1)], [], []]


def test_al_schedule_object():
    AL = schedules.AssociatedLearning
    assert AL(inference_layer=1) == AL(inference_layer=1)
    assert AL(inference_layer=1) != AL()
    assert AL(first_loss="mse") != AL()
    with pytest.raises(ScheduleError, match=r"AssociatedLearning\(inference_layer=3\) but there are only 3 stages"):
        schedules.build(AL(inference_layer=3), 3, 2, training=False)


def test_al_options_belong_to_the_al_schedule():
    """AL's options given to the runner say where they belong; the runner has no AL keywords."""
    stages = [nn.Linear(4, 4), nn.Linear(4, 2)]
    with pytest.raises(ValueError, match=r"inference_layer is an option of the schedule, not of the runner: pass "
                                         r"schedule=pipeq.schedules.AssociatedLearning\(inference_layer=1\)"):
        pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), SGD, "1f1b", 2, inference_layer=1)
    with pytest.raises(ValueError, match=r"AssociatedLearning\(first_loss='mse'\)"):
        pipeq.PipelineRunner(make_layers(), None, SGD, "al", 2, first_loss="mse")
    for old in ("al_inference_layer", "al_first_loss"):  # no aliases: an unknown argument, as in Python
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{old}'"):
            pipeq.PipelineRunner(make_layers(), None, SGD, "al", 2, **{old: 1})
    r = pipeq.PipelineRunner(make_layers(), None, SGD, schedules.AssociatedLearning(inference_layer=1), 2,
                             mode="simulated")
    assert r.schedule == schedules.AssociatedLearning(inference_layer=1)
    assert pipeq.PipelineRunner(make_layers(), None, SGD, "al", 2, mode="simulated").schedule == schedules.AssociatedLearning()
