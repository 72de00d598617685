"""A launched job trains and evaluates on batches given as their microbatches, of different lengths,
its loss weighted as the job's ``loss_weighting`` says."""

from __future__ import annotations

import functools
import json

import pytest
import torch

import pipeq


@pytest.mark.timeout(120)
def test_a_launched_job_trains_on_microbatches_of_different_lengths(tmp_path):
    from job_files import launch, write
    from launch_util import model_state

    import launch_jobs

    out = tmp_path / "out"
    launch(write(tmp_path, 'stages = "launch_jobs:lm_stages"\nloss = "launch_jobs:lm_loss"\n'
                 'optimizer = "torch.optim:SGD"\noptimizer_args = { lr = 0.1 }\n'
                 'data = "launch_jobs:microbatch_batches"\neval_data = "launch_jobs:microbatch_batches"\n'
                 'loss_weighting = "sample"\nschedule = "zb-h1"\nmicrobatches = 3\nsteps = 3\nseed = 0\n'
                 f'out = "{out}"\n'))
    torch.manual_seed(0)
    runner = pipeq.PipelineRunner(launch_jobs.lm_stages(), launch_jobs.lm_loss,
                                  functools.partial(torch.optim.SGD, lr=0.1), "zb-h1", 3, mode="simulated",
                                  loss_weighting="sample")
    with runner:
        losses = [runner.step(x, y) for x, y in launch_jobs.microbatch_batches(0)]
        evaluated = runner.evaluate(launch_jobs.microbatch_batches())
        want = runner.state_dict()
    got = model_state(str(out))
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-5, msg=k)
    lines = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [line["loss"] for line in lines if "loss" in line] == pytest.approx(losses, abs=1e-6)
    assert [line["eval_loss"] for line in lines if "eval_loss" in line][-1] == pytest.approx(evaluated["loss"],
                                                                                             abs=1e-6)
