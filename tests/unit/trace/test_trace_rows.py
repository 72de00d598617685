"""Traces without processes: tracing needs process mode, clocks days apart are aligned, a full ring buffer drops the steps it cut into."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pipeq
from models import mlp_stages
from pipeq.trace import format as trace

pytestmark = pytest.mark.timeout(180)


def test_trace_needs_process_mode() -> None:
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="process mode"):
        pipeq.PipelineRunner(mlp_stages(), nn.CrossEntropyLoss(), sgd, mode="simulated", trace="x.json")


def test_clock_offsets_are_aligned_even_days_apart() -> None:
    """Two hosts' monotonic clocks may differ by days and drift: the rows land on the driver's."""
    day = 86_400 * 10**9
    # stage clock = driver clock + day + drift (1 us per ms of driver time)
    def stage_ns(d: int) -> int:
        return d + day + d // 1000

    start = trace.best_offset([(1_000_000, stage_ns(1_000_100), 1_000_200),
                               (2_000_000, stage_ns(2_000_500), 2_001_000)])  # the first: least delay
    assert start.rtt_ns == 200 and start.offset_ns == pytest.approx(day + 1000, abs=1)
    end = trace.best_offset([(101_000_000, stage_ns(101_000_100), 101_000_200)])
    rows = trace.rows_to_tensor([(trace.F, 1, 0, stage_ns(51_000_000), stage_ns(51_010_000), 0)])
    built = trace.build(trace.TraceMeta("1f1b", 1, 1), [rows], [[start, end]],
                        [(1, True, 50_000_000, 52_000_000, 1)])
    ev = [e for e in built["traceEvents"] if e["ph"] == "X" and e["tid"] == 0][0]
    assert ev["ts"] == pytest.approx(1000.0, abs=1.0)  # 51 ms driver time, 1 ms after the span
    assert ev["dur"] == pytest.approx(10.0, abs=0.1)


def test_a_full_ring_buffer_drops_the_partly_overwritten_steps() -> None:
    rows = [trace.rows_to_tensor([(trace.F, s, 0, s, s + 1, 0) for s in (3, 4, 5)]),
            trace.rows_to_tensor([(trace.F, s, 0, s, s + 1, 0) for s in (2, 3, 4, 5)])]
    kept = trace.drop_partial_steps(rows, [True, False])  # stage 0's buffer was full: step 3 may be cut
    assert [t[:, 1].tolist() for t in kept] == [[4, 5], [4, 5]]
    assert trace.drop_partial_steps(rows, [False, False]) == rows


def test_one_stages_actions_never_overlap_whatever_the_clock_drift() -> None:
    ms = 1_000_000
    rows = trace.rows_to_tensor([(trace.WAIT_GRAD, 0, 0, 0, 13 * ms, 0), (trace.B, 0, 0, 13 * ms, 14 * ms, 0)])
    # two clock samples 300 ms apart whose offsets differ by 1 ms (a 0.3% drift, or noise)
    clocks = [[trace.ClockSample(at_ns=0, offset_ns=0.0, rtt_ns=10_000),
               trace.ClockSample(at_ns=300 * ms, offset_ns=1.0 * ms, rtt_ns=10_000)]]
    built = trace.build(trace.TraceMeta("1f1b", 1, 1), [rows], clocks, [])
    wait, back = sorted((e for e in built["traceEvents"] if e["ph"] == "X"), key=lambda e: e["ts"])
    assert wait["ts"] + wait["dur"] <= back["ts"] + 1e-3, (wait, back)
