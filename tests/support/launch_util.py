"""Helpers for tests that run ``pipeq launch`` in subprocesses (not a test module)."""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import socket
import subprocess
import sys
import time

import torch

#: this folder (tests/support): the job modules that launches name (``launch_jobs:NAME``) are here
SUPPORT = os.path.dirname(os.path.abspath(__file__))
#: the repository
ROOT = os.path.dirname(os.path.dirname(SUPPORT))
DIGITS_JOB = os.path.join(ROOT, "examples", "digits.toml")


# steps of the single-host digits run that the multi-host runs (test_workers.py, test_multihost.py)
# must reproduce: one launch, shared through conftest.py's session fixture single_host_digits
REFERENCE_STEPS = 6

# the job secret of the test session's multi-host runs (every node needs the same one)
SECRET = secrets.token_hex(32)


def secret_env(secret: str = SECRET, **extra: str) -> dict[str, str]:
    """This process's environment with ``PIPEQ_SECRET`` set: what a multi-host node is started with."""
    return {**os.environ, "PIPEQ_SECRET": secret, **extra}


def launch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeq", "launch", DIGITS_JOB, "--quiet", "--threads-per-stage", "1", *args]


def run_launch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(launch_cmd(*args), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def launch_here(*args: str, job: str = DIGITS_JOB, cwd: str = ROOT) -> subprocess.CompletedProcess:
    """``pipeq launch job --quiet --threads-per-stage 1 *args`` in this process, from ``cwd``
    (the repository root by default): its stages fork from the test session's fork server (no
    driver interpreter and torch import to pay for). Its exit code, stdout and stderr, as a
    finished command's."""
    import contextlib
    import io

    from pipeq.launch.cli import main

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    argv = ["launch", job, "--quiet", "--threads-per-stage", "1", *args]
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def run_at_once(argvs: dict[str, list[str]], timeout: float = 240, cwd: dict[str, str] | None = None,
                env: dict[str, str] | None = None) -> dict[str, subprocess.CompletedProcess]:
    """Run independent commands at the same time; their results by name. Each runs from
    ``cwd[name]`` (default: the repository root), all with ``env`` (default: this process's).

    Every ``pipeq launch`` starts its driver and then its stages as fresh interpreters that
    import torch: one run at a time leaves a core idle much of the time, a few at once do not.
    Whatever still runs at ``timeout`` (or when something fails) is killed.
    """
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, argv in argvs.items():
            procs[name] = subprocess.Popen(argv, cwd=(cwd or {}).get(name, ROOT), env=env, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout
        results = {}
        for name, p in procs.items():
            stdout, stderr = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
        return results
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()


def metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def model_state(out: str) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(out, "model.pt"), weights_only=True)


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=atol), (k, (a[k] - b[k]).abs().max())


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n different free ports (for runs started at the same time)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def digits_model(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    sys.path.insert(0, ROOT)
    from examples.digits_job import layers

    m = torch.nn.Sequential(*layers())
    m.load_state_dict(state)
    return m


def tensorboard_scalars(out: str) -> dict[str, list[tuple[int, float]]] | None:
    """The run's TensorBoard scalars (OUT/tb/, read as TensorBoard reads them): tag -> [(step,
    value)]; None without the tensorboard package (then the run wrote no tb/)."""
    if importlib.util.find_spec("tensorboard") is None:
        assert not os.path.exists(os.path.join(out, "tb"))
        return None
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(out, "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
