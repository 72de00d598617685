"""``pipeq launch --max-restarts``: a failed stage is restarted from the newest checkpoint or in-memory snapshot and the run ends with the uninterrupted run's weights."""

from __future__ import annotations

import pytest

from launch_util import assert_same_state, launch_here, metrics, model_state, tensorboard_scalars

pytestmark = pytest.mark.timeout(300)

ARGS = ("--steps", "6", "--checkpoint-every", "2", "--eval-every", "0")


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> str:
    """The uninterrupted run's output directory (the reference of every restart)."""
    out = str(tmp_path_factory.mktemp("whole") / "run")
    r = launch_here(*ARGS, "--out", out)
    assert r.returncode == 0, r.stderr
    return out


def test_without_max_restarts_a_failure_still_ends_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEQ_FAULT", "stage:2,step:2,kind:raise")
    r = launch_here(*ARGS, "--out", str(tmp_path / "run"))
    assert r.returncode == 1 and "stage 2 failed" in r.stderr and "injected fault" in r.stderr, r.stderr
    assert "restart" not in r.stderr


def test_the_same_step_failing_twice_with_the_same_error_is_a_bug_not_a_fault(tmp_path):
    from pipeq.errors import PipelineError
    from pipeq.launch.restarts import Restarts

    said = []
    r = Restarts(5, str(tmp_path / "metrics.jsonl"), said.append)
    boom = PipelineError("ValueError: bad shape", 1)
    assert r.again(boom, 3)
    r.resumed(2)
    assert not r.again(PipelineError("ValueError: bad shape", 1), 3)
    assert "a bug, not a fault" in said[-1]
    assert r.again(PipelineError("ValueError: bad shape", 1), 4)  # another step: a fault again
    limited = Restarts(1, str(tmp_path / "m2.jsonl"), said.append)
    assert limited.again(boom, 3) and not limited.again(PipelineError("other", 0), 5)
    assert "gave up after 1 restart(s)" in said[-1]


def test_a_random_kill_is_recovered_too(whole, tmp_path, monkeypatch):
    """A stage and a step drawn at random (the draw is in the assertion message): the same weights."""
    import random

    seed = random.SystemRandom().randrange(1 << 30)
    rng = random.Random(seed)
    stage, step, kind = rng.randrange(3), rng.randrange(1, 7), rng.choice(["kill", "exit", "raise"])
    monkeypatch.setenv("PIPEQ_FAULT", f"stage:{stage},step:{step},kind:{kind}")
    r = launch_here(*ARGS, "--out", str(tmp_path / "run"), "--max-restarts", "1")
    drawn = f"seed {seed}: stage {stage}, step {step}, {kind}"
    assert r.returncode == 0, (drawn, r.stderr)
    assert_same_state(model_state(str(tmp_path / "run")), model_state(whole))
    lines = metrics(str(tmp_path / "run"))
    assert [ln["step"] for ln in lines if "loss" in ln] == [1, 2, 3, 4, 5, 6], drawn  # each step once
    restart = [ln for ln in lines if "restart" in ln]
    assert len(restart) == 1 and restart[0]["stage"] == stage and restart[0]["state_from"] in ("disk", "start"), drawn
    assert restart[0]["resumed_from"] == 2 * ((restart[0]["unfinished_step"] - 1) // 2), (drawn, restart)


def test_a_restart_after_a_stage_death_loads_the_in_memory_snapshot_without_reading_the_disk(whole, tmp_path,
                                                                                              monkeypatch):
    """Snapshots every step, no checkpoint: stage 2 killed as step 5 starts resumes from the
    snapshot of step 3 (the newest step the driver had finished: its line written; an older one
    if its answers had not come in), and no checkpoint is read."""
    import pipeq
    from pipeq import checkpoint

    def no_disk(*args, **kwargs):
        raise AssertionError("a checkpoint was read from the disk")

    monkeypatch.setattr(checkpoint, "load", no_disk)
    monkeypatch.setattr(pipeq.PipelineRunner, "load", no_disk)
    monkeypatch.setenv("PIPEQ_FAULT", "stage:2,step:5,kind:kill")
    out = str(tmp_path / "snapshots")
    r = launch_here(*ARGS, "--out", out, "--max-restarts", "1", "--snapshot-every", "1", "--checkpoint-every", "0")
    assert r.returncode == 0, r.stderr
    restart = [ln for ln in metrics(out) if "restart" in ln]
    assert len(restart) == 1 and restart[0]["state_from"] == "memory", restart
    assert restart[0]["stage"] == 2 and "SIGKILL" in restart[0]["error"] and restart[0]["seconds_lost"] > 0
    assert "stage 2 failed" in r.stderr and "restart 1 of 1" in r.stderr, r.stderr
    assert "step 6/6 loss" in r.stderr and "(1 restart so far)" in r.stderr, r.stderr  # the progress says so
    # step 3's snapshot, or under load (its answers not in when the failure came) an older one;
    # step 5 unfinished (step 4's loss had come), or, when the driver noticed the death before it
    # read step 4's loss, step 4 (a snapshot is taken once the next step's loss is in)
    step, unfinished = restart[0]["resumed_from"], restart[0]["unfinished_step"]
    assert 1 <= step < unfinished <= 5 and step <= 3, restart
    assert f"in-memory snapshot of step {step}" in r.stderr
    assert_same_state(model_state(out), model_state(whole))
    assert [ln["step"] for ln in metrics(out) if "loss" in ln] == [1, 2, 3, 4, 5, 6], (r.stderr, metrics(out))
    # the summary is the whole run's: its time since the first attempt's first step, its first loss
    import re

    losses = {ln["step"]: ln["loss"] for ln in metrics(out) if "loss" in ln}
    summary = re.search(r"trained 6 steps \(.*\) in ([\d.]+) s with 1 restart, \d+ samples/s\n  loss ([\d.]+) -> "
                        r"([\d.]+)", r.stdout)
    assert summary is not None, r.stdout
    assert summary[2] == f"{losses[1]:.4f}" and summary[3] == f"{losses[6]:.4f}", (r.stdout, losses)
    assert float(summary[1]) + 0.05 >= restart[0]["seconds_lost"], (r.stdout, restart)
    # TensorBoard: each attempt's event file; the steps trained again show once, the restart at its step
    tb = tensorboard_scalars(out)
    if tb is not None:
        assert tb["train/loss"] == [(ln["step"], pytest.approx(ln["loss"], rel=1e-6)) for ln in metrics(out)
                                    if "loss" in ln]
        assert tb["run/restarts"] == [(step, 1.0)]


def test_a_bug_that_fails_the_same_step_again_ends_the_run_with_its_error(tmp_path):
    """A stage that raises on step 3's batch: one restart, the same error at the same step, the end."""
    from launch_util import SUPPORT

    job = tmp_path / "picky.toml"
    job.write_text('stages = "launch_jobs:picky_stages"\nloss = "torch.nn:CrossEntropyLoss"\n'
                   'optimizer = "torch.optim:SGD"\noptimizer_args = { lr = 0.1 }\n'
                   'data = "launch_jobs:poisoned_batches"\nmicrobatches = 2\nsteps = 5\nseed = 0\n')
    r = launch_here("--out", str(tmp_path / "run"), "--max-restarts", "5", "--checkpoint-every", "1",
                    job=str(job), cwd=SUPPORT)
    assert r.returncode == 1, r.stderr
    failed = [ln for ln in r.stderr.splitlines() if ln.startswith("pipeq launch: stage 0 failed:")]
    assert len(failed) == 2 and all("a value over 1e6 in this batch" in ln for ln in failed), r.stderr
    assert "restart 1 of 5" in r.stderr and "restart 2 of 5" not in r.stderr
    assert "step 3 failed twice in a row with the same error: a bug, not a fault" in r.stderr


def test_a_native_crash_at_the_same_step_is_a_bug_whatever_the_pid(tmp_path):
    """Stage 0 dies of a SIGSEGV on step 3's batch, every start (no checkpoint: each restart
    starts at step 0, and the steps stream with no drain before step 3): recognised after one
    restart though each crash is another pid's, naming step 3, whose loss never came."""
    from launch_util import SUPPORT, metrics

    job = tmp_path / "crashing.toml"
    job.write_text('stages = "launch_jobs:crashing_stages"\nloss = "torch.nn:CrossEntropyLoss"\n'
                   'optimizer = "torch.optim:SGD"\noptimizer_args = { lr = 0.1 }\n'
                   'data = "launch_jobs:poisoned_batches"\nmicrobatches = 2\nsteps = 5\nseed = 0\n')
    out = str(tmp_path / "run")
    r = launch_here("--out", out, "--max-restarts", "3", "--checkpoint-every", "0", job=str(job), cwd=SUPPORT)
    assert r.returncode == 1, r.stderr
    failed = [ln for ln in r.stderr.splitlines() if ln.startswith("pipeq launch: stage 0 failed:")]
    assert len(failed) == 2 and all("SIGSEGV" in ln for ln in failed), r.stderr
    assert failed[0] != failed[1]  # another pid
    assert "restart 1 of 3" in r.stderr and "restart 2 of 3" not in r.stderr, r.stderr
    assert "step 3 failed twice in a row with the same error: a bug, not a fault" in r.stderr, r.stderr
    restart = [ln for ln in metrics(out) if "restart" in ln]
    assert len(restart) == 1 and restart[0]["unfinished_step"] == 3 and restart[0]["resumed_from"] == 0, restart
