"""V-Half and V-Min (arXiv 2405.15362) as plans: valid and deadlock-free for any N and m, and their
activations in flight per process at 1/2 and about 1/3 of 1F1B's, for a bubble that is stated."""

from __future__ import annotations

import random

import pytest

import pipeq
import pipeq.schedules as S
from pipeq.errors import ScheduleError
from pipeq.schedules import Action, Op
from pipeq.schedules.choose import peak_in_flight
from pipeq.schedules.v_memory import capped_v, v_cap

pytestmark = pytest.mark.timeout(30)

UNIT = {Op.FORWARD: 1, Op.INPUT_GRAD: 1, Op.WEIGHT_GRAD: 1, Op.BACKWARD: 2, Op.STEP: 0}


def _chunks_in_flight(acts: list[Action], freed_by=(Op.WEIGHT_GRAD, Op.BACKWARD)) -> int:
    """A process's peak of chunks forwarded and not yet freed (by their W, or with ``freed_by``
    the I, their input gradient)."""
    live = peak = 0
    for a in acts:
        live += a.op is Op.FORWARD
        live -= a.op in freed_by
        peak = max(peak, live)
    return peak


def _step(name: str, n: int, m: int, cost=UNIT) -> float:
    """The step's length of ``name`` on ``n`` processes at ``cost`` (per model stage)."""
    v = S.resolve(name).stages_per_process
    timeline = S.dry_run(S.build(name, n * v, m), cost=cost, stages=S.process_stages(name, n * v))
    return max(t + cost[a.op] for row in timeline for t, a in row if a.op is not Op.STEP)


@pytest.mark.parametrize("name", ["v-half", "v-min"])
@pytest.mark.parametrize("n,m", [(1, 1), (1, 3), (2, 1), (2, 4), (3, 2), (3, 7), (4, 16), (5, 9), (6, 12), (8, 16)])
def test_plans_validate_run_with_any_costs_and_hold_at_most_the_cap(name, n, m):
    plan = S.resolve(name).plan(n, m)
    lowered = S.build(name, 2 * n, m)  # per-stage consistency, STEPs last, a deadlock-free dry run
    where = S.process_stages(name, 2 * n)
    rng = random.Random(n * 100 + m)
    for _ in range(3):  # the order respects the dependencies only: uneven costs run it too
        costs = [{Op.FORWARD: rng.uniform(0.2, 3), Op.INPUT_GRAD: rng.uniform(0.2, 3),
                  Op.WEIGHT_GRAD: rng.uniform(0.2, 3)} for _ in range(2 * n)]
        S.dry_run(lowered, cost=costs, stages=where, hop=rng.uniform(0, 1))
    cap = v_cap(n, 2 if name == "v-half" else 3)
    assert max(_chunks_in_flight(acts) for acts in plan) == min(cap, 2 * m)
    assert all(a.chunk in (0, 1) for acts in plan for a in acts)


@pytest.mark.parametrize("n,half,third", [(4, 0.5, 0.375), (6, 0.5, 1 / 3), (8, 0.5, 0.3125)])
def test_activations_in_flight_are_a_half_and_about_a_third_of_1f1bs(n, half, third):
    m = 16
    one_f_one_b = peak_in_flight(S.build("1f1b", n, m))  # N microbatches, on stage 0
    assert one_f_one_b == n and peak_in_flight(S.build("zbv", 2 * n, m), 2) == n
    assert peak_in_flight(S.build("v-half", 2 * n, m), 2) / one_f_one_b == half
    assert peak_in_flight(S.build("v-min", 2 * n, m), 2) / one_f_one_b == pytest.approx(third)
    for name, ratio in (("v-half", half), ("v-min", third)):  # every process, counted to the I as well
        plan = S.resolve(name).plan(n, m)
        per_process = [_chunks_in_flight(acts) / 2 / one_f_one_b for acts in plan]
        assert max(per_process) == pytest.approx(ratio)
        assert max(_chunks_in_flight(acts, (Op.INPUT_GRAD, Op.BACKWARD)) for acts in plan) / 2 / n <= ratio


def test_the_bubble_they_pay_at_equal_costs():
    half = {op: c / 2 for op, c in UNIT.items()}  # a chunk is half a 1F1B stage
    for n, want_half, want_min in ((4, 61.5, 87), (8, 65.5, 92.5)):
        one_f_one_b = _step("1f1b", n, 16)
        assert one_f_one_b == 3 * (16 + n - 1)
        assert (_step("v-half", n, 16, half), _step("v-min", n, 16, half)) == (want_half, want_min)
        assert _step("zbv", n, 16, half) < want_half < want_min
    assert _step("v-half", 8, 16, half) < _step("1f1b", 8, 16)


def test_names_refusals_and_the_table():
    for name, cls in (("v-half", S.VHalf), ("v-min", S.VMin)):
        policy = S.resolve(name)
        assert name in pipeq.SCHEDULES and type(policy) is cls and policy.label == name
        assert policy.stages_per_process == 2 and policy.placement == "v" and policy.plain_backprop
        assert S.from_label(name) == policy
    assert [v_cap(n, 2) for n in (1, 2, 4, 8)] == [2, 2, 4, 8]
    assert [v_cap(n, 3) for n in (1, 2, 3, 4, 6, 8)] == [2, 2, 2, 3, 4, 5]
    with pytest.raises(ScheduleError, match="cap >= 2"):
        capped_v(4, 8, 1)
    with pytest.raises(ScheduleError, match="at least one microbatch"):
        S.VHalf().plan(2, 0)
    with pytest.raises(ScheduleError, match="3 stages do not divide"):
        S.build("v-min", 3, 4)
    table = S.format_table("v-half", 2, 4, costs=(1, 1, 1)).splitlines()
    assert table[0] == "v-half: 2 processes x 2 stages (v placement) x 4 microbatches (F=1 I=1 W=1, B=I+W per stage)"
    assert table[1].split("|")[1].split()[:2] == ["F0", "."]  # its chunk 1 waits for stages 1 and 2
    # two processes hold two chunks each at most: one microbatch at a time on process 0
    assert [str(a) for a in S.VHalf().plan(2, 4)[0][:6]] == ["F0", "F0.c1", "I0.c1", "W0.c1", "F1", "I0"]
