"""The split backward's vocabulary (I, W, chunks), its validation, lowering and dry run, and ZB-H1's plan."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import pipeq
import pipeq.schedules as S
from plan_cases import peak_in_flight
from pipeq.errors import ScheduleError
from pipeq.launch.cli import main
from pipeq.schedules import B, F, I, STEP, W, Action, Op
from pipeq.schedules.bounds import stream_bound, stream_plan
from pipeq.schedules.dryrun import stage_costs

UNIT = {Op.FORWARD: 1, Op.INPUT_GRAD: 1, Op.WEIGHT_GRAD: 1}


# -- the vocabulary ---------------------------------------------------------------------------------
def test_actions_print_and_compare_as_before_with_chunk_0():
    assert [str(a) for a in (F(3), B(3), I(3), W(12), STEP)] == ["F3", "B3", "I3", "W12", "STEP"]
    assert I(2) == Action(Op.INPUT_GRAD, 2) == Action(Op.INPUT_GRAD, 2, 0) and I(2).chunk == 0
    assert str(Action(Op.FORWARD, 3, 1)) == "F3.c1" and str(Action(Op.STEP, -1, 2)) == "STEP.c2"
    assert Action(Op.FORWARD, 3, 1) != F(3)
    assert len({I(1), I(1), W(1), Action(Op.WEIGHT_GRAD, 1, 1)}) == 3  # hashable
    assert not hasattr(F(0), "__dict__")  # slots: small
    with pytest.raises(AttributeError):
        F(0).chunk = 1  # type: ignore[misc]


def test_lowering_I_communicates_like_B_and_W_nothing():
    low = S.lower([[F(0), I(0), W(0), STEP], [F(0), I(0), W(0), STEP], [F(0), I(0), W(0), STEP]])
    assert [str(a) for a in low[0]] == ["F0", "sendF0", "recvB0", "I0", "W0", "STEP"]
    assert [str(a) for a in low[1]] == ["recvF0", "F0", "sendF0", "recvB0", "I0", "sendB0", "W0", "STEP"]
    assert [str(a) for a in low[2]] == ["recvF0", "F0", "I0", "sendB0", "W0", "STEP"]
    one = S.lower_stage([Action(Op.INPUT_GRAD, 4, 1)], recv_act=True, send_act=True, recv_grad=True, send_grad=True)
    assert one == [Action(Op.RECV_GRAD, 4, 1), Action(Op.INPUT_GRAD, 4, 1), Action(Op.SEND_GRAD, 4, 1)]


# -- validation ---------------------------------------------------------------------------------------
def _check(plan, m=2, training=True):
    S.check_consistency(plan, len(plan), m, training)


def test_a_split_backward_is_valid_and_may_mix_with_B_across_microbatches():
    _check([[F(0), F(1), I(0), B(1), W(0), STEP]])
    _check([[F(0), F(1), I(1), I(0), W(0), W(1), STEP]])


@pytest.mark.parametrize("plan, match", [
    ([[F(0), F(1), B(0), B(1), STEP], [F(0), F(1), I(0), B(1), STEP]],
     r"stage 1, action 2 \(I0\): no weight gradient \(W\) of microbatch 0 follows it$"),
    ([[F(0), F(1), W(0), I(0), B(1), STEP]],
     r"stage 0, action 2 \(W0\): weight gradient \(W\) of microbatch 0 before its input gradient \(I\)"),
    ([[F(0), F(1), I(0), W(0), W(0), B(1), STEP]], r"stage 0, action 4 \(W0\): .*appears twice"),
    ([[F(0), F(1), I(0), I(1), STEP]], r"stage 0, action 2 \(I0\): .* \(nor of microbatch\(es\) \[1\]\)"),
    ([[F(0), I(0), F(1), I(0), W(0), B(1), STEP]], r"stage 0, action 3 \(I0\): .*appears twice"),
    ([[F(0), F(1), B(0), I(0), W(0), B(1), STEP]], r"stage 0, action 3 \(I0\): .*has its backward \(B\) already"),
    ([[F(0), F(1), I(0), B(0), B(1), STEP]], r"stage 0, action 3 \(B0\): .*split backward"),
    ([[F(0), F(1), B(0), W(0), B(1), STEP]], r"stage 0, action 3 \(W0\): .*includes its W"),
    ([[I(0), F(0), F(1), W(0), B(1), STEP]], r"stage 0, action 0 \(I0\): .*before its forward"),
    ([[F(0), F(1), I(0), I(1), W(1), STEP, W(0)]], r"stage 0, action 5 \(STEP\): STEP must be the stage's last"),
])
def test_refusals_name_stage_position_and_action(plan, match):
    with pytest.raises(ScheduleError, match=match):
        _check(plan)


def test_forward_only_refuses_I_and_W():
    with pytest.raises(ScheduleError, match="forward-only schedule has no backward"):
        _check([[F(0), F(1), I(0)]], training=False)


def test_build_refuses_a_plan_missing_a_W_naming_the_stage():
    def bad(n, m):
        plan = S.zb_h1(n, m)
        plan[2] = [a for a in plan[2] if a != W(1)]
        return plan

    with pytest.raises(ScheduleError, match=r"stage 2, action \d+ \(I1\): no weight gradient \(W\) of microbatch 1"):
        S.build(bad, 4, 4)


def test_dry_run_refuses_a_split_backward_that_deadlocks_naming_the_stages():
    def crossed(n, m):  # stage 1's I1 needs F1, which stage 0 sends after its I0, which needs stage 1's I0
        return [[F(0), I(0), F(1), I(1), W(0), W(1), STEP], [F(0), F(1), I(1), I(0), W(0), W(1), STEP]]

    with pytest.raises(ScheduleError, match="deadlocks: stage 0 waits for the grad of microbatch 0 from stage 1; "
                                            "stage 1 waits for the act of microbatch 1 from stage 0"):
        S.build(crossed, 2, 2)


# -- costs ---------------------------------------------------------------------------------------------
def test_costs_a_split_backward_costs_as_much_as_B():
    (c,) = stage_costs(None, 1)
    assert (c[Op.BACKWARD], c[Op.INPUT_GRAD], c[Op.WEIGHT_GRAD]) == (1, 0.5, 0.5)
    (c,) = stage_costs({Op.INPUT_GRAD: 2, Op.WEIGHT_GRAD: 3}, 1)
    assert c[Op.BACKWARD] == 5 and c[Op.FORWARD] == 1 and c[Op.STEP] == 1
    assert S.plan.table_costs((2, 1, 3)) == {Op.FORWARD: 2, Op.INPUT_GRAD: 1, Op.WEIGHT_GRAD: 3, Op.BACKWARD: 4,
                                             Op.STEP: 1}
    with pytest.raises(ScheduleError, match="costs are F,I,W"):
        S.plan.table_costs((1, 0, 1))


# -- ZB-H1 -------------------------------------------------------------------------------------------
def _makespan(name, n, m, cost):
    timeline = S.dry_run(S.build(name, n, m), cost=cost)
    return max(t for row in timeline for t, a in row if a.op is Op.STEP)


@pytest.mark.parametrize("n,m", [(1, 1), (1, 4), (2, 1), (2, 2), (2, 7), (3, 5), (4, 2), (4, 4), (4, 8), (5, 9), (8, 16)])
def test_zb_h1_is_valid_deadlock_free_and_holds_1f1b_peak_memory(n, m):
    plan = S.zb_h1(n, m)
    S.check_consistency(plan, n, m, training=True)
    S.build("zb-h1", n, m)  # dry run included
    ref = S.one_f_one_b(n, m)
    assert max(peak_in_flight(a) for a in plan) <= max(peak_in_flight(a) for a in ref)
    assert all(a.count(W(0)) == 1 for a in plan)


@pytest.mark.parametrize("n,m", [(2, 4), (4, 4), (4, 8), (6, 12)])
def test_zb_h1_cuts_the_bubble_to_a_third_at_equal_costs(n, m):
    assert _makespan("zb-h1", n, m, UNIT) == 3 * m + n - 1  # bubble (N-1)(F + I - W) = N - 1
    assert _makespan("1f1b", n, m, UNIT) == 3 * (m + n - 1)  # B = I + W = 2


@pytest.mark.parametrize("n,m", [(2, 2), (3, 5), (4, 8), (4, 3), (5, 10)])
def test_zb_h1_orders_as_torch_zb1p_with_one_stage_per_rank(n, m):
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    rounds = max(1, m // n)
    if m % rounds:
        pytest.skip("torch refuses m not a multiple of its rounds")
    fake = SimpleNamespace(n_local_stages=1, microbatches_per_round=m // rounds, pp_group_size=n, _n_microbatches=m)
    for k, acts in enumerate(S.zb_h1(n, m)):
        theirs = ScheduleInterleavedZeroBubble._calculate_single_rank_operations(fake, k)
        assert [f"{k}{a}" for a in acts if a.op is not Op.STEP] == [repr(a) for a in theirs if a is not None]


def test_zb_h1_by_name_in_the_registry_drains_each_step():
    for name in ("zb-h1", "zb1p"):
        policy = S.resolve(name)
        assert name in pipeq.SCHEDULES and policy.label == name and not policy.streams_across_batches
        assert policy.plain_backprop and policy.loss_stages(4) == [3]
    assert S.build("zb1p", 3, 4) == S.build("zb-h1", 3, 4)
    streamed = stream_plan("zb-h1", 2, 2, 2)  # batch after batch, each drained by its STEP
    assert [str(a) for a in streamed[1]][-5:] == ["I3", "sendB3", "W2", "W3", "STEP"]
    assert streamed[0].count(STEP) == 2 and W(3) in streamed[0]
    bound = stream_bound("zb-h1", 4, 8, UNIT)
    assert bound.busy == 3 * 8 + 1 and bound.step <= 3 * 8 + 4


def test_format_table_and_cli_print_costs_and_bubble(capsys):
    text = S.format_table("zb-h1", 4, 8, costs=(1, 1, 1))
    lines = text.splitlines()
    assert lines[0] == "zb-h1: 4 stages x 8 microbatches (F=1 I=1 W=1, B=I+W)"
    assert lines[1].split("|")[1].split()[:10] == ["F0", "F1", "F2", "F3", ".", ".", ".", "I0", "W0", "F4"]
    assert lines[-2].startswith("step 27 units before STEP; bubble 11.1%")
    assert S.format_table("1f1b", 4, 8, costs=(1, 1, 1)).splitlines()[-2].startswith("step 33 units before STEP; bubble 27.3%")
    assert S.format_table("1f1b", 3, 4) == S.format_table("1f1b", 3, 4, backward_cost=1)  # unchanged without costs
    assert main(["schedule", "zb-h1", "--stages", "4", "--microbatches", "8", "--costs", "1,1,1"]) == 0
    assert capsys.readouterr().out.strip() == text
    assert main(["schedule", "zb1p", "--stages", "2", "--microbatches", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split("|")[1].split() == ["F0", "F1", ".", "I0", "W0", "I1", "W1", "ST"]
    with pytest.raises(SystemExit):
        main(["schedule", "zb-h1", "--stages", "2", "--microbatches", "2", "--costs", "1,1"])
    assert "--costs is F,I,W" in capsys.readouterr().err


@pytest.mark.parametrize("table", ['"zb-h1"', '{ name = "zb1p" }'])
def test_a_job_file_names_zb_h1(tmp_path, table):
    from job_files import MLP_MOMENTUM
    from pipeq.launch.job import load_job

    path = tmp_path / "job.toml"
    path.write_text(MLP_MOMENTUM + f"schedule = {table}\nsteps = 1\n")
    job = load_job(str(path))
    assert job.schedule == table.strip('"{} ').replace('name = "', "").rstrip('"')
    assert S.resolve(job.schedule).plan(2, 2) == S.zb_h1(2, 2)


def test_a_planned_trace_of_zb_h1_has_I_and_W_spans_of_their_costs():
    from pipeq.trace.format import planned_trace, trace_from_dict

    t = trace_from_dict(planned_trace("zb-h1", 2, 2, costs=(1, 2, 3)))
    assert t.meta["costs"] == [1, 2, 3] and t.meta["backward_cost"] == 5
    spans = {(e.stage, e.op, e.microbatch): e.dur_us for e in t.events if e.cat == "backward"}
    assert spans[(1, "I", 0)] == 2000.0 and spans[(0, "W", 1)] == 3000.0 and len(spans) == 8
