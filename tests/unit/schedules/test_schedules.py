"""Schedules as data: the exact action lists, their validation, and the symbolic dry run."""

from __future__ import annotations


import pytest

import pipeq
from pipeq import schedules as S
from pipeq.errors import ScheduleError
from pipeq.schedules.bounds import stream_bound, stream_plan
from pipeq.schedules import STEP, Action, B, F, Op

pytestmark = pytest.mark.timeout(30)


def _parse(text: str) -> list[Action]:
    """'F0 F1 B0 ST' -> [F(0), F(1), B(0), STEP] (hand-written schedules stay readable)."""
    out = []
    for tok in text.split():
        if tok == "ST":
            out.append(STEP)
        elif tok[0] == "F":
            out.append(F(int(tok[1:])))
        elif tok[0] == "B":
            out.append(B(int(tok[1:])))
        else:
            raise AssertionError(tok)
    return out


def _sched(*rows: str) -> list[list[Action]]:
    return [_parse(r) for r in rows]


def _makespan(timeline, cost=None) -> int:
    cost = {Op.FORWARD: 1, Op.BACKWARD: 1, Op.STEP: 1, **(cost or {})}
    return max(t + cost[a.op] for row in timeline for t, a in row)


# ---------------------------------------------------------------- the action lists


def test_action_str():
    assert str(F(3)) == "F3" and str(B(0)) == "B0" and str(STEP) == "STEP"
    assert F(2) == Action(Op.FORWARD, 2) and B(2) != F(2)


def test_fill_drain_2x2():
    assert S.fill_drain(2, 2) == _sched("F0 F1 B0 B1 ST", "F0 F1 B0 B1 ST")


def test_fill_drain_3x4():
    row = "F0 F1 F2 F3 B0 B1 B2 B3 ST"
    assert S.fill_drain(3, 4) == _sched(row, row, row)


def test_fill_drain_single_stage_single_microbatch():
    assert S.fill_drain(1, 1) == _sched("F0 B0 ST")


def test_one_f_one_b_3x4():
    # stage k: min(m, N-k) warm-up forwards, then B/F alternation, then the remaining B, then STEP
    assert S.one_f_one_b(3, 4) == _sched(
        "F0 F1 F2 B0 F3 B1 B2 B3 ST",  # warm-up 3
        "F0 F1 B0 F2 B1 F3 B2 B3 ST",  # warm-up 2
        "F0 B0 F1 B1 F2 B2 F3 B3 ST",  # warm-up 1
    )


def test_one_f_one_b_4x4_matches_docstring_table():
    assert S.one_f_one_b(4, 4) == _sched(
        "F0 F1 F2 F3 B0 B1 B2 B3 ST",
        "F0 F1 F2 B0 F3 B1 B2 B3 ST",
        "F0 F1 B0 F2 B1 F3 B2 B3 ST",
        "F0 B0 F1 B1 F2 B2 F3 B3 ST",
    )


def test_one_f_one_b_fewer_microbatches_than_stages():
    # m < N: warm-up is capped by m, so the first stages degenerate to fill-drain
    assert S.one_f_one_b(4, 2) == _sched(
        "F0 F1 B0 B1 ST",
        "F0 F1 B0 B1 ST",
        "F0 F1 B0 B1 ST",
        "F0 B0 F1 B1 ST",
    )


def test_one_f_one_b_single_stage():
    assert S.one_f_one_b(1, 3) == _sched("F0 B0 F1 B1 F2 B2 ST")


def test_one_f_one_b_single_microbatch():
    assert S.one_f_one_b(3, 1) == _sched("F0 B0 ST", "F0 B0 ST", "F0 B0 ST")


def test_forward_only():
    assert S.forward_only(2, 3) == _sched("F0 F1 F2", "F0 F1 F2")


def test_lower_inserts_communication():
    low = S.lower(S.one_f_one_b(2, 1))
    R_F, S_F, R_B, S_B = Op.RECV_ACT, Op.SEND_ACT, Op.RECV_GRAD, Op.SEND_GRAD
    assert low == [
        [F(0), Action(S_F, 0), Action(R_B, 0), B(0), STEP],
        [Action(R_F, 0), F(0), B(0), Action(S_B, 0), STEP],
    ]
    # a middle stage receives and sends in both directions
    mid = S.lower(S.fill_drain(3, 1))[1]
    assert mid == [Action(R_F, 0), F(0), Action(S_F, 0), Action(R_B, 0), B(0), Action(S_B, 0), STEP]
    # a single stage talks to nobody
    assert S.lower(S.fill_drain(1, 2)) == S.fill_drain(1, 2)


# ---------------------------------------------------------------- memory: live microbatches


def _max_live(acts: list[Action]) -> int:
    live = peak = 0
    for a in acts:
        if a.op is Op.FORWARD:
            live += 1
        elif a.op is Op.BACKWARD:
            live -= 1
        peak = max(peak, live)
        assert live >= 0
    assert live == 0
    return peak


@pytest.mark.parametrize("n", range(1, 7))
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_one_f_one_b_live_microbatches(n, m):
    sched = S.one_f_one_b(n, m)
    for k, acts in enumerate(sched):
        assert _max_live(acts) == min(m, n - k), f"stage {k}"
    # fill-drain keeps every microbatch alive on every stage
    assert [_max_live(acts) for acts in S.fill_drain(n, m)] == [m] * n


# ---------------------------------------------------------------- build over many shapes


@pytest.mark.parametrize("name", ["fill-drain", "gpipe", "1f1b"])
def test_build_many_shapes_dry_run_completes(name):
    for n in range(1, 7):
        for m in range(1, 11):
            lowered = S.build(name, n, m)
            assert len(lowered) == n
            timeline = S.dry_run(lowered)
            for k, row in enumerate(timeline):
                acts = [a for _, a in row]
                assert acts == S.get_schedule(name)(n, m)[k]  # compute actions, in schedule order
                times = [t for t, _ in row]
                assert times == sorted(times)


def test_build_forward_only():
    for n in range(1, 5):
        for m in range(1, 6):
            lowered = S.build("1f1b", n, m, training=False)
            ops = {a.op for row in lowered for a in row}
            assert Op.BACKWARD not in ops and Op.STEP not in ops
            assert Op.RECV_GRAD not in ops and Op.SEND_GRAD not in ops


@pytest.mark.parametrize("n,m", [(0, 1), (1, 0), (-1, 2), (2, -3), (2.0, 2), (2, "4"), (None, 1)])
def test_build_refuses_bad_counts(n, m):
    with pytest.raises(ScheduleError):
        S.build("1f1b", n, m)


@pytest.mark.parametrize("name", ["fill-drain", "1f1b"])
def test_standard_schedules_need_only_one_buffered_message(name):
    # they consume messages in the order they are sent, so even capacity 1 never deadlocks
    for n in range(1, 5):
        for m in range(1, 6):
            S.dry_run(S.build(name, n, m), capacity=1)


# ---------------------------------------------------------------- check_consistency

GOOD3 = ("F0 F1 B0 B1 ST", "F0 F1 B0 B1 ST", "F0 F1 B0 B1 ST")


def _bad(stage: int, row: str) -> list[list[Action]]:
    rows = list(GOOD3)
    rows[stage] = row
    return _sched(*rows)


def test_check_consistency_accepts_good():
    S.check_consistency(_sched(*GOOD3), 3, 2, training=True)
    S.check_consistency(_sched("F1 F0 B1 B0 ST", *GOOD3[1:]), 3, 2, training=True)  # any order


@pytest.mark.parametrize(
    "stage,row,what",
    [
        (1, "F0 B0 ST", r"no forward.*\[1\]"),  # missing forward (and its backward)
        (2, "F1 B1 ST", r"no forward.*\[0\]"),
        (1, "F0 F1 B0 B1 B0 ST", r"backward of microbatch 0 appears twice"),
        (0, "F0 F1 B0 B1 B1 ST", r"backward of microbatch 1 appears twice"),
        (1, "F0 F0 F1 B0 B1 ST", r"forward of microbatch 0 appears twice"),
        (2, "F0 B1 F1 B0 ST", r"backward of microbatch 1 before its forward"),
        (1, "B0 F0 F1 B1 ST", r"backward of microbatch 0 before its forward"),
        (0, "F0 F1 B0 ST B1", r"STEP must be the stage's last action"),
        (1, "ST F0 F1 B0 B1", r"STEP must be the stage's last action"),
        (2, "F0 F1 B0 B1 ST ST", r"STEP"),  # two STEPs
        (1, "F0 F1 B0 B1", r"exactly one STEP, found 0"),
        (1, "F0 F1 F2 B0 B1 B2 ST", r"microbatch 2 is out of range"),
        (0, "F0 F1 B0 ST", r"no backward.*\[1\]"),
    ],
)
def test_check_consistency_refuses(stage, row, what):
    with pytest.raises(ScheduleError, match=what) as info:
        S.check_consistency(_bad(stage, row), 3, 2, training=True)
    assert f"stage {stage}" in str(info.value)
    # the error names the faulty stage, not another one
    assert not any(f"stage {k}" in str(info.value) for k in range(3) if k != stage)


def test_check_consistency_refuses_negative_microbatch():
    rows = _bad(1, "F0 F1 B0 B1 ST")
    rows[1].insert(0, F(-1))
    with pytest.raises(ScheduleError, match="stage 1.*out of range"):
        S.check_consistency(rows, 3, 2, training=True)


@pytest.mark.parametrize("n_lists", [2, 4, 0])
def test_check_consistency_refuses_wrong_number_of_stage_lists(n_lists):
    sched = [_parse("F0 F1 B0 B1 ST") for _ in range(n_lists)]
    with pytest.raises(ScheduleError, match=f"{n_lists} stage lists for 3 stages"):
        S.check_consistency(sched, 3, 2, training=True)


def test_check_consistency_refuses_communication_actions():
    with pytest.raises(ScheduleError, match=r"stage 0, action 1 \(sendF0\).*compute actions only"):
        S.check_consistency(S.lower(S.fill_drain(3, 2)), 3, 2, training=True)


def test_check_consistency_forward_only():
    S.check_consistency(_sched("F0 F1", "F1 F0"), 2, 2, training=False)
    with pytest.raises(ScheduleError, match="stage 1.*forward-only"):
        S.check_consistency(_sched("F0 F1", "F0 F1 B0 B1 ST"), 2, 2, training=False)
    with pytest.raises(ScheduleError, match="stage 0.*forward-only"):
        S.check_consistency(_sched("F0 F1 ST", "F0 F1"), 2, 2, training=False)


# ---------------------------------------------------------------- dry run: deadlocks


def test_dry_run_refuses_deadlock():
    # stage 0 waits for the gradient of microbatch 0 before sending activation 1,
    # stage 1 waits for activation 1 before sending gradient 0
    sched = _sched("F0 B0 F1 B1 ST", "F0 F1 B0 B1 ST")
    S.check_consistency(sched, 2, 2, training=True)  # consistent, yet it cannot run
    with pytest.raises(ScheduleError, match="deadlock") as info:
        S.dry_run(S.lower(sched))
    msg = str(info.value)
    assert "stage 0 waits for the grad of microbatch 0 from stage 1" in msg
    assert "stage 1 waits for the act of microbatch 1 from stage 0" in msg


def test_dry_run_refuses_deadlock_in_the_middle_of_a_longer_pipeline():
    # stages 0 and 3 are fine; stage 1 wants gradient 0 before it forwards microbatch 1, which
    # stage 2 needs before it can start any backward
    sched = _sched(
        "F0 F1 B0 B1 ST",
        "F0 B0 F1 B1 ST",
        "F0 F1 B0 B1 ST",
        "F0 F1 B0 B1 ST",
    )
    with pytest.raises(ScheduleError, match="deadlock") as info:
        S.dry_run(S.lower(sched))
    msg = str(info.value)
    assert "stage 1 waits for the grad of microbatch 0 from stage 2" in msg
    assert "stage 2 waits for the act of microbatch 1 from stage 1" in msg
    assert "stage 3 waits for the act of microbatch 1 from stage 2" in msg
    assert "stage 0 waits for the grad of microbatch 0 from stage 1" in msg


def test_dry_run_capacity_deadlock():
    # stage 1 consumes activation 1 before activation 0, so activation 0 must stay buffered
    # while activation 1 is sent: that needs room for 2 messages on the 0 -> 1 channel
    sched = _sched("F0 F1 B0 B1 ST", "F1 F0 B0 B1 ST")
    S.check_consistency(sched, 2, 2, training=True)
    lowered = S.lower(sched)
    S.dry_run(lowered)  # unbounded: fine
    S.dry_run(lowered, capacity=2)  # enough room: fine
    with pytest.raises(ScheduleError, match="deadlock") as info:
        S.dry_run(lowered, capacity=1)
    msg = str(info.value)
    assert "stage 0 cannot send the act of microbatch 1 to stage 1 (queue full)" in msg
    assert "stage 1 waits for the act of microbatch 1 from stage 0" in msg


def test_dry_run_capacity_deadlock_fill_drain_reversed_backwards():
    # the last stage runs its backwards in reverse: stage 0's gradients arrive out of order
    sched = _sched("F0 F1 F2 B0 B1 B2 ST", "F0 F1 F2 B2 B1 B0 ST")
    lowered = S.lower(sched)
    S.dry_run(lowered, capacity=3)
    with pytest.raises(ScheduleError, match="deadlock.*queue full"):
        S.dry_run(lowered, capacity=2)


def test_dry_run_refuses_unreceived_and_duplicate_messages():
    with pytest.raises(ScheduleError, match="never received.*act 1 from stage 0 to 1"):
        S.dry_run(S.lower(_sched("F0 F1", "F0")))
    with pytest.raises(ScheduleError, match="stage 0.*same message twice"):
        S.dry_run(S.lower(_sched("F0 F0", "F0")))


# ---------------------------------------------------------------- get_schedule


def test_get_schedule_known_names():
    assert S.get_schedule("1f1b") is S.one_f_one_b
    assert S.get_schedule("fill-drain") is S.fill_drain
    assert S.get_schedule("gpipe") is S.fill_drain
    assert pipeq.SCHEDULES is S.SCHEDULES


@pytest.mark.parametrize("name", ["interleaved-zb", "1F1B", "", None, ["1f1b"]])
def test_get_schedule_unknown_lists_known_names(name):
    with pytest.raises(ValueError) as info:
        S.get_schedule(name)
    msg = str(info.value)
    assert repr(name) in msg
    for known in S.SCHEDULES:
        assert known in msg


def test_build_unknown_name():
    with pytest.raises(ValueError, match="1f1b"):
        S.build("zero-bubble", 2, 2)


# ---------------------------------------------------------------- timing and the table


def test_dry_run_times_fill_drain_2x2():
    tl = S.dry_run(S.build("fill-drain", 2, 2))
    assert [[(t, str(a)) for t, a in row] for row in tl] == [
        [(0, "F0"), (1, "F1"), (4, "B0"), (5, "B1"), (6, "STEP")],
        [(1, "F0"), (2, "F1"), (3, "B0"), (4, "B1"), (5, "STEP")],
    ]


def test_format_table_fill_drain_2x2():
    text = S.format_table("fill-drain", 2, 2)
    assert pipeq.format_table is S.format_table
    lines = text.splitlines()
    assert lines[0] == "fill-drain: 2 stages x 2 microbatches"
    rows = lines[1:]
    assert len(rows) == 2  # one row per stage
    cells = []
    for k, row in enumerate(rows):
        assert row.startswith(f"stage {k} | ")
        cells.append(row.split("|", 1)[1].split())
    assert cells[0] == ["F0", "F1", ".", ".", "B0", "B1", "ST"]
    assert cells[1] == [".", "F0", "F1", "B0", "B1", "ST", "."]  # idle after its STEP
    for c in ("F0", "B0", "ST"):
        assert c in rows[0] and c in rows[1]


def test_format_table_columns_line_up():
    text = S.format_table("1f1b", 4, 4)
    rows = text.splitlines()[1:]
    # every cell is 3 characters wide, so the same time unit is the same column on every row
    col_b0 = [row.index("B0") for row in rows]
    assert col_b0 == [len("stage 0 | ") + 3 * t for t in (7, 6, 5, 4)]


def test_format_table_backward_cost():
    rows = S.format_table("1f1b", 2, 1, backward_cost=3).splitlines()[1:]
    assert rows[0].split("|")[1].split() == ["F0", ".", ".", ".", ".", "B0", "B0", "B0", "ST"]
    assert rows[1].split("|")[1].split() == [".", "F0", "B0", "B0", "B0", "ST", ".", ".", "."]


@pytest.mark.parametrize("name", ["1f1b", "fill-drain"])
@pytest.mark.parametrize("n,m", [(1, 1), (1, 5), (2, 2), (2, 7), (3, 4), (4, 4), (4, 2), (5, 9), (6, 1), (6, 10)])
def test_makespan_with_unit_costs(name, n, m):
    # m + N - 1 forward slots and as many backward slots along the critical path, plus the STEP
    tl = S.dry_run(S.build(name, n, m))
    assert _makespan(tl) == 2 * (m + n - 1) + 1
    # the bubble is the ideal one: each stage computes 2m of the 2(m+N-1) F/B slots
    busy = 2 * m
    total = 2 * (m + n - 1)
    assert (total - busy) / total == pytest.approx((n - 1) / (m + n - 1))


def test_makespan_with_backward_twice_as_slow():
    # forward 1, backward 2: (m + N - 1) * (1 + 2) + STEP
    for n, m in [(2, 3), (3, 4), (4, 8)]:
        tl = S.dry_run(S.build("1f1b", n, m), cost={Op.BACKWARD: 2})
        assert _makespan(tl, {Op.BACKWARD: 2}) == 3 * (m + n - 1) + 1


# ---------------------------------------------------------------- per-stage costs, start times


def test_dry_run_per_stage_costs_and_start_times():
    low = S.build("fill-drain", 2, 1)  # F0 B0 ST on both stages
    tl = S.dry_run(low, cost=[{Op.FORWARD: 3}, {Op.BACKWARD: 5, Op.STEP: 0}], start=[10, 0])
    assert [[(t, str(a)) for t, a in row] for row in tl] == [
        [(10, "F0"), (19, "B0"), (20, "STEP")],  # waits for stage 1's gradient, 14 + 5
        [(13, "F0"), (14, "B0"), (19, "STEP")],  # waits for stage 0's activation, 10 + 3
    ]
    with pytest.raises(ScheduleError, match="2 stages"):
        S.dry_run(low, cost=[{}])
    with pytest.raises(ScheduleError, match="2 stages"):
        S.dry_run(low, start=[0, 0, 0])


# ---------------------------------------------------------------- streams of batches


@pytest.mark.parametrize("name", ["fill-drain", "1f1b", "global", "local", "pairwise", "al",
                                  S.Interlock("nwise", distance=2)])
def test_stream_plan_is_the_batches_back_to_back(name):
    n, m, nb = 4, 3, 5
    one = S.build(name, n, m)
    plan = stream_plan(name, n, m, nb)
    S.dry_run(plan)  # the renumbered plan runs without deadlock
    for k in range(n):
        assert len(plan[k]) == nb * len(one[k])
        forwards = [a.microbatch for a in plan[k] if a.op is Op.FORWARD]
        assert sorted(forwards) == list(range(nb * m))  # n_batches * m forwards, each once
        for b in range(nb):  # batch b is batch 0's list, microbatches shifted by b * m
            part = plan[k][b * len(one[k]):(b + 1) * len(one[k])]
            assert [(a.op, a.microbatch) for a in part] == [
                (a.op, a.microbatch + b * m if a.microbatch >= 0 else -1) for a in one[k]]
    assert stream_plan(name, n, m, 1) == one


def test_async_stream_plan_does_not_drain_between_batches():
    """Asynchronous 1F1B's stream is its plan for all the stream's microbatches at once: stage 0
    starts batch 1's forwards before batch 0's last backwards, as the stages do under stream()."""
    n, m, nb = 4, 3, 5
    plan = stream_plan("async", n, m, nb)
    assert plan == S.build("async", n, m * nb)
    stage0 = [a for a in plan[0] if a.op in (Op.FORWARD, Op.BACKWARD)]
    assert stage0.index(F(m)) < stage0.index(B(m - 1))  # F3 comes before B2: no drain at batch 0's end
    per_batch = stream_plan("1f1b", n, m, nb)
    assert [a for a in per_batch[0] if a.op in (Op.FORWARD, Op.BACKWARD)].index(F(m)) > \
        [a for a in per_batch[0] if a.op in (Op.FORWARD, Op.BACKWARD)].index(B(m - 1))


def test_stream_plan_refuses_no_batches():
    with pytest.raises(ScheduleError, match="n_batches"):
        stream_plan("1f1b", 2, 2, 0)


@pytest.mark.parametrize("name", ["fill-drain", "1f1b", "global"])
@pytest.mark.parametrize("n,m", [(2, 2), (4, 4), (4, 8), (3, 1)])
def test_stream_bound_of_flushing_schedules_is_one_batch(name, n, m):
    # stage 0 steps only once the last gradient of batch b is back, and only then starts batch
    # b+1's forwards: streaming saves nothing, and a step loop is one batch's makespan
    for cost in ({}, {Op.FORWARD: 5, Op.BACKWARD: 10, Op.STEP: 0}):
        full = {Op.FORWARD: 1, Op.BACKWARD: 1, Op.STEP: 1, **cost}
        makespan = (m + n - 1) * (full[Op.FORWARD] + full[Op.BACKWARD]) + full[Op.STEP]
        assert stream_bound(name, n, m, cost) == (makespan, makespan, m * (full[Op.FORWARD] + full[Op.BACKWARD])
                                                  + full[Op.STEP])


@pytest.mark.parametrize("n,m", [(2, 2), (4, 4), (4, 8), (5, 3)])
def test_stream_bound_of_local_has_no_flush(n, m):
    f, b, st = 5.0, 10.0, 1.0
    bound = stream_bound("local", n, m, {Op.FORWARD: f, Op.BACKWARD: b, Op.STEP: st})
    assert bound.stream == pytest.approx(m * (f + b) + st)  # every stage busy all the time
    assert bound.busy == pytest.approx(m * (f + b) + st)
    # a step loop waits for the last stage, which trails stage 0 by N-1 forwards
    assert bound.step == pytest.approx((n - 1) * f + m * (f + b) + st)


def test_stream_bound_step_loop_overlaps_the_tail_of_a_batch():
    # pairwise, unit costs: one batch takes 13, but the last stage returns the loss at 12 and
    # the stages still busy then finish batch b while the others start b+1
    low = S.build("pairwise", 4, 4)
    assert _makespan(S.dry_run(low)) == 13
    assert stream_bound("pairwise", 4, 4) == (11, 12, 9)


def test_stream_bound_per_stage_costs():
    # a stage twice as slow sets the pace of a stream of "local" batches
    cost = [{Op.STEP: 0}, {Op.FORWARD: 2, Op.BACKWARD: 2, Op.STEP: 0}, {Op.STEP: 0}]
    assert stream_bound("local", 3, 4, cost).stream == 16
