"""ZB-H1 (split backward) in process mode equals plain single-process training: uneven microbatches, clipping, a trace of I and W rows, and data_parallel=2."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from torch import nn

import pipeq
from models import flat_state, float64_data, float64_stages3, reference_train
from runner_cases import assert_matches_reference

pytestmark = pytest.mark.timeout(240)

FAST = dict(start_method="forkserver", threads_per_stage=1)
SGD64 = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def _train(stages, data, microbatches, **kw):
    with pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), SGD64, "zb-h1", microbatches, **{**FAST, **kw}) as r:
        losses = [r.step(x, y) for x, y in data]
        return losses, r.state_dict()


def test_zb_h1_in_processes_equals_one_process_and_traces_I_and_W(tmp_path):
    stages = float64_stages3()
    data = [float64_data(10, seed) for seed in (1, 2)]  # 4 microbatches of 3, 3, 2, 2
    path = tmp_path / "run.json"
    losses, state = _train(stages, data, 4, trace=str(path))
    assert_matches_reference(stages, data, losses, state, opt=SGD64, tol=1e-12)
    events = [e for e in json.loads(path.read_text())["traceEvents"]
              if e["ph"] == "X" and e["cat"] in ("forward", "backward", "step") and e["args"]["step"] == 1]
    for k, plan in enumerate(pipeq.schedules.zb_h1(3, 4)):  # each stage ran its plan, I and W named
        names = [e["name"] for e in sorted(events, key=lambda e: e["ts"]) if e["tid"] == k]
        assert names == [str(a) for a in plan]
        assert {e["args"]["op"] for e in events if e["tid"] == k and e["cat"] == "backward"} == {"I", "W"}


def test_zb_h1_with_clipping_and_data_parallel_2_equals_full_batch_training():
    stages = float64_stages3()
    data = [float64_data(12, seed) for seed in (3, 4)]  # each replica: 6 samples in 3 microbatches
    losses, state = _train(stages, data, 3, data_parallel=2, clip_grad_norm=0.5)
    model, ref_losses = reference_train(stages, nn.CrossEntropyLoss(), SGD64, data, clip=0.5)
    assert losses == pytest.approx(ref_losses, abs=1e-9)
    for name, want in flat_state(model).items():
        torch.testing.assert_close(state[name], want, atol=1e-9, rtol=0, msg=name)
