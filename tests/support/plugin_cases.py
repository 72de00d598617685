"""The plug-in schedule's test cases (not a test module): its run in either mode, checked against one
process at half the learning rate, and the job file that names it."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pipeq
from models import float64_data, float64_stages3, flat_state, reference_train
from plugin_schedule import ReverseDrain

LR = 0.1
SGD = functools.partial(torch.optim.SGD, lr=LR)

#: a job of launch_jobs.py's MLP trained with ReverseDrain (SGD, no momentum: its halved steps are lr / 2)
JOB = """\
stages = "launch_jobs:mlp_stages"
loss = "torch.nn:CrossEntropyLoss"
optimizer = "torch.optim:SGD"
optimizer_args = { lr = 0.1 }
data = "launch_jobs:train_batches"
data_args = { batches = 3 }
schedule = "plugin_schedule:ReverseDrain"
microbatches = 4
steps = 3
"""


def check_trains_like_one_process(mode: str) -> None:
    """ReverseDrain's executor halves every gradient before SGD steps: one process at half the lr."""
    batches = [float64_data(12, seed=s) for s in range(3)]
    extra = {"start_method": "forkserver", "threads_per_stage": 1} if mode == "process" else {}
    with pipeq.PipelineRunner(float64_stages3(), nn.CrossEntropyLoss(), SGD, ReverseDrain(), 4, mode=mode,
                              **extra) as runner:
        losses = [runner.step(x, y) for x, y in batches]
        state = runner.state_dict()
    model, want = reference_train(float64_stages3(), nn.CrossEntropyLoss(),
                                  functools.partial(torch.optim.SGD, lr=LR / 2), batches)
    assert losses == pytest.approx(want, abs=1e-12)
    ref = flat_state(list(model))
    assert state.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(state[k], ref[k], atol=1e-12, rtol=0)
