"""Traces of real runs: every action of every stage, in the schedule's order, on one clock."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from torch import nn

import pipeq
from models import mlp_stages
from pipeq import schedules
from pipeq.trace import format as trace
from pipeq.schedules import Op
from pipeq.testing import SleepStage

pytestmark = pytest.mark.timeout(180)


def _x_events(t: dict) -> list[dict]:
    return [e for e in t["traceEvents"] if e["ph"] == "X"]


def test_traced_1f1b_run_has_every_action_in_schedule_order(tmp_path) -> None:
    path = tmp_path / "run.json"
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    steps = 2
    with pipeq.PipelineRunner(mlp_stages((8, 16, 16, 3)), nn.CrossEntropyLoss(), sgd, "1f1b", 4,
                              trace=str(path), start_method="forkserver") as runner:
        for _ in range(steps):
            runner.step(torch.randn(16, 8), torch.randint(0, 3, (16,)))
    text = path.read_text()
    t = json.loads(text)  # valid JSON, in Chrome's trace-event format
    assert t["otherData"]["pipeq_trace_version"] == trace.VERSION
    assert t["otherData"]["n_stages"] == 3 and t["otherData"]["schedule"] == "1f1b"
    events = _x_events(t)
    for e in events:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} <= set(e)
        assert e["dur"] >= 0 and e["ts"] >= 0
    names = {(e["tid"], e["args"]["name"]) for e in t["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {(0, "stage 0"), (1, "stage 1"), (2, "stage 2"), (3, "driver")}
    plan = schedules.build("1f1b", 3, 4)
    for k in range(3):
        mine = sorted((e for e in events if e["tid"] == k), key=lambda e: e["ts"])
        for a, b in zip(mine, mine[1:]):  # one stage does one thing at a time
            assert a["ts"] + a["dur"] <= b["ts"] + 1.0, (a, b)  # 1 us of float rounding
        for step in range(1, steps + 1):
            got = [(e["args"]["op"], e["args"]["microbatch"]) for e in mine
                   if e["args"]["step"] == step and e["cat"] in ("forward", "backward", "step")]
            want = [("STEP", -1) if a.op is Op.STEP else ("F" if a.op is Op.FORWARD else "B", a.microbatch)
                    for a in plan[k] if a.op in (Op.FORWARD, Op.BACKWARD, Op.STEP)]
            assert got == want, (k, step)
            sends = [e for e in mine if e["args"]["step"] == step and e["cat"] == "send"]
            waits = [e for e in mine if e["args"]["step"] == step and e["cat"] == "wait"]
            n_send = (4 if k < 2 else 0) + (4 if k > 0 else 0)  # activations on, gradients back
            assert len(sends) == n_send and len(waits) == n_send
            assert all(e["args"]["bytes"] > 0 for e in sends + waits)
    driver = [e for e in events if e["tid"] == 3]
    assert [e["args"]["step"] for e in driver] == [1, 2]
    # clocks aligned: no stage works on a step before the driver sent it, and the last stage's
    # work ends before the driver has its loss (earlier stages may still be in their backward)
    for d in driver:
        inside = [e for e in events if e["tid"] < 3 and e["args"]["step"] == d["args"]["step"]]
        assert min(e["ts"] for e in inside) >= d["ts"] - 50
        last = [e for e in inside if e["tid"] == 2 and e["cat"] in ("forward", "backward")]
        assert max(e["ts"] + e["dur"] for e in last) <= d["ts"] + d["dur"] + 50


def test_sleep_stages_bubble_is_the_ideal_formula(tmp_path) -> None:
    from pipeq.trace import report

    n, m, cost = 3, 4, 0.04  # long enough that wake-up delays of a loaded machine stay small
    path = tmp_path / "run.json"
    stages = [SleepStage(4, cost, cost) for _ in range(n)]
    with pipeq.PipelineRunner(stages, nn.MSELoss(), functools.partial(torch.optim.SGD, lr=0.01),
                              "1f1b", m, trace=str(path), start_method="forkserver") as runner:
        for _ in range(4):
            runner.step(torch.randn(8, 4), torch.randn(8, 4))
    rep = report.analyze(trace.load_trace(str(path)), skip_first=1)
    ideal = (n - 1) / (m + n - 1)
    assert rep.ideal_bubble == pytest.approx(ideal)
    assert abs(rep.bubble - ideal) < 0.05, (rep.bubble, ideal)
    print(report.format_report(rep))


def test_pipeq_report_and_plot_on_a_real_trace(tmp_path, capsys) -> None:
    from pipeq.launch import cli

    path = tmp_path / "run.json"
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    with pipeq.PipelineRunner(mlp_stages((8, 16, 16, 3)), nn.CrossEntropyLoss(), sgd, "fill-drain", 4,
                              trace=str(path), start_method="forkserver") as runner:
        for _ in range(3):
            runner.step(torch.randn(16, 8), torch.randint(0, 3, (16,)))
        runner.predict(torch.randn(4, 8))
    png = tmp_path / "run.png"
    assert cli.main(["report", str(path), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "pipeq trace: fill-drain, 3 stages x 4 microbatches; 3 training steps" in out
    assert "slowest stage:" in out and "vs ideal 33.3%" in out
    for k in range(3):
        assert any(line.split()[:1] == [str(k)] for line in out.splitlines())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
