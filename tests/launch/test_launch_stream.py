"""``pipeq launch`` streams: a streamed launch trains as a step loop does.

Everything runs in this process; tests/support/launch_jobs.py holds the tiny job modules (the
example job files of the research schedules launch in tests/launch/test_research_jobs.py; how job
files name schedules is checked in tests/unit/launch/test_job_schedules.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import pipeq
from launch_util import metrics, model_state
from pipeq import checkpoint
from pipeq.launch.cli import main as pipeq_main
from pipeq.launch.job import load_job
from job_files import MLP_MOMENTUM


MLP = MLP_MOMENTUM  # (tests/support/job_files.py)
# 14 steps over two epochs of 10 batches: streamed in segments that end at 3, 4, 6, 8, 9, 12 and 14
STREAMED = MLP + 'schedule = "1f1b"\nsteps = 14\neval_every = 4\ncheckpoint_every = 3\n'


def write_job(directory, text: str, name: str = "job") -> str:
    path = os.path.join(str(directory), f"{name}.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


# -- streaming changes nothing: the numbers of a runner.step loop ------------------------------------

@pytest.mark.timeout(120)
def test_streamed_launch_equals_a_step_loop(tmp_path, capsys) -> None:
    """Launched in this process (its fork server serves both runs: a launch less to start)."""
    out = str(tmp_path / "out")
    job_path = write_job(tmp_path, STREAMED + f'out = "{out}"\n')
    assert pipeq_main(["launch", job_path, "--quiet", "--threads-per-stage", "1"]) == 0, capsys.readouterr().err
    lines = metrics(out)
    assert [ln["step"] for ln in lines] == list(range(1, 15))
    assert [ln["epoch"] for ln in lines] == [0] * 10 + [1] * 4
    assert [ln["step"] for ln in lines if "eval_loss" in ln] == [4, 8, 12, 14]
    import launch_jobs

    job = load_job(job_path)
    x_eval, y_eval = launch_jobs.heldout()
    batches = launch_jobs.train_batches(0) + launch_jobs.train_batches(1)[:4]
    runner = pipeq.PipelineRunner(job.recipe, None, None, job.schedule, job.microbatches, threads_per_stage=1,
                                  start_method="forkserver")
    with runner:
        for step, (x, y) in enumerate(batches, 1):
            line = lines[step - 1]
            assert runner.step(x, y) == pytest.approx(line["loss"], abs=1e-6), step
            if "eval_loss" in line:
                out_eval = runner.predict(x_eval)
                eval_loss = float(nn.functional.cross_entropy(out_eval, y_eval))
                assert eval_loss == pytest.approx(line["eval_loss"], abs=1e-6)
                assert float((out_eval.argmax(1) == y_eval).float().mean()) == pytest.approx(line["eval_accuracy"])
            if step == 6:  # a checkpoint between two evaluations holds that step's state
                runner.save(str(tmp_path / "at6"))
                assert_same(checkpoint.load(str(tmp_path / "at6")).model,
                            checkpoint.load(os.path.join(out, "checkpoints", "step-00000006")).model)
        runner.save(str(tmp_path / "final"))
    assert_same(checkpoint.load(str(tmp_path / "final")).model, model_state(out))


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=1e-6), k
