"""Balance job cases: the job file of balance_jobs.py's model, written for a test, and the one-process check of a run of it."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from balance_jobs import train_batches, uneven_model
from models import reference_train

#: a job of uneven_model on train_batches (SGD, lr 0.1); a test adds its own keys
JOB = """\
model = "balance_jobs:uneven_model"
loss = "torch.nn:CrossEntropyLoss"
optimizer = "torch.optim:SGD"
optimizer_args = { lr = 0.1 }
data = "balance_jobs:train_batches"
microbatches = 4
steps = 4
"""


def job_file(tmp_path, extra: str, text: str = JOB) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text + extra)
    return str(path)


def assert_equals_reference(losses, state, seed: int) -> None:
    """The job's model (built under ``seed``) trained in one process on the first 4 batches, as
    JOB says (SGD, lr 0.1): the same losses and parameters."""
    torch.manual_seed(seed)
    model, ref_losses = reference_train(list(uneven_model()), nn.CrossEntropyLoss(),
                                        functools.partial(torch.optim.SGD, lr=0.1), train_batches(0)[:4])
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    assert list(state) == list(model.state_dict())
    for name, ref in model.state_dict().items():
        torch.testing.assert_close(state[name], ref, atol=1e-5, rtol=0, msg=name)
