"""``schedule="auto"`` under a limit in bytes: each process's predicted peak from what its stages
hold (pipeq.schedules.memory), the choice among the given cut's schedules, the one line that
says why, and ``auto_memory_limit``'s forms (pipeq.control.memory_limit)."""

from __future__ import annotations

import pytest

from pipeq.control import memory_limit as ML
from pipeq.control.config import RunConfig
from pipeq.errors import ScheduleError
from pipeq.schedules import build, process_stages
from pipeq.schedules.choose import Budget, choose, format_choice, stage_cost, why
from pipeq.schedules.memory import Footprint, StageBytes, process_bytes, size

pytestmark = pytest.mark.timeout(60)
GiB = 2**30


def test_each_process_holds_its_static_bytes_and_its_peak_of_activations_in_flight():
    """1F1B at 4 stages x 8 microbatches: stage k holds 4 - k microbatches at its peak."""
    fp = Footprint(static=(1000.0, 2000.0, 3000.0, 4000.0), per_stage=[StageBytes(a) for a in (10.0, 20.0, 30.0, 40.0)])
    got = process_bytes(build("1f1b", 4, 8), [[k] for k in range(4)], fp)
    assert got == [1000 + 4 * 10, 2000 + 3 * 20, 3000 + 2 * 30, 4000 + 1 * 40]
    # fill-drain holds every microbatch on every stage
    assert process_bytes(build("fill-drain", 4, 8), [[k] for k in range(4)], fp) == [
        s + 8 * b.forward for s, b in zip(fp.static, fp.per_stage)]


def test_a_v_process_holds_both_its_stages_at_once():
    """ZBV at 2 processes (4 model stages: process 0 holds stages 0 and 3): each process's peak
    is its two stages' static bytes and the highest sum of their activations in flight, at most
    the sum of the two stages' own peaks."""
    fp = Footprint(static=(100.0,) * 4, per_stage=[StageBytes(a) for a in (1.0, 10.0, 100.0, 1000.0)])
    lowered, where = build("zbv", 4, 8), process_stages("zbv", 4)
    assert where == [[0, 3], [1, 2]]
    got = process_bytes(lowered, where, fp)
    assert got[0] > 200 + 1000 and got[1] > 200 + 100  # the later chunk holds something at the peak
    assert got[0] <= 200 + 8 * 1 + 8 * 1000


def _fp8():
    return Footprint(static=(1000.0,) * 8, per_stage=[StageBytes(100.0)] * 8)


def test_auto_picks_the_fastest_v_schedule_whose_every_process_fits():
    """4 processes x 2 stages, 16 microbatches, equal costs: ZBV is the fastest and holds more
    than V-Half; a limit between the two picks V-Half, and the line says which faster ones are over."""
    costs = [stage_cost(1, 1, 1)] * 8
    free = {r.name: r for r in choose(costs, 4, 16, stages_per_process=2, budget=Budget(1e12, _fp8())).rows}
    assert free["zbv"].step_ms < free["v-half"].step_ms < free["v-min"].step_ms
    assert free["v-min"].bytes < free["v-half"].bytes < free["zbv"].bytes <= free["interleaved-1f1b"].bytes
    limit = (free["v-half"].bytes + free["zbv"].bytes) / 2
    choice = choose(costs, 4, 16, stages_per_process=2, budget=Budget(limit, _fp8()))
    assert choice.name == "v-half"
    rows = {r.name: r for r in choice.rows}
    assert all(r.fits == (r.bytes <= limit) for r in rows.values() if r.bytes is not None)
    line = why(choice)
    assert line.startswith("chosen: v-half ") and f"within {size(limit)} per process" in line
    assert "faster but over it: zbv" in line and "dualpipev" in line
    assert format_choice(choice).splitlines()[-1] == line and "peak" in format_choice(choice).splitlines()[1]
    # less still: V-Min; less than any: an error naming the least any schedule needs
    assert choose(costs, 4, 16, stages_per_process=2,
                  budget=Budget((free["v-min"].bytes + free["v-half"].bytes) / 2, _fp8())).name == "v-min"
    with pytest.raises(ScheduleError, match=f"least any needs: {size(free['v-min'].bytes)}"):
        choose(costs, 4, 16, stages_per_process=2, budget=Budget(free["v-min"].bytes - 1, _fp8()))


def test_one_stage_per_process_with_bytes_keeps_the_search_within_them():
    """One stage per process: ZB-H2 (twice 1F1B's activations) fits only a limit that allows it;
    the searched plan is held to the microbatches the limit leaves beside the static bytes."""
    fp = Footprint(static=(1000.0,) * 4, per_stage=[StageBytes(100.0)] * 4)
    costs = [stage_cost(1, 1, 1)] * 4
    tight = choose(costs, 4, 8, budget=Budget(1000 + 4 * 100, fp))  # 1F1B's stage 0 exactly
    rows = {r.name: r for r in tight.rows}
    assert rows["1f1b"].fits and rows["zb-h1"].fits and not rows["zb-h2"].fits
    assert all(r.bytes <= 1400 for r in tight.rows if r.fits)
    assert {r.schedule.stages_per_process for r in tight.rows if r.schedule is not None} == {1}  # the given cut
    roomy = choose(costs, 4, 8, budget=Budget(1e9, fp))
    assert {r.name: r for r in roomy.rows}["zb-h2"].fits


@pytest.mark.parametrize("given, want", [
    ("8GiB", ML.MemoryLimit(bytes=8 * GiB)), ("512 MiB", ML.MemoryLimit(bytes=512 * 2**20)),
    ("1.5GB", ML.MemoryLimit(bytes=1_500_000_000)), (123456, ML.MemoryLimit(bytes=123456)),
    (0.8, ML.MemoryLimit(fraction=0.8)), ("80%", ML.MemoryLimit(fraction=0.8)), (1.0, ML.MemoryLimit(fraction=1.0)),
])
def test_memory_limit_forms(given, want):
    assert ML.parse(given) == want


@pytest.mark.parametrize("bad", ["8 parsecs", "", "-1GiB", 0, -5, 1.5, 0.0, True, "150%", [8], "GiB"])
def test_a_bad_memory_limit_says_what_to_give(bad):
    with pytest.raises(ValueError, match=r"auto_memory_limit="):
        ML.parse(bad)


def test_a_fraction_is_of_the_device_shared_by_its_processes():
    host = ML.device_bytes("cpu")
    assert host > 2**28
    assert ML.per_process(ML.MemoryLimit(fraction=0.5), ["cpu"] * 4) == [int(0.5 * host / 4)] * 4
    assert ML.per_process(ML.MemoryLimit(bytes=GiB), ["cpu"] * 3) == [GiB] * 3


def test_the_setting_is_for_auto_and_a_run_auto_can_profile():
    assert RunConfig.from_kwargs("auto", 4, auto_memory_limit="2GiB").auto_memory_limit == "2GiB"
    with pytest.raises(ValueError, match="is for schedule='auto'"):
        RunConfig.from_kwargs("1f1b", 4, auto_memory_limit="2GiB")
    with pytest.raises(ValueError, match="data_parallel=2"):
        RunConfig.from_kwargs("auto", 4, auto_memory_limit="2GiB", data_parallel=2)
    with pytest.raises(ValueError, match="auto_memory_limit='lots'"):
        RunConfig.from_kwargs("auto", 4, auto_memory_limit="lots")
