"""pipeq launch of a job whose model is split by module names (split_modules), then pipeq export of its run."""

from __future__ import annotations

import os

import pytest
import torch

from launch_util import SUPPORT, metrics, model_state
from split_jobs import JOB, LM, reference

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
