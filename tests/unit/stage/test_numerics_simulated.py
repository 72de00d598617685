"""Mixed precision, loss scaling, clipping by the global norm, finiteness checks and recomputation in simulated mode, held against what one process does with the whole model; the settings refused."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import pipeq
from numerics_cases import SGD, assert_close, data, mlp, reference, run
from pipeq.stage import numerics
from pipeq.errors import PipelineError
from models import flat_state


# -- clipping ------------------------------------------------------------------------------------
def four_stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(6, 16), nn.Tanh()), nn.Sequential(nn.Linear(16, 16), nn.Tanh()),
            nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 4)]


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("schedule", ["fill-drain", "1f1b", "zbv", "interleaved-1f1b"])
def test_clipping_equals_clip_grad_norm_on_the_whole_model(schedule, norm_type):
    """One stage per process, or two (zbv, interleaved 1F1B: the statistics combine every stage
    of every process, those of one process in memory)."""
    stages = mlp() if schedule in ("fill-drain", "1f1b") else four_stages()
    batches = data(3)
    want = reference(stages, batches, clip=0.05, norm_type=norm_type)
    got, _, _ = run(stages, batches, schedule=schedule, microbatches=4, clip_grad_norm=0.05,
                    clip_norm_type=norm_type)
    assert_close(got, want, atol=1e-6)
    unclipped = reference(stages, batches)
    assert (got["0.weight"] - unclipped["0.weight"]).abs().max() > 1e-3  # it did clip


# -- mixed precision -------------------------------------------------------------------------------
def test_bf16_equals_single_process_autocast_to_bf16_tolerance():
    batches = data(3)
    want = reference(mlp(), batches, autocast=torch.bfloat16)
    got, losses, _ = run(mlp(), batches, precision="bf16")
    assert_close(got, want, atol=2e-2)
    fp32 = reference(mlp(), batches)
    assert all(v.dtype == torch.float32 for v in got.values())  # master weights stay fp32
    assert max((got[k] - fp32[k]).abs().max() for k in got) > 1e-5  # bf16 did run


def test_fp16_scales_and_skips_together_as_one_grad_scaler():
    """A batch that overflows float16 is skipped on every stage, and the scale halves on all."""
    batches = data(4)
    batches[1] = (batches[1][0] * 1e5, batches[1][1])  # inf in the forward: every gradient NaN
    scaler = torch.amp.GradScaler("cpu")
    want = reference(mlp(), batches, autocast=torch.float16, scaler=scaler)
    got, losses, stats = run(mlp(), batches, precision="fp16")
    assert_close(got, want, atol=1e-4)
    assert not math.isfinite(losses[1]) and all(math.isfinite(v) for v in losses[:1] + losses[2:])
    assert [s["skipped_steps"] for s in stats] == [1, 1, 1]
    assert scaler.get_scale() == 32768.0


def test_loss_scaler_matches_grad_scaler_update_rule():
    s = numerics.LossScaler(torch.device("cpu"), init_scale=8.0, growth_interval=2)
    ref = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2)
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.0)
    for found in (False, False, True, False, False, False):
        g = torch.full((3,), math.inf if found else 1.0)
        p.grad = ref.scale(g.clone())
        ref.step(opt)
        ref.update()
        assert s.unscale_([g.clone() * float(s.scale)]) is found
        s.update(found)
        assert float(s.scale) == ref.get_scale()


def test_check_finite_names_the_stage_and_microbatch_of_a_nan_input_before_any_step():
    batches = data(1)
    x, y = batches[0]
    x = x.clone()
    x[10, 2] = math.nan  # microbatch 2 of [4, 4, 4]
    stages = mlp()
    runner = pipeq.PipelineRunner(copy.deepcopy(stages), nn.CrossEntropyLoss(), SGD, microbatches=3,
                                  mode="simulated", check_finite="raise")
    with runner:
        with pytest.raises(PipelineError, match=r"stage 0: the input x of microbatch 2 \(step 1\) holds NaN"):
            runner.step(x, y)
        assert_close(runner.state_dict(), flat_state(stages), atol=0)  # no weight changed


def test_check_finite_skip_skips_the_step_on_every_stage():
    batches = data(3)
    bad = (batches[1][0].clone(), batches[1][1])
    bad[0][3, 1] = math.inf
    want = reference(mlp(), [batches[0], batches[2]])
    got, losses, stats = run(mlp(), [batches[0], bad, batches[2]], check_finite="skip")
    assert_close(got, want, atol=1e-6)
    # the loss looks fine (tanh saturates at Inf) but the first layer's gradient is NaN (0 x Inf)
    assert math.isfinite(losses[1]) and [s["skipped_steps"] for s in stats] == [1, 1, 1]


# -- recomputation ----------------------------------------------------------------------------------------
def dropout_bn(seed: int = 3) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.BatchNorm1d(16), nn.ReLU()),
            nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 4))]


@pytest.mark.parametrize("recompute", [True, [False, True]])
@pytest.mark.parametrize("schedule", ["fill-drain", "1f1b"])
def test_recompute_equals_no_recompute_exactly(schedule, recompute):
    batches = data(3)
    states = []
    for rc in (False, recompute):
        torch.manual_seed(11)  # the stages' dropout streams
        state, losses, _ = run(dropout_bn(), batches, schedule=schedule, recompute=rc)
        states.append((state, losses))
    (a, la), (b, lb) = states
    assert la == lb
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("line, message", [
    ('precision = "fp8"', "precision must be one of"),
    ("clip_grad_norm = -1.0", "clip_grad_norm must be a positive number"),
    ('check_finite = "warn"', "check_finite must be False"),
    ("recompute = [true]", "recompute must be True, False or a list of 3 booleans"),
    ('recompute = "yes"', "recompute must be a boolean or an array"),
])
def test_a_job_with_bad_numerics_is_refused_naming_the_setting(tmp_path, capsys, line, message):
    from job_files import MLP, launch_code, write

    assert launch_code(write(tmp_path, MLP + line + f'\nsteps = 1\nout = "{tmp_path / "out"}"\n')) == 2
    assert message in capsys.readouterr().err


def test_nodes_compare_how_their_stages_compute():
    """A node whose job file says another precision (or clipping...) is refused by the agent's
    comparison of the job identities, naming the setting: it would train apart."""
    import json

    from pipeq.launch.agent import _differences
    from pipeq.control.processes import job_identity

    def identity(**kw):  # as it comes through the signed JSON store entry
        return json.loads(json.dumps(job_identity(b"", "1f1b", numerics.check(**{
            "precision": "fp32", "clip_grad_norm": None, "clip_norm_type": 2.0, "check_finite": False,
            "recompute": False, "n_stages": 2, **kw})), allow_nan=False))

    assert _differences(identity(), identity()) == []
    assert _differences(identity(precision="bf16"), identity()) == [
        "numerics.precision is 'bf16' on node 0 but 'fp32' here"]
    assert _differences(identity(clip_grad_norm=1.0, clip_norm_type=math.inf), identity(clip_grad_norm=1.0)) == [
        "numerics.clip_norm_type is 'inf' on node 0 but 2.0 here"]


@pytest.mark.parametrize("schedule", ["async", "global"])
def test_schedules_that_compute_their_own_way_refuse_the_options_naming_them(schedule):
    with pytest.raises(ValueError, match=rf"^clip_grad_norm, recompute: .* computes its own way \(this run: "
                                         rf"schedule '{schedule}'\)"):
        pipeq.PipelineRunner(mlp(), nn.CrossEntropyLoss(), SGD, schedule, mode="simulated", clip_grad_norm=1.0,
                             recompute=True)
