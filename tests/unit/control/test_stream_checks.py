"""runner.stream's settings checked, asynchronous 1F1B's warm-up plans, and reports that rebuild a schedule from a trace's labels (no process)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pipeq
from pipeq.research.al.executor import build_al
from models import mlp_stages

FAST = dict(start_method="forkserver")
MOMENTUM = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
ADAM = functools.partial(torch.optim.Adam, lr=0.01)
WIDTHS = (8, 12, 12, 10, 3)  # four stages


def batches(n: int, size: int = 12, seed: int = 0, width: int = 8, classes: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, width, generator=g), torch.randint(0, classes, (size,), generator=g))
            for _ in range(n)]


def model_for(schedule: str):
    """(stages, optimizer, extra runner kwargs) for one schedule of the equality list."""
    if schedule == "al":
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(8, 12), nn.ReLU()), nn.Linear(12, 10), nn.Sequential(nn.Linear(10, 8), nn.Tanh())]
        return build_al(blocks, [12, 10, 8], 3, label_widths=[6, 5, 5]), None, ADAM, {}
    stages = mlp_stages(WIDTHS, seed=1)
    kw = {}
    if schedule in ("global", "local", "pairwise", "nwise"):
        torch.manual_seed(2)
        kw["aux_heads"] = [nn.Linear(w, 3) for w in WIDTHS[1:-1]]
    return stages, nn.CrossEntropyLoss(), MOMENTUM, kw


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
