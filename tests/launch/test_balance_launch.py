"""pipeq launch of a job that balances its model: measured once, trained with data parallelism."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from torch import nn

from balance_jobs import job_file, train_batches, uneven_model
from launch_util import SUPPORT, metrics, model_state
from models import reference_train

pytestmark = pytest.mark.timeout(60)


# -- job files ----------------------------------------------------------------------------------

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


@pytest.mark.timeout(90)
def test_launch_measures_once_and_trains_data_parallel(tmp_path, capsys) -> None:
    """pipeq launch of a job with a measured balance, two replicas of two stages (4 processes)."""
    from strays import wait_no_strays
    from pipeq.launch.cli import main

    out = tmp_path / "out"
    job = job_file(tmp_path, f'balance = "time"\nbalance_sample = "balance_jobs:sample"\nn_stages = 2\n'
                   f'data_parallel = 2\nout = "{out}"\n')
    cwd = os.getcwd()
    os.chdir(SUPPORT)  # the job's modules, as the launches of the other tests find theirs
    try:
        assert main(["launch", job, "--quiet", "--threads-per-stage", "1"]) == 0
    finally:
        os.chdir(cwd)
    assert wait_no_strays() == []
    assert "4 stage processes started" in capsys.readouterr().err
    losses = [line["loss"] for line in metrics(str(out))]
    assert len(losses) == 4
    # two replicas, each on half of every batch: a step is still one full-batch step (seed 0: the job's)
    assert_equals_reference(losses, model_state(str(out)), seed=0)
