"""A launched job trains on tuple batches."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pipeq


def assert_states_close(got, want, atol=1e-6):
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=atol, rtol=1e-5, msg=k)


@pytest.mark.timeout(120)
def test_a_launched_job_trains_on_tuple_batches(tmp_path):
    """A job's data may give x as a tuple / dict: the launched run equals a runner's steps."""
    from launch_util import model_state
    from job_files import launch, write

    import launch_jobs

    out = tmp_path / "out"
    launch(write(tmp_path, 'stages = "launch_jobs:pair_stages"\nloss = "torch.nn:CrossEntropyLoss"\n'
                 'optimizer = "torch.optim:SGD"\noptimizer_args = { lr = 0.1 }\ndata = "launch_jobs:pair_batches"\n'
                 f'microbatches = 3\nsteps = 3\nseed = 0\nout = "{out}"\n'))
    torch.manual_seed(0)
    runner = pipeq.PipelineRunner(launch_jobs.pair_stages(), nn.CrossEntropyLoss(),
                                  functools.partial(torch.optim.SGD, lr=0.1), "1f1b", 3, mode="simulated")
    with runner:
        for x, y in launch_jobs.pair_batches(0)[:3]:
            runner.step(x, y)
        want = runner.state_dict()
    assert_states_close(model_state(str(out)), want, atol=1e-6)
