"""Choosing the schedule from costs: the ranking, the I/W search, the hop, ``pipeq schedule auto``, report's advice and ideal, and ``schedule="auto"`` in the runner."""

from __future__ import annotations

import functools
import json
import pickle

import pytest
import torch
from torch import nn

import pipeq
from pipeq import schedules as S
from pipeq.control.config import RunConfig
from pipeq.launch.cli import main
from pipeq.launch.job.schedule import parse_schedule
from pipeq.schedules import Op
from pipeq.schedules.choose import (SEARCHED, VARIANTS, SearchedSchedule, choose, format_choice, predict, search,
                                    stage_cost)
from pipeq.trace import format as T
from pipeq.trace import report as R
from pipeq.trace.advice import measured_costs

pytestmark = pytest.mark.timeout(60)


def _rows(choice):
    return {r.name: r for r in choice.rows}


# ---------------------------------------------------------------- the ranking


def test_zero_bubble_chosen_when_w_is_cheap_and_memory_is_1f1bs():
    choice = choose(stage_cost(1, 1, 0.25), 4, 8, stages_per_process=1)
    assert choice.name in ("zb-h1", "zb-h2", SEARCHED)
    rows = _rows(choice)
    assert choice.step_ms < rows["1f1b"].step_ms
    assert rows["zb-h2"].memory > 1 and not rows["zb-h2"].fits  # 2N-1 in flight: over 1F1B's N
    assert _rows(choice)[choice.name].memory <= 1 + 1e-9
    # twice the memory allowed: ZB-H2 keeps the pipeline full and wins
    assert choose(stage_cost(1, 1, 0.25), 4, 8, stages_per_process=1, memory_limit=2).name in ("zb-h2", SEARCHED)


@pytest.mark.parametrize("costs", [(5, 5, 5), (1, 2, 1), (1, 1, 0.2), (3, 1, 1), (1, 10, 1), (1, 1, 10)])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_fill_drain_is_never_chosen_under_the_default_limit(costs, n):
    for m in (n + 1, 2 * n + 1):
        choice = choose(stage_cost(*costs), n, m)
        assert choice.name != "fill-drain" and not _rows(choice)["fill-drain"].fits


def test_a_huge_input_gradient_shrinks_what_splitting_the_backward_wins():
    def gain(f, i, w):
        rows = _rows(choose(stage_cost(f, i, w), 4, 8, stages_per_process=1))
        return 1 - rows["zb-h1"].step_ms / rows["1f1b"].step_ms

    assert gain(1, 1, 1) > gain(1, 20, 1) > 0  # the Ws that fill the bubble are a small share of it
    assert gain(1, 1, 20) > gain(1, 1, 1)  # big Ws fill more of it
    big_i = choose(stage_cost(1, 20, 1), 4, 8)
    # cut into 2N stages, the costly I halves: the V and looped schedules gain; the choice still fits
    assert _rows(big_i)["zbv"].step_ms < _rows(big_i)["zb-h1"].step_ms
    assert _rows(big_i)[big_i.name].fits


def test_costs_per_model_stage_compare_that_v_only():
    per = [stage_cost(0.5, 0.5, 0.5)] * 8
    choice = choose(per, 4, 8)
    assert {r.schedule.stages_per_process for r in choice.rows if r.schedule is not None} == {2}
    assert choice.name == "zbv"


# ---------------------------------------------------------------- the search


@pytest.mark.parametrize("costs,hop", [((1, 1, 1), 0), ((1, 1, 0.2), 1), ((2, 1, 3), 0.5), ((1, 10, 1), 0),
                                       ((1, 3, 0.5), 2)])
@pytest.mark.parametrize("n,m", [(4, 8), (3, 7)])
def test_searched_plan_is_valid_and_never_worse_than_zb_h1(costs, hop, n, m):
    per = [stage_cost(*costs)] * n
    found, step, _, peak = search(per, m, hop=hop, limit=n)
    assert peak <= n
    S.build(found, n, m)  # consistency and a deadlock-free dry run
    assert step <= predict("zb-h1", n, m, per, hop)[0] + 1e-9
    for variant in VARIANTS:  # every variant's plan is a valid one
        S.build(SearchedSchedule([costs] * n, hop, n, variant), n, m)


def test_search_beats_zb_h1_with_a_costly_hop():
    per = [stage_cost(1, 1, 0.2)] * 4
    found, step, _, _ = search(per, 8, hop=1, limit=4)
    assert found.variant.startswith("greedy") and step < predict("zb-h1", 4, 8, per, 1)[0] - 0.5
    assert pickle.loads(pickle.dumps(found)) == found  # stage processes receive it


def test_hop_delays_messages_between_processes_only():
    low = S.build("1f1b", 2, 1)
    timeline = S.dry_run(low, cost={Op.FORWARD: 1, Op.BACKWARD: 1}, hop=0.5)
    assert [t for t, _ in timeline[0]] == [0, 4.0, 5.0] and [t for t, _ in timeline[1]] == [1.5, 2.5, 3.5]
    # one process holding both stages of a V: its messages stay in memory
    zbv = S.build("zbv", 2, 2)
    where = S.plan.process_stages("zbv", 2)
    assert S.dry_run(zbv, stages=where, hop=7) == S.dry_run(zbv, stages=where)


# ---------------------------------------------------------------- the commands


def test_pipeq_schedule_auto_prints_the_table(capsys):
    assert main(["schedule", "auto", "--stages", "4", "--microbatches", "8", "--costs", "5,5,5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("auto: 4 processes x 8 microbatches, F=5 I=5 W=5 ms per stage")
    assert out[1].split() == ["schedule", "step", "ms", "bubble", "memory"]
    chosen = [line for line in out if line.startswith("* ")]
    assert len(chosen) == 1 and out[-1].startswith(f"chosen: {chosen[0].split()[1]} ")
    assert any(line.split()[:2] == ["1f1b", "165.00"] for line in out)  # 3(m+N-1) x 5 ms
    assert any(line.split()[:2] == ["zb-h1", "135.00"] for line in out)  # (3m+N-1) x 5 ms
    assert main(["schedule", "auto", "--microbatches", "8"]) == 2  # no --stages


def _planned(tmp_path, schedule="zb-h1", n=3, m=6, costs=(2, 1, 1)):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(T.planned_trace(schedule, n, m, costs=costs)))
    return str(path)


def test_measured_costs_and_auto_from_a_trace(tmp_path, capsys):
    path = _planned(tmp_path)
    costs, hop = measured_costs(T.load_trace(path))
    assert costs == [{Op.FORWARD: 2, Op.INPUT_GRAD: 1, Op.WEIGHT_GRAD: 1}] * 3 and hop == 0
    assert main(["schedule", "auto", "--from-trace", path]) == 0
    out = capsys.readouterr().out
    assert out.startswith("auto: 3 processes x 6 microbatches, F=2 I=1 W=1 ms per stage")
    assert format_choice(choose(stage_cost(2, 1, 1), 3, 6)) in out


def test_report_advice_line_and_the_schedules_own_ideal(tmp_path, capsys):
    path = _planned(tmp_path)
    assert main(["report", path]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = _rows(choose(stage_cost(2, 1, 1), 3, 6))
    assert lines[-1] == (f"this run's measured costs: 1F1B {rows['1f1b'].step_ms:.2f} ms, ZB-H1 "
                         f"{rows['zb-h1'].step_ms:.2f} ms, ZBV {rows['zbv'].step_ms:.2f} ms (best: "
                         f"{choose(stage_cost(2, 1, 1), 3, 6).name})")
    assert "vs ideal 10.0% (zb-h1's dry run at F=I=W=1 for N=3, m=6)" in lines[-2]  # (N-1)/(3m+N-1)
    assert R.ideal_bubble(4, 8, S.resolve("zb-h1")) == pytest.approx(3 / 27)
    assert R.ideal_bubble(4, 8, S.resolve("1f1b")) == pytest.approx(3 / 11) == R.ideal_bubble(4, 8)


# ---------------------------------------------------------------- the runner


def _stages():
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(8 if k == 0 else 16, 16), nn.Tanh()) for k in range(3)] + [nn.Linear(16, 3)]


SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def _train(schedule, data, stages=None):
    with pipeq.PipelineRunner(stages or _stages(), nn.CrossEntropyLoss(), SGD, schedule, 4, mode="simulated") as r:
        return r, [r.step(x, y) for x, y in data], r.state_dict()


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(12, 8, generator=g), torch.randint(0, 3, (12,), generator=g)) for _ in range(3)]


def test_runner_auto_trains_as_the_schedule_it_chose(capsys):
    stages = _stages()
    before = {k: v.clone() for k, v in nn.Sequential(*stages).state_dict().items()}
    rng = torch.random.get_rng_state()
    runner, losses, state = _train("auto", _data(), stages)
    assert torch.equal(torch.random.get_rng_state(), rng)  # the profile leaves the RNG as it was
    for k, v in nn.Sequential(*stages).state_dict().items():  # ... and the user's weights
        assert torch.equal(v, before[k])
    choice = runner.auto_choice
    # a schedule within 1F1B's memory (ZB-H2 too, when m is small enough for its peak to be 1F1B's)
    assert runner.schedule is choice.schedule and choice.name in ("1f1b", "zb-h1", "zb-h2", SEARCHED)
    assert next(r for r in choice.rows if r.name == choice.name).memory <= 1.0
    assert "chosen: " in capsys.readouterr().err
    _, direct, direct_state = _train(choice.schedule, _data())
    assert losses == pytest.approx(direct, abs=1e-6)
    for k in state:
        torch.testing.assert_close(state[k], direct_state[k], atol=1e-6, rtol=0)


def test_searched_plan_trains_as_1f1b():
    found = SearchedSchedule([(1, 1, 0.2)] * 4, 1.0, 4, "greedy:ieu")
    _, losses, state = _train(found, _data())
    _, ref, ref_state = _train("1f1b", _data())
    assert losses == pytest.approx(ref, abs=1e-6)
    for k in state:
        torch.testing.assert_close(state[k], ref_state[k], atol=1e-6, rtol=0)


def test_auto_settles_unprofiled_when_the_pipeline_is_needed_first():
    with pipeq.PipelineRunner(_stages(), nn.CrossEntropyLoss(), SGD, "auto", 4, mode="simulated") as r:
        assert r.auto_choice is None
        out = r.predict(torch.randn(4, 8))
        assert out.shape == (4, 3) and r.auto_choice.name == "zb-h1"


def test_auto_in_run_configs_and_job_files():
    cfg = RunConfig.from_kwargs("auto", 4)
    assert cfg.auto and cfg.schedule == "zb-h1"
    assert not RunConfig.from_kwargs("1f1b", 4).auto
    assert parse_schedule("auto") == "auto"


def test_auto_profiles_with_a_streams_first_batch():
    data = _data()
    with pipeq.PipelineRunner(_stages(), nn.CrossEntropyLoss(), SGD, "auto", 4, mode="simulated") as r:
        losses = list(r.stream(iter(data)))
        assert r.auto_choice.costs[0][Op.FORWARD] != 1.0  # measured, not the unit costs
    _, direct, _ = _train(r.auto_choice.schedule, data)
    assert losses == pytest.approx(direct, abs=1e-6)
