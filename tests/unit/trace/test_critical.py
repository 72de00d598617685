"""The critical path of a traced step, slot by slot (pipeq.trace.critical), on a hand-made trace
whose every number is worked out below; the stages' own clocks recovered from the file's clock
samples; the trace file keeping those samples (pipeq.trace.format.build)."""

from __future__ import annotations

import pytest
import torch

from pipeq.trace import critical as C
from pipeq.trace import format as T

pytestmark = pytest.mark.timeout(60)


def _x(stage, cat, op, ts, dur, mb=0, step=1, nbytes=0) -> dict:
    return {"ph": "X", "name": f"{op}{mb}", "cat": cat, "pid": 0, "tid": stage, "ts": ts, "dur": dur,
            "args": {"stage": stage, "replica": 0, "step": step, "microbatch": mb, "bytes": nbytes, "op": op,
                     "training": True}}


def hand(late_wait: bool = False, shift1: float = 0.0, samples: bool = False) -> dict:
    """1F1B, 2 stages, 1 microbatch, step 1 (us); the driver's step 0-1000:

    stage 0: F0 10-110 | send act 115-125 | wait grad 130-500 | B0 520-720 | STEP 725-745
    stage 1: wait act 20-140 | F0 150-250 | B0 255-455 | send grad 460-475 | STEP 480-490

    The path (walking back from stage 0's STEP, the last end): F0@0 (start) -> F0@1 (message:
    the send ends at 125, stage 1 waited since 20: wake-up 15) -> B0@1 (local) -> B0@0 (message
    sent at 475 > stage 0's F0 end, 110; wake-up 25) -> STEP@0 (local). With ``late_wait`` stage
    1's wait for the activation begins after it was sent: 130-140 (sent-wait 5, recv 10).
    ``shift1``: stage 1's times written ``shift1`` us early, as a clock offset estimated that far
    off would write them; ``samples``: the file keeps the clock samples that undo it."""
    w0 = 130.0 if late_wait else 20.0
    s1 = -shift1
    ev = [_x(0, "forward", "F", 10, 100), _x(0, "send", "SEND_ACT", 115, 10, nbytes=512),
          _x(0, "wait", "WAIT_GRAD", 130, 370, nbytes=512), _x(0, "backward", "B", 520, 200),
          _x(0, "step", "STEP", 725, 20, mb=-1),
          _x(1, "wait", "WAIT_ACT", w0 + s1, 140 - w0, nbytes=512), _x(1, "forward", "F", 150 + s1, 100),
          _x(1, "backward", "B", 255 + s1, 200), _x(1, "send", "SEND_GRAD", 460 + s1, 15, nbytes=512),
          _x(1, "step", "STEP", 480 + s1, 10, mb=-1),
          {"ph": "X", "name": "step 1", "cat": "driver", "pid": 0, "tid": 2, "ts": 0, "dur": 1000,
           "args": {"step": 1, "replica": 0, "training": True}}]
    meta = {"pipeq_trace_version": 1, "schedule": "1f1b", "n_stages": 2, "microbatches": 1, "replicas": 1}
    if samples:  # offset = stage time - driver time; the file wrote stage time - offset
        meta.update(clock_origin_ns=5_000_000.0,
                    clock_samples=[[[0, 0.0, 100]], [[0, shift1 * 1e3, 100], [10**9, shift1 * 1e3, 100]]])
    return {"traceEvents": ev, "otherData": meta}


def _path(data: dict, **kw) -> list[C.Slot]:
    cp = C.critical_path(T.trace_from_dict(data), skip_first=0, **kw)
    assert list(cp.steps) == [1]
    return cp.steps[1]


def test_the_path_and_its_parts_add_up_to_each_slot():
    slots = _path(hand())
    assert [(s.stage, s.op, s.edge) for s in slots] == [
        (0, "F", "start"), (1, "F", "msg"), (1, "B", "local"), (0, "B", "msg"), (0, "STEP", "local")]
    assert [s.slot_us for s in slots] == pytest.approx([110, 140, 205, 265, 25])
    expect = [{"start": 10, "compute": 100},
              {"interp": 5 + 10, "send": 10, "wake": 15, "compute": 100},
              {"interp": 5, "compute": 200},
              {"interp": 5 + 20, "send": 15, "wake": 25, "compute": 200},
              {"interp": 5, "compute": 20}]
    for s, want in zip(slots, expect):
        assert s.parts == pytest.approx(want), s
        assert sum(s.parts.values()) == pytest.approx(s.slot_us)


def test_a_message_sent_before_its_receiver_waits_is_a_sent_wait_then_a_receive():
    f1 = _path(hand(late_wait=True))[1]
    assert f1.parts == pytest.approx({"interp": 15, "send": 10, "sent-wait": 5, "recv": 10, "compute": 100})


class _Inner:
    def within(self, stage, t0, t1):
        return [(20.0, 100.0, 70.0)] if (stage, t0) == (0, 10.0) else []


def test_inner_spans_split_compute_and_codec_moves_out_of_send_and_wake():
    slots = _path(hand(), inner=_Inner(), codec=lambda nbytes: (3.0, 4.0))
    assert slots[0].parts == pytest.approx({"start": 10, "compute": 70, "late": 10, "autograd": 20})
    # an action without inner spans: the stage did no work of its own in it, all of it is overhead
    assert slots[1].parts == pytest.approx({"interp": 15, "send": 7, "wake": 11, "codec": 7, "autograd": 100})


def test_the_stages_own_clock_is_recovered_from_the_samples():
    """Stage 1 written 30 us early (a bad offset estimate) puts its wait's end before the send:
    the file's aligned times mislead; with the clock samples the path is the true one again."""
    off = _path(hand(shift1=30.0))
    assert off[1].parts.get("wake", 0.0) == 0.0  # the wait "ended" (110) before the send did (125)
    back = _path(hand(shift1=30.0, samples=True))
    assert [s.parts for s in back] == [s.parts for s in _path(hand())]


def test_the_table_names_every_kind_and_the_path_sums_to_the_step():
    text = C.format_critical(C.critical_path(T.trace_from_dict(hand()), skip_first=0), per_slot=True)
    for kind in ("F msg", "B msg", "B local", "F start", "STEP local", "sum per step"):
        assert kind in text
    assert "path 0.74 ms" in text  # 745 us: the slots cover the step's start to its last action's end


def test_a_built_trace_keeps_its_clock_origin_and_samples():
    rows = [torch.tensor([[T.F, 1, 0, 2_000_000, 2_100_000, 0]], dtype=torch.int64)]
    clocks = [[T.ClockSample(at_ns=1_000_000, offset_ns=500.0, rtt_ns=80)]]
    built = T.build(T.TraceMeta("1f1b", 1, 1), rows, clocks, [(1, True, 1_900_000, 2_200_000, 1)])
    other = built["otherData"]
    assert other["clock_origin_ns"] == 1_900_000
    assert other["clock_samples"] == [[[1_000_000, 500.0, 80]]]
    back = C.stage_clock(other, 0)
    ev = next(e for e in built["traceEvents"] if e.get("cat") == "forward")
    assert back(ev["ts"]) == pytest.approx((2_000_000 - 1_900_000) / 1e3)


def test_a_step_that_begins_while_a_process_is_still_busy_counts_from_its_last_action():
    """Step 2 is step 1 750 us later, its driver span starting at 700: stage 0 was busy with step
    1's STEP until 745, so step 2's first slot begins there (start 15 us, not 60)."""
    one = hand()
    two = [{**e, "ts": e["ts"] + 750, "args": {**e["args"], "step": 2}}
           for e in one["traceEvents"] if e["cat"] != "driver"]
    two.append({"ph": "X", "name": "step 2", "cat": "driver", "pid": 0, "tid": 2, "ts": 700, "dur": 1000,
                "args": {"step": 2, "replica": 0, "training": True}})
    cp = C.critical_path(T.trace_from_dict({**one, "traceEvents": one["traceEvents"] + two}), skip_first=1)
    first = cp.steps[2][0]
    assert (first.op, first.edge, first.slot_us) == ("F", "start", pytest.approx(115))
    assert first.parts == pytest.approx({"start": 15, "compute": 100})


def test_pipeq_report_prints_the_critical_path(tmp_path, capsys):
    from pipeq.launch.cli import main

    path = T.save_trace(hand(), tmp_path / "run.json")
    assert main(["report", path, "--critical-path"]) == 0
    out = capsys.readouterr().out
    assert "critical path: 1f1b, 2 stages, 1 steps" in out and "B msg" in out


def test_a_trace_of_several_hosts_keeps_the_aligned_times():
    data = hand(shift1=30.0, samples=True)
    data["otherData"]["hosts"] = ["a", "b"]
    assert C.host_clock(T.trace_from_dict(data)) is None
    assert [s.parts for s in _path(data)] == [s.parts for s in _path(hand(shift1=30.0))]
