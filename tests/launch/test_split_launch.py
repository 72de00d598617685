"""pipeq launch of a job whose model is split by module names (split_modules), then pipeq export of its run; a tied GPT under ZBV restarted after a kill."""

from __future__ import annotations

import os

import pytest
import torch

from launch_util import SUPPORT, assert_same_state, launch_here, metrics, model_state
from split_jobs import GPT_JOB, JOB, LM, gpt_reference, reference
from split_models import assert_model_state_close

pytestmark = pytest.mark.timeout(90)


def test_split_modules_job_trains_like_one_process_and_exports(tmp_path, capsys) -> None:
    from strays import wait_no_strays
    from pipeq.launch.cli import main

    out = tmp_path / "out"
    job = tmp_path / "job.toml"
    job.write_text(JOB + f'out = "{out}"\n')
    cwd = os.getcwd()
    os.chdir(SUPPORT)
    try:
        assert main(["launch", str(job), "--quiet", "--threads-per-stage", "1"]) == 0
    finally:
        os.chdir(cwd)
    assert wait_no_strays() == []
    model, want = reference(seed=0)
    assert [line["loss"] for line in metrics(str(out))] == pytest.approx(want, abs=1e-5)
    state = model_state(str(out))  # model.pt: the model's own names, the tied head included
    plain = LM()
    plain.load_state_dict(state)
    for name, t in model.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[name], t, atol=1e-5, rtol=0, msg=name)
    capsys.readouterr()
    assert main(["export", str(out), "--format", "safetensors", "--out", str(tmp_path / "m.safetensors")]) == 0
    assert "safetensors" in capsys.readouterr().out
    import safetensors.torch

    again = LM()
    again.load_state_dict(safetensors.torch.load_file(str(tmp_path / "m.safetensors")))
    assert all(torch.equal(again.state_dict()[k], plain.state_dict()[k]) for k in plain.state_dict())
    assert main(["export", str(tmp_path / "nowhere"), "--format", "pt", "--out", str(tmp_path / "x.pt")]) == 2
    assert "no such checkpoint" in capsys.readouterr().err


def test_a_tied_gpt_under_zbv_killed_mid_run_restarts_and_ends_as_the_uninterrupted_run(tmp_path, monkeypatch):
    """TinyGPT in 4 stages, two per process (GPT_JOB: zbv, max_restarts = 1, a checkpoint every 2
    steps), on batches whose sequence length changes every step, evaluated every 3 steps on two
    other lengths. Killing stage 3 kills its process, which holds stages 0 and 3 (both copies of the tied
    embedding): the run restarts from step 2's checkpoint and ends with the uninterrupted run's
    weights, bit for bit; that run trains as one process does."""
    job = tmp_path / "gpt.toml"
    job.write_text(GPT_JOB)
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    r = launch_here("--out", whole, job=str(job), cwd=SUPPORT)
    assert r.returncode == 0, r.stderr
    model, want, want_eval = gpt_reference()
    assert [ln["loss"] for ln in metrics(whole) if "loss" in ln] == pytest.approx(want, abs=1e-5)
    assert [ln["eval_loss"] for ln in metrics(whole) if "eval_loss" in ln] == pytest.approx(want_eval, abs=1e-5)
    assert_model_state_close(model_state(whole), model)  # the model's own names, the tied head included
    monkeypatch.setenv("PIPEQ_FAULT", "stage:3,step:4,kind:kill")
    r = launch_here("--out", killed, job=str(job), cwd=SUPPORT)
    assert r.returncode == 0, r.stderr
    restart = [ln for ln in metrics(killed) if "restart" in ln]
    # the process's death is named by its first stage, and says which stages it took
    assert len(restart) == 1 and restart[0]["stage"] == 0 and restart[0]["state_from"] == "disk", restart
    assert "of stages 0 and 3 was killed by SIGKILL" in restart[0]["error"], restart
    assert "stage 0 failed: stage process (pid" in r.stderr and "restart 1 of 1" in r.stderr, r.stderr
    assert [ln["loss"] for ln in metrics(killed) if "loss" in ln] == [ln["loss"] for ln in metrics(whole)
                                                                      if "loss" in ln]
    assert [ln["step"] for ln in metrics(killed) if "loss" in ln] == [1, 2, 3, 4, 5, 6]
    assert [ln["eval_loss"] for ln in metrics(killed) if "eval_loss" in ln] == [
        ln["eval_loss"] for ln in metrics(whole) if "eval_loss" in ln]
    assert_same_state(model_state(killed), model_state(whole))
