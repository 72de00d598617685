"""``schedule="auto"`` in process mode: profiled on copies at the first step, it trains as the schedule it chose run directly, and traces under that schedule's label."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from torch import nn

import pipeq
from models import float64_data, float64_stages3

pytestmark = pytest.mark.timeout(240)

FAST = dict(start_method="forkserver", threads_per_stage=1)
SGD64 = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def _train(schedule, data, **kw):
    with pipeq.PipelineRunner(float64_stages3(), nn.CrossEntropyLoss(), SGD64, schedule, 4, **FAST, **kw) as r:
        return r, [r.step(x, y) for x, y in data], r.state_dict()


def test_auto_in_processes_trains_as_the_chosen_schedule(tmp_path):
    data = [float64_data(10, seed) for seed in (1, 2)]
    path = tmp_path / "run.json"
    runner, losses, state = _train("auto", data, trace=str(path))
    chosen = runner.auto_choice.schedule
    assert runner.schedule is chosen and json.loads(path.read_text())["otherData"]["schedule"] == chosen.label
    _, direct, direct_state = _train(chosen, data)
    assert losses == pytest.approx(direct, abs=1e-6)
    for k in state:
        torch.testing.assert_close(state[k], direct_state[k], atol=1e-6, rtol=0)
