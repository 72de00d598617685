"""Tied weights in simulated mode: a tied embedding and LM head train as in one process, the copies stay bitwise equal, and checkpoints keep them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeq
from pipeq.testing import backend_of
from pipeq.stage import numerics

from tie_cases import ADAM, SGD, TIE, TIE3, assert_close, copies, lm_batches, lm_stages, reference


def runner(stages, ties=(TIE,), schedule="1f1b", make_opt=SGD, **kw):
    return pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), make_opt, schedule, 2, mode="simulated",
                                ties=[list(t) for t in ties], **kw)


def assert_copies_equal(r) -> None:
    held = copies(backend_of(r).get_state())
    assert len(held) >= 2 and all(torch.equal(c, held[0]) for c in held)


@pytest.mark.parametrize("schedule", ["1f1b", "fill-drain"])
@pytest.mark.parametrize("spare", [False, True], ids=["two-copies", "three-copies-one-unused"])
def test_tied_stages_train_as_the_tied_model_in_one_process(schedule, spare):
    data = lm_batches(4)
    losses, states = reference(data, spare=spare)
    with runner(lm_stages(spare=spare), ties=[TIE3 if spare else TIE], schedule=schedule) as r:
        for i, (x, y) in enumerate(data):
            assert r.step(x, y) == pytest.approx(losses[i], abs=1e-5)
            assert_copies_equal(r)
            assert_close(r.state_dict(), states[i])  # the tie once, under its key


def test_clipping_counts_a_tied_parameter_once():
    data = lm_batches(4, seed=2)
    losses, states = reference(data, spare=True, clip=0.05)
    unclipped, _ = reference(data, spare=True)
    assert losses[1] != pytest.approx(unclipped[1], abs=1e-3)  # the clip bites
    with runner(lm_stages(spare=True), ties=[TIE3], clip_grad_norm=0.05, check_finite="skip") as r:
        for i, (x, y) in enumerate(data):
            assert r.step(x, y) == pytest.approx(losses[i], abs=1e-5)
            assert_copies_equal(r)
        assert_close(r.state_dict(), states[-1])


@pytest.mark.skipif(not torch.amp.autocast_mode.is_autocast_available("cpu"), reason="no float16 autocast on CPU")
def test_fp16_sums_the_scaled_gradients_and_the_copies_stay_equal():
    try:
        numerics.check_device(numerics.Numerics(precision="fp16"), ["cpu"])
    except ValueError:
        pytest.skip("fp16 autocast unavailable on this CPU")
    with runner(lm_stages(), precision="fp16") as r:
        for x, y in lm_batches(3):
            assert torch.isfinite(torch.tensor(r.step(x, y)))
            assert_copies_equal(r)
        assert r.stats()[0]["skipped_steps"] == r.stats()[2]["skipped_steps"]


def test_a_checkpoint_restores_every_copy_and_loads_into_another_cut(tmp_path):
    data = lm_batches(6, seed=3)
    with runner(lm_stages(), make_opt=ADAM) as r:
        for x, y in data[:3]:
            r.step(x, y)
        r.save(str(tmp_path / "c"))
        state = r.state_dict()
        rest = [r.step(x, y) for x, y in data[3:]]
    assert list(state) == ["0.weight", "1.weight", "1.bias", "2.weight", "2.bias"]
    with runner(lm_stages(seed=5), make_opt=ADAM) as again:  # other initial weights: all replaced
        again.load(str(tmp_path / "c"))
        assert_copies_equal(again)
        assert [again.step(x, y) for x, y in data[3:]] == rest  # the same optimizer state on every copy
        assert_copies_equal(again)
    s = lm_stages(seed=6)
    two = [s[0], nn.Sequential(s[1], *s[2])]  # the same layers in two stages: the tie still spans them
    with runner(two, make_opt=ADAM) as cut:
        cut.load(str(tmp_path / "c"))
        assert [cut.step(x, y) for x, y in data[3:]] == pytest.approx(rest, abs=1e-6)
    with runner(lm_stages(seed=7)) as loaded:
        loaded.load_state_dict(state)
        assert_copies_equal(loaded)
        assert_close(loaded.state_dict(), state, atol=0)
