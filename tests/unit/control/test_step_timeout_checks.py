"""step_timeout settings refused before anything starts, on the runner and in job files."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pipeq
from models import mlp_stages

SGD = functools.partial(torch.optim.SGD, lr=0.1)
pytestmark = pytest.mark.timeout(60)

# Stages fork from a server that has torch imported (~0.1 s each instead of 2-6 s with spawn):
# these tests are about how failures surface, not about start-up. Two stay on the default
# (spawn) on purpose, where the stages are the driver's own children:
# test_stage_killed_by_sigkill and test_driver_death_takes_workers_with_it.
FAST = dict(start_method="forkserver")


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "30", True, 0.5])
def test_bad_step_timeout_is_refused(bad):
    with pytest.raises(ValueError, match="step_timeout"):
        pipeq.PipelineRunner(mlp_stages(), nn.CrossEntropyLoss(), SGD, step_timeout=bad, **FAST)


def test_job_file_step_timeout(tmp_path):
    from pipeq.launch.job import load_job

    base = 'stages = "m:s"\nloss = "m:l"\noptimizer = "m:o"\ndata = "m:d"\nsteps = 1\n'
    path = tmp_path / "job.toml"
    path.write_text(base)
    assert load_job(str(path)).step_timeout == 300.0  # pipeq launch's default
    path.write_text(base + "step_timeout = 30\n")
    assert load_job(str(path)).step_timeout == 30
    path.write_text(base + 'step_timeout = "30"\n')
    with pytest.raises(ValueError, match="step_timeout must be an integer or a float"):
        load_job(str(path))
