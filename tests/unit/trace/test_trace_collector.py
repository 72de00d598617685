"""The driver's side of a traced run (pipeq.control.trace_collector): each stage's clock is
measured against the driver's, and every stage's recorded actions are merged onto the driver's
time axis, in this process.

The two stages run as threads (tests/support/inproc.py) whose clocks are set apart from the
driver's, as the clocks of processes on other hosts are: ``time.perf_counter_ns`` answers each
stage thread with its own offset. Every clock is moved ahead of the real one, never back: a real
``perf_counter_ns`` counts from its host's boot and is never negative (the TIME message refuses a
negative one), so a stage clock "behind" the driver's is one that is less far ahead.
"""

from __future__ import annotations

import functools
import threading
import time

import pytest
import torch
from torch import nn

from inproc import InProcessPipeline
from pipeq.trace.format import load_trace

DAY_NS = 86_400 * 10**9
#: the driver's clock (every thread but the stages'), ahead of the real one by this much
DRIVER_AHEAD = DAY_NS
#: each stage thread's clock, ahead of the real one: stage 0's an hour behind the driver's, stage 1's
#: three days ahead of it
AHEAD = {"inproc-stage0": DRIVER_AHEAD - 3_600 * 10**9, "inproc-stage1": DRIVER_AHEAD + 3 * DAY_NS}
SLACK_US = 20_000.0  # clock alignment is good to half the fastest round trip; generous for a busy machine


@pytest.fixture
def stage_clocks(monkeypatch):
    real = time.perf_counter_ns

    def clock() -> int:
        return real() + AHEAD.get(threading.current_thread().name, DRIVER_AHEAD)

    monkeypatch.setattr(time, "perf_counter_ns", clock)


class Slow(nn.Linear):
    """A forward long enough (5 ms) for the order of events to show beyond the alignment's error."""

    def forward(self, x):
        time.sleep(0.005)
        return super().forward(x)


@pytest.mark.timeout(60)
def test_stage_events_land_inside_the_driver_steps_whatever_the_stage_clocks(tmp_path, stage_clocks) -> None:
    path = str(tmp_path / "run.trace.json")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    with InProcessPipeline([Slow(4, 6), Slow(6, 3)], nn.CrossEntropyLoss(),
                           functools.partial(torch.optim.SGD, lr=0.1), microbatches=2, trace_path=path) as pipe:
        pipe.backend.recorder.measure_clocks(pipe.sup, iter(range(-1000, -2000, -1)).__next__)  # as a run starts
        for _ in range(2):
            pipe.train(torch.randn(4, 4, generator=g), torch.randint(0, 3, (4,), generator=g))
    trace = load_trace(path)  # written when the pipeline closed
    assert trace.n_stages == 2 and trace.replicas == 1
    by = {(e.stage, e.step, e.op, e.microbatch): e for e in trace.events}
    for stage in (0, 1):
        for step in (0, 1):
            assert {(op, mb) for (s, st, op, mb) in by if (s, st) == (stage, step) and op in ("F", "B")} == {
                ("F", 0), ("F", 1), ("B", 0), ("B", 1)}
    for (stage, step, op, mb), e in by.items():  # everything a stage did for a step, inside its span
        start, dur = trace.driver[(0, step)]
        assert start - SLACK_US <= e.start_us and e.end_us <= start + dur + SLACK_US, (stage, step, op, mb)
    for step in (0, 1):
        for mb in (0, 1):  # stage 1 computes a microbatch after stage 0 has, and sends back before
            assert by[(1, step, "F", mb)].start_us >= by[(0, step, "F", mb)].end_us - SLACK_US
            assert by[(0, step, "B", mb)].start_us >= by[(1, step, "B", mb)].end_us - SLACK_US
    # the merged file says how far each stage's clock was from the driver's
    offsets = trace.meta["clock_offsets_us"]
    assert offsets == [pytest.approx((AHEAD["inproc-stage0"] - DRIVER_AHEAD) / 1e3, abs=SLACK_US),
                       pytest.approx((AHEAD["inproc-stage1"] - DRIVER_AHEAD) / 1e3, abs=SLACK_US)]
