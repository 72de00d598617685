"""pipeq launch of a job that balances its model: measured once, trained with data parallelism."""

from __future__ import annotations

import os

import pytest

from balance_cases import assert_equals_reference, job_file
from launch_util import SUPPORT, metrics, model_state

pytestmark = pytest.mark.timeout(60)


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
    assert "starting 4 stage processes (2 stages x 2 replicas)..." in capsys.readouterr().err
    losses = [line["loss"] for line in metrics(str(out))]
    assert len(losses) == 4
    # two replicas, each on half of every batch: a step is still one full-batch step (seed 0: the job's)
    assert_equals_reference(losses, model_state(str(out)), seed=0)
