"""A schedule defined outside pipeq, with its own executor, in stage processes: through the
runner in process mode and through a job file that names it, equal to single-process training."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from models import flat_state, reference_train
from plugin_cases import JOB, check_trains_like_one_process
from plugin_schedule import ReverseDrain

@pytest.mark.timeout(120)
def test_a_users_schedule_and_executor_train_like_one_process_in_stage_processes():
    check_trains_like_one_process("process")


@pytest.mark.timeout(120)
def test_a_job_file_names_a_users_schedule(tmp_path):
    """``schedule = "pkg.module:Name"``: the launch trains with the user's plan and executor
    (SGD at half the job's learning rate), equal to one process."""
    import os

    import launch_jobs
    from launch_util import launch_here

    from pipeq.launch.job import load_job

    here = os.path.dirname(os.path.abspath(launch_jobs.__file__))  # where the job's modules import from
    path = tmp_path / "job.toml"
    path.write_text(JOB)
    out = tmp_path / "out"
    printed = launch_here("--out", str(out), job=str(path), cwd=here)
    assert printed.returncode == 0, printed.stderr
    job = load_job(str(path))
    assert job.schedule == ReverseDrain()
    n = job.recipe.count_stages()
    model, _ = reference_train([job.recipe.build_stage(k, n) for k in range(n)], nn.CrossEntropyLoss(),
                               functools.partial(torch.optim.SGD, lr=0.05), launch_jobs.train_batches(0, 3))
    state = torch.load(out / "model.pt", weights_only=True)
    ref = flat_state(list(model))
    assert state.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(state[k], ref[k], atol=1e-6, rtol=1e-5)
