"""Interlocking backpropagation: global, local, pairwise and n-wise schedules with auxiliary heads.

N stages; stage k < N-1 owns head_k, L_k = aux_loss(head_k(a_k), y), L_{N-1} = loss_fn(a_{N-1}, y).
main_k is trained by L_{min(k+d, N-1)} only (d = 0 local, 1 pairwise, N-1 global); head_k by L_k
(on a detached a_k when d >= 1). Checked here against hand-computed numbers, a single-process
reference written from that rule, each other (n-wise d=1 / pairwise, d=N-1 / global / 1f1b), process
mode against simulated mode, on real data (digits), and on the lowered schedules themselves.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import pipeq
from pipeq import schedules
from pipeq.checkpoint import flat_model
from pipeq.errors import PipelineError
from pipeq.schedules import Action, Op

from interlock_cases import (
    FAST, H, MOMENTUM, SCHEMES, SCHEME_IDS, TWO_SAMPLES, W, assert_state_equal, batches, digits_accuracy,
    digits_split, linear_heads, linear_stages, run, scalar_step, scheme
)
from models import Chain, Mul, SumSq

pytestmark = pytest.mark.timeout(300)


# -- the scalar chain ---------------------------------------------------------------------------
def hand_grad(t, k, x, y, w=W, h=H):
    """dL_t/dw_k (k <= t) of one sample on the scalar chain, by the chain rule (no autograd):

    a_k = x w_0 ... w_k; z_t = h_t a_t (h_3 = 1: the real loss reads a_3); L_t = (z_t - y)^2
    => dL_t/da_t = 2 (z_t - y) h_t and da_t/dw_k = w_{k+1} ... w_t * a_{k-1} (a_{-1} = x)."""
    a = [x]
    for v in w:
        a.append(a[-1] * v)  # a[i + 1] = a_i
    ht = h[t] if t < len(w) - 1 else 1.0
    g = 2 * (ht * a[t + 1] - y) * ht
    for i in range(k + 1, t + 1):
        g *= w[i]
    return g * a[k]


def hand_step(d, samples, share, w=W, h=H):
    """Main weights after one SGD(lr 1) step: w_k - share * sum over samples of dL_t(k)/dw_k."""
    n = len(w)
    return [w[k] - share * sum(hand_grad(min(k + d, n - 1), k, x, y, w, h) for x, y in samples)
            for k in range(n)]


# One sample x = 1, y = 0.5. Forward: a = (2, 6, 3, 4.5); heads z_k = h_k a_k = (2, 12, 1.5).
# dL_k/dz_k = 2 (z_k - y) = (3, 23, 2); dL_3/da_3 = 2 (4.5 - 0.5) = 8.
# dL_k/da_k = h_k dL_k/dz_k = (3, 46, 1) for the heads, 8 for the real loss.
# dL_t/dw_k = dL_t/da_t * w_{k+1}..w_t * a_{k-1}  (a_{-1} = x = 1).
ONE_SAMPLE = {
    # every stage from L_3: dw_3 = 8 a_2; dw_2 = 8 w_3 a_1; dw_1 = 8 w_3 w_2 a_0; dw_0 = 8 w_3 w_2 w_1 x
    "global": [2 - 8 * 1.5 * 0.5 * 3 * 1, 3 - 8 * 1.5 * 0.5 * 2, 0.5 - 8 * 1.5 * 6, 1.5 - 8 * 3],
    # stage k from its own head: dw_k = dL_k/da_k * a_{k-1}
    "local": [2 - 3 * 1, 3 - 46 * 2, 0.5 - 1 * 6, 1.5 - 8 * 3],
    # stage k from L_{k+1}: dw_0 = 46 w_1 x, dw_1 = 1 w_2 a_0, dw_2 = 8 w_3 a_1
    "pairwise": [2 - 46 * 3 * 1, 3 - 1 * 0.5 * 2, 0.5 - 8 * 1.5 * 6, 1.5 - 8 * 3],
    # stage k from L_{min(k+2, 3)}: dw_0 = 1 w_2 w_1 x, dw_1 = 8 w_3 w_2 a_0, dw_2 = 8 w_3 a_1
    "nwise2": [2 - 1 * 0.5 * 3 * 1, 3 - 8 * 1.5 * 0.5 * 2, 0.5 - 8 * 1.5 * 6, 1.5 - 8 * 3],
}
DISTANCE = {"global": 3, "local": 0, "pairwise": 1, "nwise2": 2}


@pytest.mark.parametrize(("schedule", "d"), SCHEMES, ids=SCHEME_IDS)
def test_scalar_chain_one_step_by_hand(schedule, d):
    name = SCHEME_IDS[SCHEMES.index((schedule, d))]
    assert scalar_step(schedule, d, [1.0], [0.5]) == pytest.approx(ONE_SAMPLE[name], abs=1e-5)
    # the closed form below agrees with the table (it serves the uneven case that follows)
    assert hand_step(DISTANCE[name], [(1.0, 0.5)], 1.0) == pytest.approx(ONE_SAMPLE[name])


@pytest.mark.parametrize(("schedule", "d"), SCHEMES, ids=SCHEME_IDS)
def test_scalar_chain_two_microbatches_accumulate(schedule, d):
    name = SCHEME_IDS[SCHEMES.index((schedule, d))]
    samples = [(1.0, 0.5), (-2.0, 1.0)]
    xs, ys = [s[0] for s in samples], [s[1] for s in samples]
    # "sum": each microbatch's loss has weight 1, its gradients add up over the step
    got = scalar_step(schedule, d, xs, ys, microbatches=2)
    assert got == pytest.approx(TWO_SAMPLES[name], abs=1e-4)
    assert hand_step(DISTANCE[name], samples, 1.0) == pytest.approx(TWO_SAMPLES[name])
    # "mean": each microbatch's weight is its share (1/2): half the update
    half = [w0 - (w0 - w1) / 2 for w0, w1 in zip(W, TWO_SAMPLES[name])]
    got = scalar_step(schedule, d, xs, ys, microbatches=2, reduction="mean")
    assert got == pytest.approx(half, abs=1e-4)
    # uneven microbatches: 3 samples split 2 + 1, "mean" -> shares 2/3 and 1/3 of per-microbatch
    # means, i.e. 1/3 of every sample's gradient (heads' losses weighted alike)
    samples3 = samples + [(0.5, 0.0)]
    got = scalar_step(schedule, d, [s[0] for s in samples3], [s[1] for s in samples3],
                      microbatches=2, reduction="mean")
    assert got == pytest.approx(hand_step(DISTANCE[name], samples3, 1 / 3), abs=1e-4)


# -- small Linear stages with Linear heads -----------------------------------------------------------
def reference_interlock(stages, heads, d, data, make_opt, loss_fn, aux_loss):
    """One process, plain autograd, the routing rule written directly: main_k gets dL_t/dtheta_k,
    t = min(k + d, N - 1), each loss built from scratch on the main path; head_k gets dL_k."""
    stages, heads = copy.deepcopy(stages), copy.deepcopy(heads)
    n = len(stages)
    opts = [make_opt(list(stages[k].parameters()) + (list(heads[k].parameters()) if k < n - 1 else []))
            for k in range(n)]
    losses = []

    def upto(x, t):
        a = x
        for i in range(t + 1):
            a = stages[i](a)
        return a

    def loss_of(x, y, t):
        a = upto(x, t)
        return loss_fn(a, y) if t == n - 1 else aux_loss(heads[t](a), y)

    for x, y in data:
        losses.append(loss_of(x, y, n - 1).item())
        grads = {}
        for k in range(n):
            params = list(stages[k].parameters())
            grads.update(zip(params, torch.autograd.grad(loss_of(x, y, min(k + d, n - 1)), params)))
        for k in range(n - 1):
            params = list(heads[k].parameters())
            with torch.no_grad():
                a = upto(x, k)
            grads.update(zip(params, torch.autograd.grad(aux_loss(heads[k](a), y), params)))
        for p, g in grads.items():
            p.grad = g
        for o in opts:
            o.step()
    return stages, heads, losses


@pytest.mark.parametrize(("schedule", "d"), SCHEMES, ids=SCHEME_IDS)
def test_runner_matches_single_process_reference(schedule, d):
    data = batches(10)
    dist = {"global": 3, "local": 0, "pairwise": 1, "nwise": d}[schedule]
    ref_stages, _, ref_losses = reference_interlock(
        linear_stages(), linear_heads(), dist, data, MOMENTUM, nn.CrossEntropyLoss(), nn.CrossEntropyLoss())
    sd, losses, out = run(schedule, d, data=data, x_eval=data[0][0])  # 10 samples in 4 + 3 + 3
    assert_state_equal(sd, flat_model(ref_stages).state_dict(), exact=False, atol=1e-5)
    assert losses == pytest.approx(ref_losses, abs=1e-5)  # step returns the real loss only
    with torch.no_grad():
        torch.testing.assert_close(out, Chain(*ref_stages)(data[0][0]), atol=1e-5, rtol=0)


def test_schemes_differ_from_each_other():
    """Guards the reference test: the four routings give four different models."""
    data = batches(3)
    states = [run(s, d, data=data)[0] for s, d in SCHEMES]
    for i in range(len(states)):
        for j in range(i + 1, len(states)):
            assert not all(torch.allclose(states[i][k], states[j][k]) for k in states[i]), (i, j)


def test_nwise_extremes_equal_pairwise_and_global_exactly():
    data = batches(10, seed=5)
    pairwise = run("pairwise", data=data)
    nwise1 = run("nwise", 1, data=data)
    assert_state_equal(pairwise[0], nwise1[0])
    assert pairwise[1] == nwise1[1]
    glob = run("global", data=data)
    for d in (3, 7):  # d >= N-1 is global
        nw = run("nwise", d, data=data)
        assert_state_equal(glob[0], nw[0])
        assert glob[1] == nw[1]


def test_global_equals_plain_1f1b():
    data = batches(10, seed=6)
    plain = pipeq.PipelineRunner(linear_stages(), nn.CrossEntropyLoss(), MOMENTUM, "1f1b", 3,
                                 mode="simulated")
    with plain:
        plain_losses = [plain.step(x, y) for x, y in data]
        plain_sd = plain.state_dict()
    for heads in ("default", None):  # with heads (trained, but unused by main) or without
        sd, losses, _ = run("global", heads=heads, data=data)
        assert_state_equal(sd, plain_sd)
        assert losses == plain_losses


# -- which head trains which stage ------------------------------------------------------------------
# After one step, changing head_k's initial weights changes exactly these main modules.
HEAD_REACHES = {
    "global": {0: [], 1: [], 2: []},
    "local": {0: [0], 1: [1], 2: [2]},
    "pairwise": {0: [], 1: [0], 2: [1]},  # main_{k-1} is trained by L_k
    "nwise2": {0: [], 1: [], 2: [0]},  # main_0 by L_2, main_1 and main_2 by L_3
}


@pytest.mark.parametrize(("schedule", "d"), SCHEMES, ids=SCHEME_IDS)
def test_head_reaches_only_the_stages_it_trains(schedule, d):
    name = SCHEME_IDS[SCHEMES.index((schedule, d))]
    data = batches(1, seed=9)
    base = run(schedule, d, data=data)[0]
    for k in range(3):
        heads = linear_heads()
        heads[k] = linear_heads(seed=100 + k)[k]  # another head on stage k only
        other = run(schedule, d, heads=heads, data=data)[0]
        # the flat model's names: stage k's Linear is layer 2k (each but the last is Linear + ReLU)
        changed = sorted({int(key.split(".")[0]) // 2 for key in base if not torch.equal(base[key], other[key])})
        assert changed == HEAD_REACHES[name][k], f"head {k}"
        assert base["6.weight"].equal(other["6.weight"])  # the last stage: the real loss only


def test_pairwise_stage_gets_no_gradient_from_its_own_head():
    # head_1 = 2 (default) or 5: main_1 is trained by L_2 only, so w_1 is 2 (= 3 - 1 * 0.5 * 2,
    # see ONE_SAMPLE) either way; main_0 is trained by L_1 = (h_1 w_1 w_0 x - y)^2:
    # dw_0 = 2 (h_1 a_1 - y) h_1 w_1 x, with a_1 = 6: h_1 = 2 -> 46 * 3 = 138; h_1 = 5 -> 2 * 29.5 * 5 * 3 = 885
    for h1, dw0 in ((2.0, 2 * (2 * 6 - 0.5) * 2 * 3), (5.0, 2 * (5 * 6 - 0.5) * 5 * 3)):
        w = scalar_step("pairwise", None, [1.0], [0.5], h=(1.0, h1, 0.5))
        assert w[1] == pytest.approx(2.0)
        assert w[0] == pytest.approx(2 - dw0)
    # head_0 = 1 or 3: nothing in pairwise (L_0 trains head_0 only) ...
    for h0 in (1.0, 3.0):
        w = scalar_step("pairwise", None, [1.0], [0.5], h=(h0, 2.0, 0.5))
        assert w == pytest.approx(ONE_SAMPLE["pairwise"])
    # ... but local trains main_0 with L_0: dw_0 = 2 (h_0 a_0 - y) h_0 x = 2 * 5.5 * 3 = 33
    w = scalar_step("local", None, [1.0], [0.5], h=(3.0, 2.0, 0.5))
    assert w[0] == pytest.approx(2 - 2 * (3 * 2 - 0.5) * 3 * 1)
    assert w[0] != pytest.approx(ONE_SAMPLE["local"][0])


# -- what a user relies on ------------------------------------------------------------------------
def test_state_predict_and_loss_use_the_main_path():
    data = batches(3, seed=10)
    stages = linear_stages()
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), MOMENTUM, "pairwise", 3,
                                  mode="simulated", aux_heads=linear_heads())
    with runner:
        sd0 = runner.state_dict()
        assert list(sd0) == list(flat_model(stages).state_dict())  # no head keys
        with torch.no_grad():
            real = nn.CrossEntropyLoss()(Chain(*stages)(data[0][0]), data[0][1]).item()
        assert runner.step(*data[0]) == pytest.approx(real, abs=1e-6)  # the real loss, no aux term
        for x, y in data[1:]:
            runner.step(x, y)
        sd = runner.state_dict()
        model = Chain(*linear_stages())
        flat_model(model).load_state_dict(sd)
        x = data[0][0]
        with torch.no_grad():
            torch.testing.assert_close(runner.predict(x), model(x), atol=1e-6, rtol=0)
        runner.load_state_dict(sd0)  # back to the start: the main path predicts as before
        with torch.no_grad():
            torch.testing.assert_close(runner.predict(x), Chain(*stages)(x), atol=1e-6, rtol=0)


# -- real data ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def digits():
    return digits_split()


@pytest.mark.parametrize(("schedule", "d", "least"),
                         [("global", None, 0.90), ("local", None, 0.5), ("pairwise", None, 0.90),
                          ("nwise", 2, 0.5)], ids=SCHEME_IDS)
def test_every_scheme_learns_digits(digits, schedule, d, least):
    accuracy = digits_accuracy(digits, schedule, d)
    assert accuracy > least, f"{schedule}: held-out accuracy {accuracy:.1%} (chance is 10%)"


# -- errors ---------------------------------------------------------------------------------------
def make(schedule="pairwise", heads="default", mode="simulated", **kw):
    return pipeq.PipelineRunner(linear_stages(), nn.CrossEntropyLoss(), MOMENTUM, schedule, 2, mode=mode,
                                aux_heads=linear_heads() if heads == "default" else heads, **FAST, **kw)


def test_argument_errors():
    with pytest.raises(ValueError, match="aux_heads.*interlocking.*1f1b"):
        make("1f1b")
    with pytest.raises(ValueError, match="1f1b"):
        make("1f1b", heads=None, aux_loss=nn.CrossEntropyLoss())
    for wrong in (linear_heads()[:2], linear_heads() + [nn.Linear(4, 4)]):
        with pytest.raises(ValueError, match=r"aux_heads must be a list of 3 nn\.Module"):
            make(heads=wrong)
    with pytest.raises(ValueError, match="3 nn.Module"):
        make(heads=[nn.Linear(8, 4), nn.Linear(8, 4), "head"])
    with pytest.raises(ValueError, match=r"Interlock\('nwise', distance=d\)"):
        make("nwise")
    for bad in (0, -1, 1.5, "2", None):
        with pytest.raises(ValueError, match="needs distance=d"):
            pipeq.schedules.Interlock("nwise", distance=bad)
    for name in ("pairwise", "global", "local"):
        with pytest.raises(ValueError, match="distance applies to Interlock\\('nwise'\\) only"):
            pipeq.schedules.Interlock(name, distance=1)
    # the schedule's option given to the runner says where it belongs; the runner has no such keyword
    with pytest.raises(ValueError, match=r"distance is an option of the schedule, not of the runner: pass "
                                         r"schedule=pipeq.schedules.Interlock\('nwise', distance=2\)"):
        make("nwise", distance=2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'interlock_distance'"):
        make("nwise", interlock_distance=2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'interlock_distanse'"):
        make("nwise", interlock_distanse=2)
    with pytest.raises(ValueError, match="aux_loss must be callable"):
        make(aux_loss="ce")


@pytest.mark.parametrize("schedule", ["local", "pairwise"])
def test_missing_heads_are_named(schedule):
    # refused when the runner is built, before any process starts, in either mode
    for mode in ("simulated", "process"):
        with pytest.raises(ValueError, match=rf"schedule '{schedule}' trains with auxiliary heads: pass aux_heads="):
            make(schedule, heads=None, mode=mode)
    make(scheme("nwise", 3), heads=None)  # d = N-1 is global: no head needed


def test_tuple_boundary_is_refused():
    from models import TwoIn, TwoOut

    runner = pipeq.PipelineRunner([TwoOut(6, 8), TwoIn(8, 4)], nn.CrossEntropyLoss(), MOMENTUM, "pairwise", 2,
                                  mode="simulated", aux_heads=[nn.Linear(8, 4)])
    with runner, pytest.raises(PipelineError, match="one tensor"):
        runner.step(*batches(1)[0])


# -- the schedules --------------------------------------------------------------------------------
def test_pairwise_sends_its_head_gradient_right_after_the_forward():
    lowered = schedules.build("pairwise", 4, 4)
    for k in (1, 2):
        acts = lowered[k]
        for i, a in enumerate(acts):
            if a.op is Op.FORWARD:
                assert acts[i + 1 : i + 3] == [Action(Op.SEND_ACT, a.microbatch), Action(Op.SEND_GRAD, a.microbatch)]
            if a.op is Op.BACKWARD:
                assert acts[i + 1].op is not Op.SEND_GRAD
        assert sum(a.op is Op.SEND_GRAD for a in acts) == 4
    assert not any(a.op is Op.SEND_GRAD for a in lowered[0])
    # the last stage sends dL_3/da_2 after each backward; it receives none
    last = lowered[3]
    assert not any(a.op is Op.RECV_GRAD for a in last)
    for i, a in enumerate(last):
        if a.op is Op.BACKWARD:
            assert last[i + 1] == Action(Op.SEND_GRAD, a.microbatch)
    for acts in lowered:
        assert acts[-1] == schedules.STEP


def test_local_sends_no_gradient():
    for n, m in ((4, 4), (3, 5), (2, 1)):
        lowered = schedules.build("local", n, m)
        for acts in lowered:
            assert not any(a.op in (Op.SEND_GRAD, Op.RECV_GRAD) for a in acts)
            compute = [str(a) for a in acts if a.op in (Op.FORWARD, Op.BACKWARD)]
            assert compute == [s for j in range(m) for s in (f"F{j}", f"B{j}")]  # F0 B0 F1 B1 ...


def test_pairwise_unlocks_the_first_stage():
    def first(timeline, k, op):
        return next(t for t, a in timeline[k] if a.op is op)

    timelines = {}
    for name in ("pairwise", "global"):
        timelines[name] = schedules.dry_run(schedules.build(name, 4, 4), cost={Op.BACKWARD: 2})
    pw, gl = timelines["pairwise"], timelines["global"]
    # pairwise: stage 0's first backward starts before stage 3's first backward has finished
    assert first(pw, 0, Op.BACKWARD) < first(pw, 3, Op.BACKWARD) + 2
    # global (plain backprop) must wait for the whole stack
    assert first(gl, 0, Op.BACKWARD) >= first(gl, 3, Op.BACKWARD) + 2 * 3
    # and stage 0 steps earlier
    assert first(pw, 0, Op.STEP) < first(gl, 0, Op.STEP)


@pytest.mark.parametrize("name", ["global", "local", "pairwise", "nwise1", "nwise2", "nwise3"])
def test_every_scheme_dry_runs(name):
    sched = schedules.Interlock("nwise", int(name[-1])) if name.startswith("nwise") else name
    for n in range(1, 6):
        for m in range(1, 6):
            lowered = schedules.build(sched, n, m)
            for acts in lowered:  # each compute action exactly once per microbatch, STEP last
                assert sorted(str(a) for a in acts if a.op is Op.FORWARD) == sorted(f"F{j}" for j in range(m))
                assert sorted(str(a) for a in acts if a.op is Op.BACKWARD) == sorted(f"B{j}" for j in range(m))


# -- ignored targets and mixed reductions -------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["global", "pairwise", "local"])
def test_all_ignored_microbatch_keeps_the_loss_and_weights_finite(scheme):
    x, y = batches(1, size=8)[0]
    y[4:] = -100  # the second microbatch has nothing to learn from
    plain = pipeq.PipelineRunner(linear_stages(), nn.CrossEntropyLoss(), MOMENTUM, "1f1b", 2, mode="simulated")
    with plain:
        expected = plain.step(x, y)
    runner = make(scheme)
    with runner:
        assert runner.step(x, y) == pytest.approx(expected, abs=1e-6)
        assert all(torch.isfinite(t).all() for t in runner.state_dict().values())


def test_aux_loss_weights_follow_its_own_reduction():
    """A 'mean' head loss under a 'sum' real loss: the result does not depend on the microbatching."""
    got = []
    for m in (1, 2):
        stages = [Mul(2.0), Mul(3.0), Mul(0.5), Mul(1.5)]
        heads = [Mul(1.0), Mul(2.0), Mul(0.5)]
        runner = pipeq.PipelineRunner(stages, SumSq("sum"), functools.partial(torch.optim.SGD, lr=1.0),
                                      "pairwise", m, mode="simulated", aux_heads=heads, aux_loss=SumSq("mean"))
        with runner:
            runner.step(torch.tensor([[1.0], [-2.0]]), torch.tensor([[0.5], [1.0]]))
            got.append([float(v) for v in runner.state_dict().values()])
    assert got[0] == pytest.approx(got[1])
