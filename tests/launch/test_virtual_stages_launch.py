"""``pipeq launch`` of a job file that holds two stages per process (ZBV, interleaved 1F1B): the same model as 1F1B's."""

from __future__ import annotations

import os

import pytest

from launch_util import DIGITS_JOB, assert_same_state, launch_here, metrics, model_state

pytestmark = pytest.mark.timeout(300)


def _job(tmp_path, schedule: str, extra: str = "") -> str:
    text = open(DIGITS_JOB).read().replace('stages = "examples.digits_job:stages"',
                                           'stages = "examples.digits_job:four_stages"')
    job = tmp_path / f"{schedule}.toml"
    job.write_text(text.replace('schedule = "1f1b"', f'schedule = "{schedule}"\n{extra}'))
    return str(job)


def test_a_job_of_two_stages_per_process_trains_as_1f1b(tmp_path):
    outs = {}
    for schedule, extra in (("1f1b", ""), ("zbv", ""), ("interleaved-1f1b", "stages_per_process = 2")):
        out = outs[schedule] = str(tmp_path / schedule)
        r = launch_here("--steps", "6", "--checkpoint-every", "0", "--eval-every", "0", "--out", out,
                        job=_job(tmp_path, schedule, extra))
        assert r.returncode == 0, r.stderr
    for schedule in ("zbv", "interleaved-1f1b"):
        assert_same_state(model_state(outs[schedule]), model_state(outs["1f1b"]), atol=1e-6)
        losses = [m["loss"] for m in metrics(outs[schedule]) if "loss" in m]
        assert losses == pytest.approx([m["loss"] for m in metrics(outs["1f1b"]) if "loss" in m], abs=1e-6)
    assert os.path.exists(os.path.join(outs["zbv"], "model.pt"))


def test_a_schedule_that_holds_one_stage_refuses_stages_per_process(tmp_path):
    r = launch_here("--steps", "1", "--out", str(tmp_path / "run"), job=_job(tmp_path, "1f1b", "stages_per_process = 2"))
    assert r.returncode != 0
    assert "stages_per_process=2: schedule '1f1b' runs 1 stage(s) per process" in r.stderr
