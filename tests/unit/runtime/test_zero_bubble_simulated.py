"""ZB-H1 (split backward) in simulated mode equals plain single-process training: uneven microbatches, clipping, recompute, fp16, tied weights, a stream; its I and W rows are traced."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pipeq
from pipeq.testing import backend_of
from models import float64_data, float64_stages3
from numerics_cases import assert_close, data, mlp, reference, run
from pipeq.runtime.interpreter import execute
from pipeq.schedules import build
from pipeq.stage.executor import StageExecutor
from pipeq.stage.spec import StageSpec
from pipeq.trace import format as trace
from runner_cases import assert_matches_reference
from runner_cases import run as run_runner
from tie_cases import SGD as TIE_SGD
from tie_cases import TIE3, copies, lm_batches, lm_stages
from tie_cases import assert_close as assert_tie_close
from tie_cases import reference as tie_reference

pytestmark = pytest.mark.timeout(120)

SGD64 = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


@pytest.mark.parametrize("schedule", ["zb-h1", "zb1p"])
def test_zb_h1_equals_single_process_training_with_uneven_microbatches(schedule):
    stages = float64_stages3()
    batches = [float64_data(10, seed) for seed in (1, 2, 3)]  # 4 microbatches of 3, 3, 2, 2
    losses, state, out = run_runner(stages, batches, schedule=schedule, microbatches=4, mode="simulated", opt=SGD64)
    model = assert_matches_reference(stages, batches, losses, state, opt=SGD64, tol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(out, model(batches[0][0]), atol=1e-12, rtol=0)


def test_zb_h1_with_more_stages_than_microbatches_and_with_more_microbatches():
    stages = float64_stages3()
    batches = [float64_data(11, seed) for seed in (4, 5)]
    for m in (2, 7):
        losses, state, _ = run_runner(stages, batches, schedule="zb-h1", microbatches=m, mode="simulated", opt=SGD64)
        assert_matches_reference(stages, batches, losses, state, opt=SGD64, tol=1e-12)


def test_zb_h1_clips_by_the_global_norm_after_every_W():
    batches = data(3)
    want = reference(mlp(), batches, clip=0.05)
    got, _, _ = run(mlp(), batches, schedule="zb-h1", clip_grad_norm=0.05)
    assert_close(got, want, atol=1e-6)
    assert (got["0.weight"] - reference(mlp(), batches)["0.weight"]).abs().max() > 1e-3  # it did clip


def test_zb_h1_with_recompute_equals_without():
    batches = data(3)
    got, losses, stats = run(mlp(), batches, schedule="zb-h1", recompute=True)
    assert_close(got, reference(mlp(), batches), atol=1e-6)
    assert all(s["recompute"] for s in stats)
    plain, plain_losses, _ = run(mlp(), batches, schedule="1f1b", recompute=True)
    assert losses == plain_losses
    assert all(torch.equal(got[k], plain[k]) for k in got)  # the same bits as a whole backward


@pytest.mark.parametrize("options", [dict(precision="bf16"), dict(check_finite="skip", clip_grad_norm=0.1),
                                     dict(recompute=[False, True, True], precision="bf16")],
                         ids=["bf16", "check_finite-clip", "recompute-some-bf16"])
def test_zb_h1_gives_1f1b_bits_under_the_numerics_options(options):
    batches = data(3)
    zb, zb_losses, _ = run(mlp(), batches, schedule="zb-h1", microbatches=4, **options)
    one, one_losses, _ = run(mlp(), batches, schedule="1f1b", microbatches=4, **options)
    assert zb_losses == one_losses
    assert_close(zb, one, atol=0)


def test_zb_h1_fp16_scales_and_skips_as_1f1b():
    batches = data(4)
    batches[1] = (batches[1][0] * 1e5, batches[1][1])  # overflows float16: the step is skipped
    try:
        one, one_losses, one_stats = run(mlp(), batches, schedule="1f1b", precision="fp16")
    except (ValueError, pipeq.PipelineError) as exc:  # pragma: no cover - a CPU without fp16 autocast
        pytest.skip(f"fp16 unavailable: {exc}")
    zb, zb_losses, zb_stats = run(mlp(), batches, schedule="zb-h1", precision="fp16")
    assert [s["skipped_steps"] for s in zb_stats] == [s["skipped_steps"] for s in one_stats] == [1, 1, 1]
    assert_close(zb, one, atol=0)
    assert str(zb_losses) == str(one_losses)


def test_zb_h1_with_tied_weights_sums_them_after_every_W():
    batches = lm_batches(3)
    losses, states = tie_reference(batches, spare=True)
    with pipeq.PipelineRunner(lm_stages(spare=True), nn.CrossEntropyLoss(), TIE_SGD,
                              "zb-h1", 2, mode="simulated", ties=[list(TIE3)]) as r:
        for i, (x, y) in enumerate(batches):
            assert r.step(x, y) == pytest.approx(losses[i], abs=1e-5)
            held = copies(backend_of(r).get_state())
            assert all(torch.equal(c, held[0]) for c in held)
        assert_tie_close(r.state_dict(), states[-1])


def test_zb_h1_streamed_equals_the_step_loop():
    stages = float64_stages3()
    batches = [float64_data(8, seed) for seed in (1, 2, 3)]

    def runner():
        return pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), SGD64, "zb-h1", 4, mode="simulated")

    with runner() as r:
        stepped = [r.step(x, y) for x, y in batches]
        want = r.state_dict()
    with runner() as r:
        streamed = list(r.stream(batches))
        got = r.state_dict()
    assert streamed == stepped
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_the_interpreter_traces_I_and_W_rows_and_counts_the_backwards_at_W():
    spec = StageSpec(nn.Linear(3, 2), functools.partial(torch.optim.SGD, lr=0.1), nn.MSELoss())
    ex = StageExecutor(0, 1, spec, torch.device("cpu"))
    started = []

    class Sync:  # data parallelism's all-reduce: it must start after the step's last W
        def arm(self):
            pass

        def start(self):
            started.append([a for a in ex.backprop.pending])

        def finish(self):
            pass

    ex.stepper.parallel = Sync()
    ex.begin(0, [2, 2], True, x=torch.randn(4, 3), target=torch.randn(4, 2), weights=[0.5, 0.5])
    rows: list = []
    for _ in execute([ex], build("zb-h1", 1, 2)[0], [rows]):
        raise AssertionError("one stage communicates nothing")
    assert [(trace.OPS[r[0]][0], r[1], r[2]) for r in rows] == [
        ("F", 0, 0), ("I", 0, 0), ("W", 0, 0), ("F", 0, 1), ("I", 0, 1), ("W", 0, 1), ("STEP", 0, -1)]
    assert started == [[]]  # once, after the last W, nothing left pending
    assert trace.OPS[trace.I][1] == trace.OPS[trace.W][1] == trace.BACKWARD_CAT
