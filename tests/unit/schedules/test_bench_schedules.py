"""bench/bench_schedules.py imports, parses its options and computes its ideals (no process starts)."""

from __future__ import annotations

import argparse
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_schedules", os.path.join(ROOT, "bench", "bench_schedules.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def test_arguments(bench):
    a = bench.parse_args(["--costs", "5,5,5", "1,2,0.5", "--only", "zbv", "--only", "tdp:1f1b", "--steps", "4"])
    assert a.costs == [(5.0, 5.0, 5.0), (1.0, 2.0, 0.5)] and a.steps == 4 and a.part == "both"
    assert bench.parse_args([]).costs == [(5.0, 5.0, 5.0), (1.0, 1.0, 1.0)]
    assert bench.wanted(a.only, "pipeq", "zbv") and bench.wanted(a.only, "tdp", "1f1b")
    assert not bench.wanted(a.only, "pipeq", "1f1b")
    for bad in ("5,5", "a,b,c", "1,-1,1"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_costs(bad)


def test_ideals(bench):
    costs = (5.0, 5.0, 5.0)
    # (m+N-1)(F+I+W), less stage 0's input gradient, which a SleepStage does not sleep
    assert bench.pipeq_ideal("1f1b", 4, 8, costs) == pytest.approx(11 * 15 - 5)
    assert bench.pipeq_ideal("fill-drain", 4, 8, costs) == pytest.approx(11 * 15 - 5)
    zb = bench.pipeq_ideal("zb-h1", 4, 8, costs)
    assert zb < bench.pipeq_ideal("1f1b", 4, 8, costs)
    from pipeq import schedules
    from pipeq.schedules import Op

    plan = schedules.resolve("zb-h1").plan(4, 8)  # TDP's order read back as pipeq's: the same path
    order = [[(p, a.op.value, a.microbatch) for a in acts if a.op is not Op.STEP] for p, acts in enumerate(plan)]
    assert bench.order_ideal(order, 8, costs) == pytest.approx(zb)
    for name in ("interleaved-1f1b", "looped-bfs", "zbv", "dualpipev"):  # the 2-chunk schedules: below 1F1B's
        assert bench.pipeq_ideal(name, 4, 8, costs) < 11 * 15
    assert bench.chunk_costs(costs, 0, 2) == {Op.FORWARD: 2.5, Op.INPUT_GRAD: 0.0, Op.WEIGHT_GRAD: 2.5,
                                              Op.BACKWARD: 2.5, Op.STEP: 0.0}
    assert "microbatch 8 is out of range" in bench.order_ideal([[(0, "F", 8)]], 8, costs)
    v_order = [[(0, "F", 0), (1, "F", 0), (1, "B", 0), (0, "B", 0)]]  # one process holding both stages
    assert bench.order_ideal(v_order, 1, (2.0, 2.0, 2.0)) == pytest.approx(1 + 1 + 2 + 1)


def test_placement_and_table(bench):
    assert bench.tdp_runner.stage_ids(0, 4, 2, "v") == [0, 7]
    assert bench.tdp_runner.stage_ids(3, 4, 2, "v") == [3, 4]
    assert bench.tdp_runner.stage_ids(1, 4, 2, "loop") == [1, 5]
    rows = [bench._row("sleep 5/5/5", "1f1b", "pipeq", "PipelineRunner", {"times": [0.2, 0.21]}, 160.0, None),
            bench._row("sleep 5/5/5", "zbv", "pipeq", "PipelineRunner", {"status": "n/a (not in this build)"},
                       None, None),
            bench._row("sleep 5/5/5", "zbv", "tdp", "ScheduleZBVZeroBubble", {"times": [0.17]}, None, 127.5)]
    for r in rows:
        r["vs_1f1b"] = None
    text = bench.table(rows)
    assert "n/a (not in this build)" in text and "127.5*" in text and "1.28" in text


def test_fiw_rounds_table(bench):
    """--fiw: the median over every round's steps, the rounds' range, step over the ideal, the speed
    against the same side's 1F1B, and a row whose rounds all failed."""
    a = bench.parse_args(["--fiw", "--processes", "2", "--rounds", "2"])
    assert a.fiw and a.processes == 2 and a.rounds == 2 and a.fiw_ms == 4.0
    assert [name for name, _ in bench.FIW_ROWS] == ["1f1b", "zb-h1", "interleaved-1f1b", "zbv", "dualpipev"]
    out = {("1f1b", "pipeq"): {"ideal_ms": 100.0, "impl": "PipelineRunner",
                               "rounds": [{"times": [0.110, 0.120, 0.130]}, {"times": [0.140, 0.150, 0.160]}]},
           ("1f1b", "tdp"): {"ideal_ms": 100.0, "impl": "Schedule1F1B", "rounds": [{"error": "boom"}]},
           ("zbv", "pipeq"): {"ideal_ms": 80.0, "impl": "PipelineRunner", "rounds": [{"times": [0.090]}]},
           ("zbv", "tdp"): {"ideal_ms": 80.0, "impl": "ScheduleZBVZeroBubble", "rounds": []}}
    text, step = bench._fiw_cell(out[("1f1b", "pipeq")])
    assert step == pytest.approx(135.0)  # the median of all six steps
    assert text == "135.0 ms (120.0-150.0), 1.35x (1.20-1.50)"
    assert bench._fiw_cell(out[("1f1b", "tdp")]) == ("error: boom", None)
    table = bench.fiw_table(out, a)
    assert "90.0 ms, 1.12x" in table and "1.50" in table  # zbv: 135 / 90 = 1.5x 1F1B's speed
    assert "not run" in table
