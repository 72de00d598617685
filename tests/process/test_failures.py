"""Failures reach the caller as PipelineError naming the stage, quickly, and leave nothing behind."""

from __future__ import annotations

import functools
import os
import signal
import time
import traceback

import pytest
import torch
from torch import nn

import pipeq
from strays import wait_no_strays
from pipeq.testing import SleepStage, backend_of
from models import Exits, FailingStepSGD, Raises, StallsOnce, mlp_stages

SGD = functools.partial(torch.optim.SGD, lr=0.1)
pytestmark = pytest.mark.timeout(60)

# Stages fork from a server that has torch imported (~0.1 s each instead of 2-6 s with spawn):
# these tests are about how failures surface, not about start-up. Two stay on the default
# (spawn) on purpose, where the stages are the driver's own children:
# test_stage_killed_by_sigkill and test_driver_death_takes_workers_with_it.
FAST = dict(start_method="forkserver")


def three_stages(middle: nn.Module) -> list[nn.Module]:
    return [nn.Linear(8, 8), middle, nn.Linear(8, 3)]


def xy(batch: int = 16):
    return torch.randn(batch, 8), torch.randint(0, 3, (batch,))


def expect_failure(runner: pipeq.PipelineRunner, call, stage: int, match: str, within: float = 10.0):
    started = []
    ipc_dir = []
    with pytest.raises(pipeq.PipelineError, match=match) as info:
        with runner:
            started.append(time.monotonic())  # time the failure, not the process start-up
            ipc_dir.append(backend_of(runner).ipc_dir)
            call(runner)
    elapsed = time.monotonic() - started[0]
    assert info.value.stage == stage
    assert elapsed < within, f"failure took {elapsed:.1f} s to surface"
    assert not wait_no_strays(5.0), "worker processes outlived the failure"
    assert ipc_dir[0] and not os.path.exists(ipc_dir[0]), "ipc socket files were left behind"
    with pytest.raises(pipeq.PipelineError):
        runner.step(*xy())  # a failed runner refuses further work
    return info.value


@pytest.mark.parametrize("schedule", ["1f1b", "fill-drain"])
def test_stage_that_raises(schedule):
    runner = pipeq.PipelineRunner(three_stages(Raises(8)), nn.CrossEntropyLoss(), SGD, schedule=schedule,
                                  **FAST)
    err = expect_failure(runner, lambda r: r.step(*xy()), stage=1, match="boom from the stage")
    assert "Traceback" in err.remote_traceback and "models.py" in err.remote_traceback
    # the answer first, then the stage's traceback once: no chained duplicate, no driver plumbing
    first = traceback.format_exception_only(err)[0]
    assert first.startswith("pipeq.errors.PipelineError: stage 1: ") and "forward of microbatch 0" in first
    shown = "".join(traceback.format_exception(err))
    assert first.splitlines()[0].endswith(": ValueError: boom from the stage")  # the cause's own type
    assert shown.count("ValueError: boom from the stage") == 2 and "direct cause" not in shown  # and the stage's last line
    assert "supervisor.py" not in shown, shown


def test_stage_that_raises_on_a_later_step():
    runner = pipeq.PipelineRunner(three_stages(Raises(8, after_calls=20)), nn.CrossEntropyLoss(), SGD,
                                  microbatches=4, **FAST)

    def work(r):
        for _ in range(10):
            r.step(*xy())
    expect_failure(runner, work, stage=1, match="boom")


def test_stage_that_calls_os_exit():
    runner = pipeq.PipelineRunner(three_stages(Exits(8)), nn.CrossEntropyLoss(), SGD, **FAST)
    expect_failure(runner, lambda r: r.step(*xy()), stage=1, match="exited with code 7")


def test_stage_killed_by_sigkill():
    """spawn (the default) on purpose: the killed stage is the driver's own child here. Before the
    kill, the spawned stages train 1F1B as one process does (the default start method's numbers;
    tests/process/test_runner.py checks the fork server's)."""
    from runner_cases import assert_matches_reference, batches

    stages, data = mlp_stages(), batches(4, 48)
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), SGD, schedule="1f1b", microbatches=4)

    def work(r):
        losses = [r.step(x, y) for x, y in data]
        state, out = r.state_dict(), r.predict(data[0][0])
        model = assert_matches_reference(stages, data, losses, state, opt=SGD)
        with torch.no_grad():
            torch.testing.assert_close(out, model(data[0][0]), atol=1e-5, rtol=0)
        victim = r.stage_processes[1]["pid"]
        os.kill(victim, signal.SIGKILL)
        r.step(*xy())

    expect_failure(runner, work, stage=1, match="killed by SIGKILL")


def test_wrong_input_shape_names_stage_and_shape():
    runner = pipeq.PipelineRunner(mlp_stages(), nn.CrossEntropyLoss(), SGD, microbatches=4, **FAST)
    err = expect_failure(runner, lambda r: r.step(torch.randn(16, 5), torch.randint(0, 3, (16,))),
                         stage=0, match=r"stage 0: .*forward of microbatch 0.*\(4, 5\)")
    assert "mat1 and mat2" in str(err)


def test_wrong_target_shape_names_last_stage():
    runner = pipeq.PipelineRunner(mlp_stages(), nn.MSELoss(), SGD, microbatches=2, **FAST)
    expect_failure(runner, lambda r: r.step(torch.randn(8, 8), torch.randn(8, 7)),
                   stage=2, match=r"loss_fn failed on output \(4, 3\).*target \(4, 7\)")


def test_hung_stage_is_reported_by_heartbeat_loss():
    # a stage whose process is stopped (SIGSTOP) sends no heartbeats: named within the timeout
    runner = pipeq.PipelineRunner(mlp_stages(), nn.CrossEntropyLoss(), SGD,
                                  heartbeat_interval=0.1, heartbeat_timeout=1.0, **FAST)

    def work(r):
        os.kill(r.stage_processes[2]["pid"], signal.SIGSTOP)
        r.step(*xy())

    expect_failure(runner, work, stage=2, match="no heartbeat")


def test_driver_death_takes_workers_with_it():
    # a driver process that dies by SIGKILL must not leave its workers running; spawn (the
    # default) on purpose: the workers are the dead driver's own children
    import subprocess, sys, textwrap
    code = textwrap.dedent("""
        import functools, os, sys, time, torch
        from torch import nn
        import pipeq
        from pipeq.testing import backend_of
        if __name__ == "__main__":
            r = pipeq.PipelineRunner([nn.Linear(4, 4), nn.Linear(4, 2)], nn.CrossEntropyLoss(),
                                     functools.partial(torch.optim.SGD, lr=0.1))
            r.start()
            print(backend_of(r).ipc_dir, " ".join(str(i["pid"]) for i in r.stage_processes), flush=True)
            time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        ipc_dir, *pids = proc.stdout.readline().split()
        pids = [int(p) for p in pids]
        assert len(pids) == 2
        proc.kill()
        proc.wait(10)
        end = time.monotonic() + 10
        while time.monotonic() < end and any(_alive(p) for p in pids):
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), "workers outlived their driver"
        assert not os.path.exists(ipc_dir), "the orphaned workers left their ipc files behind"
    finally:
        proc.kill()
        proc.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_error_after_the_loss_is_not_lost():
    # stage 0 fails in its optimizer step, after the last stage has already reported the loss:
    # the error must still reach the caller (from the next call or from leaving the block)
    stages = [nn.Linear(8, 5), nn.Linear(5, 3)]
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), functools.partial(FailingStepSGD, lr=0.1),
                                  **FAST)
    with pytest.raises(pipeq.PipelineError, match="optimizer step failed on purpose") as info:
        with runner:
            runner.step(*xy())
    assert info.value.stage == 0
    assert not wait_no_strays(5.0)


def test_workers_are_pinned_to_their_own_cores():
    runner = pipeq.PipelineRunner([nn.Linear(8, 8), nn.Linear(8, 3)], nn.CrossEntropyLoss(), SGD,
                                  **FAST)
    with runner:
        info = runner.stage_processes
    ncores = len(os.sched_getaffinity(0))
    per = max(1, ncores // 2)
    assert [i["threads"] for i in info] == [per, per]
    assert all(len(i["cores"]) == per for i in info)
    if ncores >= 2:
        assert not set(info[0]["cores"]) & set(info[1]["cores"]), "stages share a core"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_stage_stuck_in_its_forward_is_named_by_step_timeout(schedule):
    # stage 1 sleeps 60 s in microbatch 1's forward: alive and heartbeating, so only step_timeout
    # can catch it; its neighbours (waiting for its output or its gradients) are not blamed
    runner = pipeq.PipelineRunner(three_stages(StallsOnce(8, call=2, seconds=60)), nn.CrossEntropyLoss(), SGD,
                                  schedule=schedule, microbatches=4, step_timeout=1, heartbeat_interval=0.25, **FAST)
    err = expect_failure(runner, lambda r: r.step(*xy()), stage=1, within=8.0,
                         match=r"stuck: has been in F\(step 1, microbatch 1\) for [1-9]\.\d s")
    assert "step_timeout=1 s" in str(err)


@pytest.mark.timeout(60)
def test_stage_stuck_in_a_later_step_names_that_step():
    # 4 forwards a step: the 6th is step 2's microbatch 1 (steps count from 1)
    runner = pipeq.PipelineRunner(three_stages(StallsOnce(8, call=6, seconds=60)), nn.CrossEntropyLoss(), SGD,
                                  microbatches=4, step_timeout=1, heartbeat_interval=0.25, **FAST)

    def work(r):
        r.step(*xy())
        r.step(*xy())

    expect_failure(runner, work, stage=1, within=8.0, match=r"in F\(step 2, microbatch 1\)")


@pytest.mark.timeout(60)
def test_long_step_that_keeps_progressing_is_not_failed():
    # every action takes 0.15 s, a step ~3 s: far over step_timeout=1 in all, and stage 0 waits
    # ~1.2 s for its first gradient, yet no action is stuck (a stage waiting for its neighbours
    # is not computing): the step must finish
    stages = [SleepStage(8, forward_s=0.15, backward_s=0.15) for _ in range(3)]
    with pipeq.PipelineRunner(stages, nn.MSELoss(), SGD, microbatches=8,
                              step_timeout=1, heartbeat_interval=0.25, **FAST) as runner:
        t0 = time.monotonic()
        loss = runner.step(torch.randn(16, 8), torch.randn(16, 8))
        took = time.monotonic() - t0
    assert took > 2 * 1, f"the step took {took:.1f} s: too short to prove anything"
    assert loss == loss  # a number: the run was not failed


@pytest.mark.timeout(60)
def test_without_step_timeout_a_stuck_stage_is_left_alone():
    # off by default in the runner: a 2.5 s forward is not a failure (as before step_timeout);
    # and whatever the stall's length, the default itself must be None (off)
    import inspect

    assert inspect.signature(pipeq.PipelineRunner).parameters["step_timeout"].default is None
    with pipeq.PipelineRunner(three_stages(StallsOnce(8, call=2, seconds=2.5)), nn.CrossEntropyLoss(), SGD,
                              microbatches=2, **FAST) as runner:
        runner.step(*xy())


@pytest.mark.timeout(60)
def test_stage_stuck_in_its_backward_is_named():
    # stage 1's backward sleeps 60 s (its first backward: step 1's microbatch 0)
    stages = [nn.Linear(8, 8), SleepStage(8, forward_s=0.0, backward_s=60.0), nn.Linear(8, 3)]
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), SGD, microbatches=2, step_timeout=1,
                                  heartbeat_interval=0.25, **FAST)
    expect_failure(runner, lambda r: r.step(*xy()), stage=1, within=8.0,
                   match=r"stuck: has been in B\(step 1, microbatch 0\)")
