"""Several stages per process in simulated mode equal plain single-process training: every new schedule, uneven microbatches, bf16, recompute, a stream, checkpoint/resume; refusals. (Clipping: tests/unit/stage/test_numerics_simulated.py, for one stage per process and several alike.)"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import pipeq
from pipeq import schedules
from models import Chain, FailingStepSGD, Raises, batches64, flat_state, stages64
from numerics_cases import assert_close, data
from numerics_cases import run as run_numerics
from runner_cases import assert_matches_reference
from runner_cases import run as run_runner

pytestmark = pytest.mark.timeout(120)

SGD64 = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
#: (schedule, stages given): two processes each, but v-half's four and v-min's three (their caps differ there)
CASES = [("interleaved-1f1b", 4), ("looped-bfs", 4), ("zbv", 4), ("dualpipev", 4), ("zb-h2", 2), ("v-half", 8),
         ("v-min", 6)]


@pytest.mark.parametrize("schedule,n", CASES)
def test_each_schedule_equals_one_process_with_uneven_microbatches(schedule, n):
    stages = stages64(n)
    batches = batches64(3)  # 4 microbatches of 3, 3, 2, 2
    losses, state, out = run_runner(stages, batches, schedule=schedule, microbatches=4, mode="simulated", opt=SGD64)
    model = assert_matches_reference(stages, batches, losses, state, opt=SGD64, tol=1e-12)
    with torch.no_grad():  # predict runs every chunk's forwards, in stage order
        torch.testing.assert_close(out, model(batches[0][0]), atol=1e-12, rtol=0)


def test_interleaved_with_three_stages_per_process_and_more_microbatches():
    stages = stages64(6)
    batches = batches64(2, batch=13)
    losses, state, _ = run_runner(stages, batches, schedule="interleaved-1f1b", microbatches=4, mode="simulated",
                                  opt=SGD64, stages_per_process=3)
    assert_matches_reference(stages, batches, losses, state, opt=SGD64, tol=1e-12)


@pytest.mark.parametrize("schedule", [name for name, _ in CASES])
@pytest.mark.parametrize("options", [dict(precision="bf16"), dict(recompute=True), dict(check_finite="raise"),
                                     dict(clip_grad_norm=0.05)],
                         ids=["bf16", "recompute", "check_finite", "clip"])
def test_each_schedule_gives_1f1b_numbers_under_the_numerics_options(schedule, options):
    stages = [nn.Sequential(nn.Linear(6, 16), nn.Tanh()), nn.Sequential(nn.Linear(16, 16), nn.Tanh()),
              nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 4)]
    batches = data(2)
    got, losses, _ = run_numerics(stages, batches, schedule=schedule, microbatches=4, **options)
    want, want_losses, _ = run_numerics(stages, batches, schedule="1f1b", microbatches=4, **options)
    assert losses == pytest.approx(want_losses, abs=1e-6)
    assert_close(got, want, atol=1e-6)


@pytest.mark.parametrize("schedule,n", CASES)
def test_a_stream_equals_the_step_loop(schedule, n):
    stages = stages64(n)
    batches = batches64(3)
    looped, _, _ = run_runner(stages, batches, schedule=schedule, microbatches=4, mode="simulated", opt=SGD64)
    with pipeq.PipelineRunner(copy.deepcopy(stages), nn.CrossEntropyLoss(), SGD64, schedule, 4,
                              mode="simulated") as r:
        streamed = list(r.stream(batches))
    assert streamed == pytest.approx(looped, abs=1e-12)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv", "zb-h1", "zb-h2"])
def test_checkpoint_and_resume_equal_an_uninterrupted_run(tmp_path, schedule):
    stages = stages64(4)
    batches = batches64(4)
    whole, state, _ = run_runner(stages, batches, schedule=schedule, microbatches=4, mode="simulated", opt=SGD64)
    with pipeq.PipelineRunner(copy.deepcopy(stages), nn.CrossEntropyLoss(), SGD64, schedule, 4,
                              mode="simulated") as r:
        first = [r.step(x, y) for x, y in batches[:2]]
        r.save(tmp_path / "ckpt")
    with pipeq.PipelineRunner(copy.deepcopy(stages), nn.CrossEntropyLoss(), SGD64, schedule, 4,
                              mode="simulated") as r:
        r.load(tmp_path / "ckpt")
        rest = [r.step(x, y) for x, y in batches[2:]]
        resumed = r.state_dict()
    assert first + rest == whole
    assert all(torch.equal(resumed[k], state[k]) for k in state)


def test_the_state_keeps_the_flat_models_names():
    stages = stages64(4)
    with pipeq.PipelineRunner(copy.deepcopy(stages), nn.CrossEntropyLoss(), SGD64, "zbv", 4, mode="simulated") as r:
        assert list(r.state_dict()) == list(flat_state(Chain(*stages)))


@pytest.mark.parametrize("kw,match", [
    (dict(schedule="zbv", stages=3), r"3 stages do not divide into processes of 2 stages"),
    (dict(schedule="1f1b", stages_per_process=2), r"schedule '1f1b' runs 1 stage\(s\) per process"),
    (dict(schedule="zbv", stages_per_process=3), r"schedule 'zbv' runs 2 stage\(s\) per process"),
    (dict(schedule="interleaved-1f1b", stages_per_process=0), r"stages_per_process must be a positive integer"),
    (dict(schedule="zbv", devices=["cpu", "cpu", "cpu", "meta"]), r"devices\[3\]|give them one device"),
])
def test_refusals_name_the_setting(kw, match):
    kw = dict(kw)
    stages = stages64(kw.pop("stages", 4))
    with pytest.raises(ValueError, match=match):
        pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), SGD64, microbatches=4, mode="simulated", **kw)


def test_a_failing_stage_is_named_with_its_chunk():
    stages = stages64(4)
    stages[2] = Raises(7).double()  # stage 2 (process 1's chunk 1, V placement) raises in its forward
    with pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), SGD64, "zbv", 4, mode="simulated") as r:
        with pytest.raises(pipeq.PipelineError, match=r"stage 2 \(chunk 1 of its process\).*microbatch 0") as info:
            r.step(*batches64(1)[0])
    assert info.value.stage == 2


def _steps_reversed(base):
    """``base``'s plan with each process's two closing STEPs in the other order (a valid plan)."""
    class Reversed(base):
        name = f"{base.name}-steps-reversed"

        def plan(self, n, m):
            return [acts[:-2] + [acts[-1], acts[-2]] for acts in super().plan(n, m)]
    return Reversed


@pytest.mark.parametrize("base,kw", [(schedules.ZBV, {}), (schedules.Interleaved1F1B, {"stages_per_process": 2})],
                         ids=["zbv", "interleaved"])
def test_closing_steps_in_another_order_still_combine_the_statistics_in_stage_order(base, kw):
    """A plan may close with its STEPs in any order: the process steps its stages in stage order
    (the statistics go up the chain so), the same numbers as the plan in chunk order."""
    stages, batches = stages64(4), batches64(2)
    got = {}
    for schedule in (base(**kw), _steps_reversed(base)(**kw)):
        with pipeq.PipelineRunner(copy.deepcopy(stages), nn.CrossEntropyLoss(), SGD64, schedule, 4, mode="simulated",
                                  clip_grad_norm=0.05) as r:
            got[schedule.name] = ([r.step(x, y) for x, y in batches], r.state_dict())
    (want, want_state), (losses, state) = got.values()
    assert losses == want and all(torch.equal(state[k], v) for k, v in want_state.items())


@pytest.mark.parametrize("schedule", ["zbv", "interleaved-1f1b"])
def test_a_failing_optimizer_step_names_its_stage(schedule):
    """Stage 3 shares its process with stage 0 (V) or 1 (looped); its step fails: stage 3 is named."""
    torch.manual_seed(0)
    stages = [nn.Linear(8, 8).double(), nn.Linear(8, 8).double(), nn.Linear(8, 8).double(), nn.Linear(8, 5).double()]
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 5, (8,))
    sgd = functools.partial(FailingStepSGD, lr=0.1)  # fails on the stage of a (5, 8) weight: stage 3
    with pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), sgd, schedule, 4, mode="simulated") as r:
        with pytest.raises(pipeq.PipelineError, match=r"stage 3 \(chunk 1 of its process\).*optimizer step failed") as info:
            r.step(x, y)
    assert info.value.stage == 3


def test_auto_with_two_stages_per_process_chooses_among_those_schedules_and_trains_as_its_choice():
    stages = stages64(4)
    batches = batches64(3)
    with pipeq.PipelineRunner(copy.deepcopy(stages), nn.CrossEntropyLoss(), SGD64, "auto", 4, mode="simulated",
                              stages_per_process=2) as r:
        got = [r.step(x, y) for x, y in batches]
        chosen = r.schedule
    assert chosen.stages_per_process == 2 and chosen.name in ("zbv", "interleaved-1f1b", "looped-bfs", "dualpipev")
    losses, _, _ = run_runner(stages, batches, schedule=chosen, microbatches=4, mode="simulated", opt=SGD64)
    assert got == losses
