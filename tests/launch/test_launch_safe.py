"""``pipeq launch`` never loses work: one length rule, a run directory owned by one run, SIGINT /
SIGTERM checkpoint the last step and --resume continues it, and a job folder never shadows pipeq.

Every launch runs a tiny job from a folder that also holds a fake ``pipeq/`` package (a source
checkout of another version beside the job file), as ``cd FOLDER && pipeq launch job.toml``
does: a script like the ``pipeq`` console script, from that folder, with this worktree's pipeq
on PYTHONPATH. Each launch gets a session of its own: the tests check that no
process of it (driver, fork server, stages) is left behind.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from pipeq.testing import backend_of

from launch_util import ROOT, assert_same_state, launch_here, metrics, model_state
from strays import assert_session_ends

JOB_MODULE = '''\
"""A tiny 3-stage job; PIPEQ_TEST_DELAY seconds per batch make it slow enough to signal."""
import os
import time

import torch
from torch import nn

def stages():
    return [nn.Sequential(nn.Linear(8, 16), nn.ReLU()), nn.Sequential(nn.Linear(16, 16), nn.ReLU()),
            nn.Linear(16, 2)]

def batches(epoch):  # 10 batches an epoch, the same ones every time (a generator: no len)
    delay = float(os.environ.get("PIPEQ_TEST_DELAY", "0"))
    g = torch.Generator().manual_seed(epoch)
    for _ in range(10):
        time.sleep(delay)
        x = torch.randn(16, 8, generator=g)
        yield x, (x.sum(1) > 0).long()
'''
JOB = '''\
stages = "safejob:stages"
loss = "torch.nn:CrossEntropyLoss"
optimizer = "torch.optim:SGD"
optimizer_args = { lr = 0.05, momentum = 0.9 }
data = "safejob:batches"
microbatches = 2
epochs = 2
checkpoint_every = 10
keep_checkpoints = 2
'''
CONSOLE_SCRIPT = 'import sys\nfrom pipeq.launch.cli import main\nif __name__ == "__main__":\n    sys.exit(main())\n'  # bin/pipeq
FAKE_PIPEQ = '"""A source checkout of another pipeq version, beside the job file (no __version__)."""\n'


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> str:
    base = tmp_path_factory.mktemp("safe")
    folder = base / "jobs"
    (folder / "pipeq").mkdir(parents=True)
    (folder / "pipeq" / "__init__.py").write_text(FAKE_PIPEQ)
    (folder / "safejob.py").write_text(JOB_MODULE)
    (folder / "job.toml").write_text(JOB)
    (base / "pipeq_script.py").write_text(CONSOLE_SCRIPT)
    return str(folder / "job.toml")


def _env(delay: float = 0.0) -> dict[str, str]:
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PIPEQ_TEST_DELAY": str(delay)}


def _cmd(job: str, *args: str) -> list[str]:
    script = os.path.join(os.path.dirname(os.path.dirname(job)), "pipeq_script.py")
    return [sys.executable, script, "launch", job, "--quiet", "--threads-per-stage", "1", *args]


def _start(job: str, *args: str, delay: float = 0.0) -> subprocess.Popen:
    """A launch from the job's folder, in a session of its own (see strays.session_left)."""
    return subprocess.Popen(_cmd(job, *args), cwd=os.path.dirname(job), env=_env(delay),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(p: subprocess.Popen, timeout: float = 120) -> subprocess.CompletedProcess:
    """Wait for a launch; then no process of its session may be left (killed if one is)."""
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert_session_ends(p.pid, "the launch")
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _launch(job: str, *args: str, delay: float = 0.0, timeout: float = 120) -> subprocess.CompletedProcess:
    return _finish(_start(job, *args, delay=delay), timeout)


def _snapshot(directory: str) -> dict[str, bytes | None]:
    """Every entry under ``directory`` (None for a folder) with its bytes."""
    found: dict[str, bytes | None] = {}
    for parent, dirs, files in os.walk(directory):
        for d in dirs:
            found[os.path.relpath(os.path.join(parent, d), directory)] = None
        for name in files:
            with open(os.path.join(parent, name), "rb") as f:
                found[os.path.relpath(os.path.join(parent, name), directory)] = f.read()
    return found


def _steps(out: str) -> list[int]:
    return [line["step"] for line in metrics(out)]


def _checkpoints(out: str) -> list[str]:
    return sorted(os.listdir(os.path.join(out, "checkpoints")))


def _wait_for_steps(p: subprocess.Popen, out: str, n: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    path = os.path.join(out, "metrics.jsonl")
    while time.monotonic() < deadline:
        assert p.poll() is None, p.communicate()
        if os.path.exists(path) and len(metrics(out)) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {n} steps within {timeout} s")


@pytest.fixture(scope="module")
def run25(job, tmp_path_factory) -> tuple[str, subprocess.CompletedProcess, dict]:
    """A 25-step launch over the file's epochs = 2: (its --out, its result, its final model.pt
    read at once, before any test reuses the directory). Also the reference of the SIGINT test."""
    out = str(tmp_path_factory.mktemp("run25") / "run")
    r = _launch(job, "--steps", "25", "--out", out)
    return out, r, model_state(out) if r.returncode == 0 else {}


def _stop(p: subprocess.Popen, out: str, send, sig: signal.Signals) -> tuple[list[int], str]:
    """Send ``sig`` with ``send`` (to the driver, or to its process group); the launch must exit
    128 + sig within 8 s, its metrics be consecutive and its last step checkpointed. Returns
    the steps in metrics.jsonl and the launch's stderr."""
    try:
        t0 = time.monotonic()
        send(sig)
        r = _finish(p, timeout=30)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            _finish(p, timeout=1)
    assert r.returncode == 128 + sig, r.stderr
    assert took < 8, f"took {took:.1f} s to stop"
    assert f"stopped by {sig.name} after step" in r.stderr, r.stderr
    steps = _steps(out)
    assert steps == list(range(1, steps[-1] + 1))
    assert f"step-{steps[-1]:08d}" in _checkpoints(out)
    return steps, r.stderr


# -- the length rule ---------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_length_rule_in_the_job_file_and_on_the_command_line(job, tmp_path, capsys) -> None:
    from pipeq.launch.cli import main
    from pipeq.launch.job import load_job

    assert (load_job(job).steps, load_job(job).epochs) == (None, 2)
    assert (load_job(job, {"steps": 25}).steps, load_job(job, {"steps": 25}).epochs) == (25, None)
    assert (load_job(job, {"epochs": 3}).steps, load_job(job, {"epochs": 3}).epochs) == (None, 3)
    both = tmp_path / "both.toml"
    both.write_text(JOB + "steps = 7\n")
    with pytest.raises(ValueError, match=r"sets both steps = 7 and epochs = 2; keep one of them"):
        load_job(str(both))
    # the command line wins over the file, even one that sets both
    assert (load_job(str(both), {"steps": 4}).steps, load_job(str(both), {"steps": 4}).epochs) == (4, None)
    with pytest.raises(SystemExit):  # argparse: not allowed with each other
        main(["launch", job, "--steps", "3", "--epochs", "1"])
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["launch", "--help"])
    assert "--steps or --epochs on the command line replaces whichever the file sets" in \
        " ".join(capsys.readouterr().out.split())


@pytest.mark.timeout(240)
def test_steps_flag_replaces_the_files_epochs_and_a_used_directory_is_refused(job, run25, capsys) -> None:
    """--steps 25 over a file's epochs = 2 (20 batches) trains 25 steps (not 20); the job folder
    holds a pipeq/ package of "another version", which must not shadow the one running. Then
    the directory belongs to that run: a plain launch into it is refused and changes nothing;
    --overwrite replaces the run, and retention keeps only the new run's checkpoints."""
    assert os.path.isfile(os.path.join(os.path.dirname(job), "pipeq", "__init__.py"))
    out, r, _ = run25
    assert r.returncode == 0, r.stderr
    assert "cannot import" not in r.stderr, r.stderr  # the job folder's pipeq/ shadowed nothing
    assert "trained 25 steps" in r.stdout, r.stdout
    assert _steps(out) == list(range(1, 26))
    assert _checkpoints(out) == ["step-00000020", "step-00000025"]  # keep_checkpoints = 2

    before = _snapshot(out)
    # refused before anything starts: run in this process (a launch's interpreter costs seconds)
    from pipeq.launch.cli import main

    for extra in ((), ("--steps", "5")):
        assert main(["launch", job, "--quiet", "--out", out, *extra]) == 2
        err = capsys.readouterr().err
        assert f"{out} holds another run" in err, err
        assert "--resume" in err and "--overwrite" in err
        assert _snapshot(out) == before  # byte-identical, nothing added or removed
    with pytest.raises(SystemExit):  # argparse: not allowed with each other
        main(["launch", job, "--out", out, "--overwrite", "--resume"])
    assert "not allowed with argument" in capsys.readouterr().err

    over = launch_here("--steps", "12", "--out", out, "--overwrite", job=job, cwd=os.path.dirname(job))
    assert over.returncode == 0, over.stderr
    assert "--overwrite: deleted the previous run's" in over.stderr
    assert _steps(out) == list(range(1, 13))
    # only this run's checkpoints count (the old run's step-20 and step-25 are gone)
    assert _checkpoints(out) == ["step-00000010", "step-00000012"]



# -- signals, the lock, and resuming -----------------------------------------------------------------


@pytest.mark.timeout(240)
def test_a_live_run_refuses_a_second_launch_and_signals_checkpoint_and_resume(job, run25, tmp_path, capsys) -> None:
    """A second launch into a live run is refused; SIGTERM to the driver only (``kill PID``)
    checkpoints the last step and exits 143; the lock went with it: --resume is not refused, and
    Ctrl-C of the resumed run (SIGINT to the whole process group, as a terminal sends it: the
    stages leave the stopping to the driver) exits 130 within seconds with a checkpoint of its
    last step; --resume then trains the rest: every step exactly once, and the same parameters as a
    run never interrupted (run25). (A batch system's cancel, SIGTERM to every process group of a
    run, is tests/hosts/test_multihost.py's test_sigterm_to_every_node_checkpoints_and_each_exits_143.)"""
    out = str(tmp_path / "run")
    _, ref_r, reference = run25
    assert ref_r.returncode == 0, ref_r.stderr
    # 0.25 s a batch: the 25 steps outlast the two stops (each finishes the steps in flight)
    p = _start(job, "--steps", "25", "--out", out, delay=0.25)
    try:
        _wait_for_steps(p, out, 3)
        from pipeq.launch.cli import main  # refused before anything starts: in this process

        assert main(["launch", job, "--quiet", "--steps", "3", "--out", out, "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert f"{out} is in use by another pipeq launch (pid {p.pid})" in err, err
        assert p.poll() is None  # the first run goes on
    except BaseException:
        _finish(p, timeout=1)
        raise
    first = _stop(p, out, p.send_signal, signal.SIGTERM)[0][-1]  # to the driver only, as `kill PID` does
    assert first < 25 - 4, first
    assert not os.path.exists(os.path.join(out, "model.pt"))  # not finished: no final state

    # the lock went with the run: resuming needs no --overwrite and is not refused; then Ctrl-C
    p = _start(job, "--steps", "25", "--out", out, "--resume", delay=0.25)
    try:
        _wait_for_steps(p, out, first + 2)
    except BaseException:
        _finish(p, timeout=1)
        raise
    steps, err = _stop(p, out, lambda sig: os.killpg(p.pid, sig), signal.SIGINT)
    assert f"(step {first}, epoch" in err, err  # it did resume
    last = steps[-1]
    assert first + 2 <= last < 25
    assert not os.path.exists(os.path.join(out, "model.pt"))

    resumed = launch_here("--steps", "25", "--out", out, "--resume", job=job, cwd=os.path.dirname(job))
    assert resumed.returncode == 0, resumed.stderr
    assert f"(step {last}, epoch" in resumed.stderr
    assert _steps(out) == list(range(1, 26))  # strictly consecutive: none twice, none missing
    assert_same_state(model_state(out), reference)


# -- Ctrl-C between the per-stage sends of a command -------------------------------------------------


@pytest.mark.timeout(60)
def test_interrupt_between_the_sends_of_a_step_closes_at_once(monkeypatch) -> None:
    """A KeyboardInterrupt after stage 0 got a TRAIN but before the others did: stage 0 can never
    finish that step, so close() must not wait stop_timeout (60 s) for its STOP's ACK."""
    from torch import nn

    import pipeq
    from pipeq.wire.messages import Kind
    from pipeq.wire.control_link import ControlServer

    stages = [nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)]
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1), "1f1b", 2,
                                  threads_per_stage=1, start_method="forkserver")
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    real = ControlServer.send_many

    def cut_short(self, messages):
        if messages and messages[0][1].kind is Kind.TRAIN and messages[0][1].step == 2:
            real(self, messages[:1])  # stage 0 gets step 2, then Ctrl-C
            raise KeyboardInterrupt
        real(self, messages)

    monkeypatch.setattr(ControlServer, "send_many", cut_short)
    with pytest.raises(KeyboardInterrupt):
        with runner:
            runner.step(x, y)
            t0 = time.monotonic()
            runner.step(x, y)
    assert time.monotonic() - t0 < 10
    assert not backend_of(runner).procs
