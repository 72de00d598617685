"""``pipeq launch`` of a job whose stages function traces the model (pipeq.split): the function is
called once, by the driver, and each stage process is handed its stage; a restarted stage gets the
same one. The results are one process's."""

from __future__ import annotations

import os

import pytest
import torch

from launch_util import SUPPORT, assert_same_state, launch_here, metrics, model_state
from models import reference_train
from startup_jobs import JOB, batches, stages

pytestmark = pytest.mark.timeout(120)

ARGS = ("--checkpoint-every", "1", "--eval-every", "0")


def _job(directory) -> tuple[str, str]:
    """The job file in ``directory`` and the file its stages function notes its callers in."""
    calls = str(directory / "calls.txt")
    job = directory / "job.toml"
    job.write_text(JOB.format(calls=calls))
    return str(job), calls


def _callers(calls: str) -> list[int]:
    with open(calls) as f:
        return [int(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> str:
    """The uninterrupted run's output directory; its stages function was called by the driver
    only (this process: launch_here runs the driver here), once."""
    from strays import wait_no_strays

    directory = tmp_path_factory.mktemp("whole")
    job, calls = _job(directory)
    out = str(directory / "run")
    r = launch_here(*ARGS, "--out", out, job=job, cwd=SUPPORT)
    assert r.returncode == 0, r.stderr
    assert wait_no_strays() == []
    assert _callers(calls) == [os.getpid()], "a stage process called the stages function again"
    return out


def test_the_split_is_made_once_by_the_driver_and_trains_as_one_process(whole, tmp_path) -> None:
    torch.manual_seed(3)  # the job's seed
    split = stages(str(tmp_path / "reference-calls.txt"))
    assert split.split_points == ["blocks.1", "blocks.2"]
    model, want = reference_train(list(split), torch.nn.MSELoss(), lambda p: torch.optim.SGD(p, lr=0.1), batches(0))
    assert [line["loss"] for line in metrics(whole) if "loss" in line] == pytest.approx(want, abs=1e-6)
    got = model_state(whole)
    for name, t in model.state_dict().items():
        torch.testing.assert_close(got[name.partition(".")[2]], t, atol=1e-6, rtol=0, msg=name)


def test_a_restarted_stage_gets_the_same_stage_without_calling_the_function_again(whole, tmp_path,
                                                                                  monkeypatch) -> None:
    from strays import wait_no_strays

    job, calls = _job(tmp_path)
    monkeypatch.setenv("PIPEQ_FAULT", "stage:1,step:3,kind:kill")
    out = str(tmp_path / "run")
    r = launch_here(*ARGS, "--out", out, "--max-restarts", "1", job=job, cwd=SUPPORT)
    assert r.returncode == 0, r.stderr
    assert wait_no_strays() == []
    assert [line["restart"] for line in metrics(out) if "restart" in line] == [1], r.stderr
    assert _callers(calls) == [os.getpid()]  # the restart reused the stages made at the start
    assert_same_state(model_state(out), model_state(whole))
