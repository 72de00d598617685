"""Traces read back (pipeq.trace), their numbers, bubble and text (pipeq.trace.report), the pictures
(pipeq.trace.plot) and the CLI.

Traces here are synthetic (no processes): a hand-made two-stage step with every number worked out
below, schedules' planned timelines (:func:`pipeq.trace.planned_trace`), and a small simulator that
runs the lowered action lists with sends that take time and records the waits, as a traced run would.
"""

from __future__ import annotations

import json
import sys

import pytest

from pipeq.trace import plot as P
from pipeq.trace import report as R
from pipeq import schedules as S
from pipeq.trace import format as T
from pipeq.launch.cli import main
from pipeq.schedules import Op

pytestmark = pytest.mark.timeout(60)

PNG = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- trace builders


def _meta(schedule: str, n: int, m: int, replicas: int = 1) -> dict:
    return {"pipeq_trace_version": 1, "schedule": schedule, "n_stages": n, "microbatches": m,
            "replicas": replicas, "clock_offsets_us": [0.0] * n}


def _x(name, cat, stage, ts, dur, step=0, mb=-1, op=None, nbytes=0, replica=0, training=True) -> dict:
    op = op or {"forward": "F", "backward": "B", "step": "STEP"}.get(cat, cat.upper())
    return {"ph": "X", "name": name, "cat": cat, "pid": replica, "tid": stage, "ts": ts, "dur": dur,
            "args": {"stage": stage, "replica": replica, "step": step, "microbatch": mb, "bytes": nbytes,
                     "op": op, "training": training}}


def _driver(n: int, step: int, ts: float, dur: float, replica: int = 0, training: bool = True) -> dict:
    return {"ph": "X", "name": f"step {step}", "cat": "driver", "pid": replica, "tid": n, "ts": ts, "dur": dur,
            "args": {"step": step, "replica": replica, "training": training}}


def hand_trace(with_wait_act0: bool = True) -> dict:
    """2 stages x 2 microbatches, fill-drain, one step (times in us):

    stage 0: F0 0-100 | send act0 100-110 | F1 110-210 | send act1 210-220 | wait grad0 220-530
             | B0 530-730 | wait grad1 730-740 | B1 740-940 | STEP 940-990
    stage 1: wait act0 0-110 | F0 110-210 | wait act1 210-220 | F1 220-320 | B0 320-520
             | send grad0 520-530 | B1 530-730 | send grad1 730-740 | STEP 740-800
    driver:  step 0 from -10 to 1000. Wall: stage 0's F0 start to its STEP end, 990.
    Activations 1000 B, gradients 800 B.
    Plus an unknown "gc" span on stage 0 (ignored in the numbers).
    """
    ev = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "replica 0"}},
          {"ph": "M", "name": "thread_name", "pid": 0, "tid": 2, "args": {"name": "driver"}},
          _x("F0", "forward", 0, 0, 100, mb=0), _x("send act 0", "send", 0, 100, 10, mb=0, op="SEND_ACT", nbytes=1000),
          _x("F1", "forward", 0, 110, 100, mb=1), _x("send act 1", "send", 0, 210, 10, mb=1, op="SEND_ACT", nbytes=1000),
          _x("wait grad 0", "wait", 0, 220, 310, mb=0, op="WAIT_GRAD", nbytes=800),
          _x("B0", "backward", 0, 530, 200, mb=0),
          _x("wait grad 1", "wait", 0, 730, 10, mb=1, op="WAIT_GRAD", nbytes=800),
          _x("B1", "backward", 0, 740, 200, mb=1), _x("STEP", "step", 0, 940, 50),
          _x("gc", "gc", 0, 990, 5),
          _x("F0", "forward", 1, 110, 100, mb=0),
          _x("wait act 1", "wait", 1, 210, 10, mb=1, op="WAIT_ACT", nbytes=1000),
          _x("F1", "forward", 1, 220, 100, mb=1), _x("B0", "backward", 1, 320, 200, mb=0),
          _x("send grad 0", "send", 1, 520, 10, mb=0, op="SEND_GRAD", nbytes=800),
          _x("B1", "backward", 1, 530, 200, mb=1),
          _x("send grad 1", "send", 1, 730, 10, mb=1, op="SEND_GRAD", nbytes=800),
          _x("STEP", "step", 1, 740, 60), _driver(2, 0, -10, 1010)]
    if with_wait_act0:
        ev.append(_x("wait act 0", "wait", 1, 0, 110, mb=0, op="WAIT_ACT", nbytes=1000))
    return {"displayTimeUnit": "ms", "otherData": _meta("fill-drain", 2, 2), "traceEvents": ev}


def simulate(schedule: str, n: int, m: int, steps: int = 1, replicas: int = 1, *, f_us: float = 300.0,
             b_us: float = 600.0, step_us: float = 100.0, send_us: float = 20.0, slow_stage: int | None = None,
             predict_every: int = 0, extra_cat: bool = False) -> dict:
    """A traced run's file: the lowered schedule executed with sends that take ``send_us`` and
    waits recorded where a stage blocks for its input (``slow_stage`` computes twice as long)."""
    ev: list[dict] = []
    for r in range(replicas):
        for k in range(n + 1):
            ev.append({"ph": "M", "name": "thread_name", "pid": r, "tid": k,
                       "args": {"name": "driver" if k == n else f"stage {k}"}})
    t = 0.0
    for step in range(steps):
        training = not (predict_every and step % predict_every == predict_every - 1)
        lowered = S.build(schedule, n, m, training=training)
        end = t
        for r in range(replicas):
            end = max(end, _simulate_step(ev, lowered, r, step, t + 50, training, f_us, b_us, step_us,
                                          send_us, slow_stage, extra_cat))
            ev.append(_driver(n, step, t, end + 50 - t, replica=r, training=training))
        t = end + 100
    return {"displayTimeUnit": "ms", "otherData": _meta(schedule, n, m, replicas), "traceEvents": ev}


def _simulate_step(ev, lowered, r, step, t0, training, f_us, b_us, step_us, send_us, slow_stage, extra_cat) -> float:
    n = len(lowered)
    clock, pc, sent = [t0] * n, [0] * n, {}
    cost = {Op.FORWARD: f_us, Op.BACKWARD: b_us, Op.STEP: step_us}
    nbytes = {"act": 4096, "grad": 2048}
    while any(pc[k] < len(lowered[k]) for k in range(n)):
        for k in range(n):
            while pc[k] < len(lowered[k]):
                a = lowered[k][pc[k]]
                j = a.microbatch
                if a.op in S.COMPUTE_OPS:
                    d = cost[a.op] * (2 if k == slow_stage else 1)
                    cat = {Op.FORWARD: "forward", Op.BACKWARD: "backward", Op.STEP: "step"}[a.op]
                    ev.append(_x(str(a), cat, k, clock[k], d, step, j, a.op.value, 0, r, training))
                    clock[k] += d
                elif a.op in (Op.SEND_ACT, Op.SEND_GRAD):
                    kind = "act" if a.op is Op.SEND_ACT else "grad"
                    ev.append(_x(f"send {kind} {j}", "send", k, clock[k], send_us, step, j,
                                 f"SEND_{kind.upper()}", nbytes[kind], r, training))
                    clock[k] += send_us
                    sent[(k + 1 if kind == "act" else k - 1, kind, j)] = clock[k]
                else:
                    kind = "act" if a.op is Op.RECV_ACT else "grad"
                    if (k, kind, j) not in sent:
                        break
                    arrive = sent.pop((k, kind, j))
                    ev.append(_x(f"wait {kind} {j}", "wait", k, clock[k], max(0.0, arrive - clock[k]), step, j,
                                 f"WAIT_{kind.upper()}", nbytes[kind], r, training))
                    clock[k] = max(clock[k], arrive)
                pc[k] += 1
    if extra_cat:
        ev.append(_x("gc", "gc", 0, max(clock) + 1, 30, step, -1, "GC", 0, r, training))
        return max(clock) + 31
    return max(clock)


def write(tmp_path, data, name="run.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


# ---------------------------------------------------------------- the numbers


def test_hand_trace_numbers():
    rep = R.analyze(T.trace_from_dict(hand_trace()))
    (step,) = rep.steps
    s0, s1 = step.stages
    assert step.wall_us == 990 and step.microbatches == 2
    assert (s0.compute_us, s0.send_us, s0.wait_us, s0.idle_us) == (650, 20, 320, 0)
    assert (s1.compute_us, s1.send_us, s1.wait_us, s1.idle_us) == (660, 20, 120, 190)
    assert (s0.bytes_sent, s0.bytes_received) == (2000, 1600)
    assert (s1.bytes_sent, s1.bytes_received) == (1600, 2000)
    assert step.bubble == pytest.approx(1 - 655 / 990)
    assert step.ideal_bubble == pytest.approx(1 / 3)
    assert step.slowest_stage == 1 and rep.slowest_stage == 1
    assert rep.stages[1].compute_fraction == pytest.approx(660 / 990)
    assert rep.bubble == pytest.approx(1 - 655 / 990)


def test_received_bytes_counted_from_the_sender_without_a_wait_event():
    rep = R.analyze(T.trace_from_dict(hand_trace(with_wait_act0=False)))
    s1 = rep.steps[0].stages[1]
    assert s1.bytes_received == 2000 and s1.wait_us == 10


def test_wall_is_the_extent_of_compute_and_sends_with_or_without_driver_span():
    data = hand_trace()
    data["traceEvents"] = [e for e in data["traceEvents"] if e.get("cat") != "driver"]
    step = R.analyze(T.trace_from_dict(data)).steps[0]
    assert step.wall_us == 990  # F0 at 0 .. STEP's end at 990 (neither waits nor the gc span count)
    assert step.stages[0].idle_us == 0 and step.stages[1].idle_us == 990 - 660 - 20 - 120


def _expected_plan_bubble(schedule: str, n: int, m: int, c: int) -> float:
    """From the dry run itself: mean over stages of 1 - busy / makespan (STEP takes one unit)."""
    timeline = S.dry_run(S.build(schedule, n, m), cost={Op.BACKWARD: c})
    units = {Op.FORWARD: 1, Op.BACKWARD: c, Op.STEP: 1}
    makespan = max(t + units[a.op] for row in timeline for t, a in row)
    busy = [sum(units[a.op] for _, a in row) for row in timeline]
    return sum(1 - b / makespan for b in busy) / n


@pytest.mark.parametrize("schedule", ["fill-drain", "1f1b"])
@pytest.mark.parametrize("n,m", [(3, 4), (4, 8), (4, 4)])
@pytest.mark.parametrize("c", [1, 2])
def test_planned_bubble_is_exact(schedule, n, m, c):
    rep = R.analyze(T.trace_from_dict(T.planned_trace(schedule, n, m, backward_cost=c)))
    expected = _expected_plan_bubble(schedule, n, m, c)
    # equal stage costs: makespan (m+N-1)(1+c) + 1, every stage busy m(1+c) + 1
    assert expected == pytest.approx(1 - (m * (1 + c) + 1) / ((m + n - 1) * (1 + c) + 1))
    assert rep.bubble == pytest.approx(expected)
    assert rep.ideal_bubble == pytest.approx((n - 1) / (m + n - 1))
    assert rep.steps[0].microbatches == m


def test_planned_trace_format_and_save(tmp_path):
    plan = T.planned_trace("1f1b", 3, 4, backward_cost=2, unit_us=10.0)
    assert plan["otherData"]["pipeq_trace_version"] == 1 and plan["otherData"]["n_stages"] == 3
    xs = [e for e in plan["traceEvents"] if e["ph"] == "X" and e["cat"] != "driver"]
    assert len(xs) == 3 * (2 * 4 + 1)
    b = next(e for e in xs if e["name"] == "B0")
    assert b["dur"] == 20.0 and b["args"]["op"] == "B" and b["args"]["microbatch"] == 0
    path = T.save_trace(plan, tmp_path / "plan.json")
    trace = T.load_trace(path)
    assert trace.n_stages == 3 and trace.driver == {(0, 0): (0.0, 19 * 10.0)}


def test_simulated_run_slow_stage_and_skip_first():
    trace = T.trace_from_dict(simulate("1f1b", 3, 4, steps=4, slow_stage=2))
    rep = R.analyze(trace, skip_first=1)
    assert [s.step for s in rep.steps] == [1, 2, 3] and rep.skipped == [0]
    assert rep.slowest_stage == 2 and all(s.slowest_stage == 2 for s in rep.steps)
    for s in rep.steps:
        for row in s.stages:
            assert row.idle_us >= 0
            assert row.compute_us + row.send_us + row.wait_us + row.idle_us == pytest.approx(s.wall_us)
    s0 = rep.stages[0]  # per step: sends 4 activations, receives 4 gradients
    assert s0.per_step(s0.bytes_sent) == 4 * 4096 and s0.per_step(s0.bytes_received) == 4 * 2048
    with pytest.raises(ValueError, match="skip_first"):
        R.analyze(trace, skip_first=-1)
    with pytest.raises(ValueError, match="no training steps.*skipping the first 4"):
        R.analyze(trace, skip_first=4)


def test_predict_steps_left_out_unless_asked():
    trace = T.trace_from_dict(simulate("fill-drain", 2, 4, steps=4, predict_every=2))
    assert [s.step for s in R.analyze(trace).steps] == [0, 2]
    rep = R.analyze(trace, include_predict=True)
    assert [(s.step, s.training) for s in rep.steps] == [(0, True), (1, False), (2, True), (3, False)]
    assert "predict" in R.format_report(rep)
    only_predict = T.trace_from_dict(simulate("fill-drain", 2, 4, steps=2, predict_every=1))
    with pytest.raises(ValueError, match="--include-predict"):
        R.analyze(only_predict)


def test_steps_selection():
    trace = T.trace_from_dict(simulate("1f1b", 2, 2, steps=6))
    assert [s.step for s in R.analyze(trace, steps=R.parse_steps("2-4")).steps] == [2, 3, 4]
    assert [s.step for s in R.analyze(trace, steps=5).steps] == [5]
    assert R.select_steps(trace, None) == {5}
    with pytest.raises(ValueError, match="no step 9; its steps are 0-5"):
        R.analyze(trace, steps=9)
    for bad in ("x", "3-1", "1-"):
        with pytest.raises(ValueError, match="--steps"):
            R.parse_steps(bad)


def test_unknown_category_is_tolerated(tmp_path):
    trace = T.trace_from_dict(simulate("1f1b", 3, 4, steps=2, extra_cat=True))
    assert any(e.cat == "gc" for e in trace.events)
    rep = R.analyze(trace)
    plain = R.analyze(T.trace_from_dict(simulate("1f1b", 3, 4, steps=2)))
    assert rep.stages[0].compute_us == plain.stages[0].compute_us
    out = P.plot_trace(trace, tmp_path / "gc.png", steps="all")
    assert open(out, "rb").read(8) == PNG


def test_replicas():
    trace = T.trace_from_dict(simulate("1f1b", 2, 4, steps=2, replicas=2))
    assert trace.replicas == 2
    rep = R.analyze(trace)
    assert len(rep.steps) == 4 and rep.stages[0].steps == 4
    text = R.format_report(rep)
    lines = text.splitlines()
    assert "2 replicas" in lines[0] and "mean over 2 steps x 2 replicas" in text
    assert lines[lines.index("per step") + 1].split()[:2] == ["step", "replica"]


# ---------------------------------------------------------------- the text


def test_format_report_hand_trace():
    text = R.format_report(R.analyze(T.trace_from_dict(hand_trace())))
    lines = text.splitlines()
    assert lines[0] == "pipeq trace: fill-drain, 2 stages x 2 microbatches; 1 training step"
    stage0 = next(line for line in lines if line.split()[:1] == ["0"])
    assert stage0.split() == ["0", "0.65", "0.02", "0.32", "0.00", "65.7%", "34.3%", "0.004"]
    step0 = lines[lines.index("per step") + 2]
    assert step0.split() == ["0", "0.99", "33.8%", "33.3%", "1"]
    assert lines[-3] == "slowest stage: 1 (67% of the step time computing)"
    assert lines[-2] == "bubble: measured 33.8% vs ideal 33.3% (fill-drain's dry run at F=I=W=1 for N=2, m=2)"
    assert lines[-1].startswith("this run's measured costs: 1F1B ") and "(best: " in lines[-1]


def test_format_report_elides_long_runs():
    rep = R.analyze(T.trace_from_dict(simulate("1f1b", 2, 2, steps=25)))
    lines = R.format_report(rep).splitlines()
    table = lines[lines.index("per step") + 2: lines.index("per step") + 2 + 16]
    assert [row.split()[0] for row in table] == [*map(str, range(10)), "...", *map(str, range(20, 25))]
    assert "25 training steps" in lines[0]


# ---------------------------------------------------------------- reading


@pytest.mark.parametrize("content,message", [
    ("{not json", "is not JSON"),
    ([{"ph": "X"}], "bare list of trace events"),
    ({"otherData": {"pipeq_trace_version": 1}}, "has no traceEvents"),
    ({"traceEvents": []}, "no otherData.pipeq_trace_version"),
    ({"traceEvents": [], "otherData": {"pipeq_trace_version": 2}}, "version 2; this pipeq reads version 1"),
    ({"traceEvents": [], "otherData": {"pipeq_trace_version": 1}}, "no timed events"),
    ({"traceEvents": [{"ph": "X", "name": "F0", "dur": 1, "args": {"stage": 0, "step": 0}}],
      "otherData": {"pipeq_trace_version": 1}}, r"traceEvents\[0\] \('F0'\) has no 'ts'"),
    ({"traceEvents": [{"ph": "X", "name": "F0", "ts": 0, "dur": "x", "args": {"stage": 0, "step": 0}}],
      "otherData": {"pipeq_trace_version": 1}}, "non-numeric"),
    ({"traceEvents": [{"ph": "X", "name": "F0", "ts": 0, "dur": 1, "args": {"step": 0}}],
      "otherData": {"pipeq_trace_version": 1}}, r"has no args.stage"),
    ({"traceEvents": [{"ph": "X", "name": "F0", "ts": 0, "dur": 1}],
      "otherData": {"pipeq_trace_version": 1}}, "has no args"),
    ({"traceEvents": [{"ph": "X", "name": "F0", "ts": 0, "dur": 1, "args": {"stage": 3, "step": 0}}],
      "otherData": {"pipeq_trace_version": 1, "n_stages": 2}}, "on stage 3, but the trace says n_stages=2"),
])
def test_load_trace_rejects(tmp_path, content, message):
    path = write(tmp_path, content, "bad.json")
    with pytest.raises(ValueError, match=message) as info:
        T.load_trace(path)
    assert "bad.json" in str(info.value)


def test_load_trace_missing_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read trace .*nope.json"):
        T.load_trace(tmp_path / "nope.json")


def test_load_trace_round_trip(tmp_path):
    trace = T.load_trace(write(tmp_path, hand_trace()))
    assert trace.n_stages == 2 and trace.replicas == 1 and trace.driver == {(0, 0): (-10.0, 1010.0)}
    f0 = next(e for e in trace.events if e.name == "F0" and e.stage == 1)
    assert (f0.replica, f0.step, f0.microbatch, f0.op, f0.cat, f0.start_us, f0.dur_us, f0.training) == (
        0, 0, 0, "F", "forward", 110.0, 100.0, True)


# ---------------------------------------------------------------- the pictures


def test_plot_default_and_all(tmp_path):
    trace = T.trace_from_dict(simulate("1f1b", 3, 4, steps=3, predict_every=3))
    for steps, name in ((None, "last.png"), ("all", "all.png"), (1, "one.png"), (range(0, 2), "two.png")):
        out = P.plot_trace(trace, tmp_path / name, steps=steps)
        data = open(out, "rb").read()
        assert data[:8] == PNG and len(data) > 5000


def test_plot_replicas_and_plan(tmp_path):
    out = P.plot_trace(T.trace_from_dict(simulate("1f1b", 2, 4, replicas=2)), tmp_path / "r.png", title="two")
    assert open(out, "rb").read(8) == PNG
    out = P.plot_trace(T.planned_trace("fill-drain", 4, 8), tmp_path / "plan.png", steps="all")
    assert open(out, "rb").read(8) == PNG


def test_plot_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(RuntimeError, match=r"needs matplotlib: pip install matplotlib"):
        P.plot_trace(T.planned_trace("1f1b", 2, 2), tmp_path / "x.png")


# ---------------------------------------------------------------- the command


def test_cli_report_and_plot(tmp_path, capsys):
    path = write(tmp_path, simulate("1f1b", 3, 4, steps=5, slow_stage=1))
    png = tmp_path / "run.png"
    assert main(["report", path, "--skip-first", "1", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "4 training steps (skipped the first 1: step 0)" in out
    assert "slowest stage: 1" in out and "bubble: measured" in out and f"plot: {png}" in out
    assert png.read_bytes()[:8] == PNG
    assert main(["report", path, "--steps", "2-3"]) == 0
    assert "2 training steps" in capsys.readouterr().out


def test_cli_report_errors(tmp_path, capsys):
    assert main(["report", write(tmp_path, "{", "broken.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipeq: ") and "broken.json is not JSON" in err
    assert main(["report", write(tmp_path, simulate("1f1b", 2, 2)), "--steps", "a-b"]) == 2
    assert "--steps takes all, N or N-M" in capsys.readouterr().err


def test_cli_schedule_plot(tmp_path, capsys):
    png = tmp_path / "plan.png"
    assert main(["schedule", "1f1b", "--stages", "3", "--microbatches", "4", "--plot", str(png)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "1f1b: 3 stages x 4 microbatches" and out[-1] == f"plot: {png}"
    assert png.read_bytes()[:8] == PNG
