"""runner.stream's settings checked, asynchronous 1F1B's warm-up plans, and reports that rebuild a schedule from a trace's labels (no process)."""

from __future__ import annotations

import pytest

import pipeq
from stream_cases import FAST, batches, model_for


def train_runner(**kw):
    stages, loss_fn, opt, _ = model_for("1f1b")
    return pipeq.PipelineRunner(stages, loss_fn, opt, "1f1b", 3, **FAST, **kw)


def test_in_flight_is_checked():
    runner = train_runner(mode="simulated")
    with runner:
        for bad in (0, -1, 1.5):
            with pytest.raises(ValueError, match="in_flight must be a positive integer"):
                runner.stream(batches(2), in_flight=bad)
        with pytest.raises(ValueError, match="queue_capacity"):
            runner.stream(batches(2), in_flight=100)


def test_async_warmup_plans():
    AsyncOneFOneB = pipeq.schedules.AsyncOneFOneB
    table = pipeq.schedules.format_table(AsyncOneFOneB(warmup=3), 2, 4)
    assert table.splitlines()[1].split("|")[1].split() == "F0 F1 F2 B0 ST F3 B1 ST . B2 ST . B3 ST".split()
    assert AsyncOneFOneB() == AsyncOneFOneB(warmup=None) != AsyncOneFOneB(warmup=4)
    with pytest.raises(pipeq.ScheduleError, match="warmup >= 3"):
        pipeq.schedules.build(AsyncOneFOneB(warmup=2), 4, 4)
    for bad in (0, 1.5, "3"):
        with pytest.raises(ValueError, match="warmup"):
            AsyncOneFOneB(warmup=bad)


def test_report_rebuilds_schedules_from_trace_labels():
    from pipeq.trace.report import schedule_of

    AsyncOneFOneB = pipeq.schedules.AsyncOneFOneB
    assert schedule_of("1f1b") == "1f1b"
    assert schedule_of("nwise(d=2)") == pipeq.schedules.Interlock("nwise", distance=2)
    assert schedule_of(AsyncOneFOneB(warmup=3).name) == AsyncOneFOneB(warmup=3)
    assert schedule_of("async") == AsyncOneFOneB()
    assert schedule_of("tests.mine:plan") is None
