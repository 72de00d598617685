"""PIPEQ_FAULT in process mode: each kind of injected failure is named by its stage, at its step, and leaves no process behind."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pipeq
from models import batches64, stages64

pytestmark = pytest.mark.timeout(120)

FAST = dict(start_method="forkserver", threads_per_stage=1)
SGD64 = functools.partial(torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize("kind,schedule,n,match", [
    ("raise", "1f1b", 3, r"injected fault \(PIPEQ_FAULT=stage:1,step:2,kind:raise\)"),
    ("kill", "1f1b", 3, r"stage 1: stage process \(pid \d+\) was killed by SIGKILL"),
    ("exit", "1f1b", 3, r"stage 1: stage process \(pid \d+\) exited with code 3"),
    ("hang", "1f1b", 3, r"stage 1.*step_timeout"),
    ("raise", "zbv", 4, r"stage 1 \(chunk 0 of its process\): RuntimeError: injected fault"),
])
def test_an_injected_fault_is_named_by_its_stage_at_its_step(monkeypatch, kind, schedule, n, match):
    monkeypatch.setenv("PIPEQ_FAULT", f"stage:1,step:2,kind:{kind}")
    batches = batches64(3)
    kw = dict(step_timeout=1.5, heartbeat_interval=0.25) if kind == "hang" else {}
    with pipeq.PipelineRunner(stages64(n), nn.CrossEntropyLoss(), SGD64, schedule, 4, **FAST, **kw) as r:
        r.step(*batches[0])  # step 1 trains
        with pytest.raises(pipeq.PipelineError, match=match) as info:
            r.step(*batches[1])
    assert info.value.stage == 1


def test_a_malformed_fault_is_refused_before_any_process_starts(monkeypatch):
    monkeypatch.setenv("PIPEQ_FAULT", "stage:1,step:2,kind:melt")
    runner = pipeq.PipelineRunner(stages64(3), nn.CrossEntropyLoss(), SGD64, "1f1b", 4, **FAST)
    with pytest.raises(ValueError, match=r"PIPEQ_FAULT='stage:1,step:2,kind:melt': kind is one of"):
        runner.start()
