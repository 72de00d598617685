"""Helpers for tests that run ``pipeq launch`` in subprocesses (not a test module)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIGITS_JOB = os.path.join(ROOT, "examples", "digits.toml")


def launch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeq", "launch", DIGITS_JOB, "--quiet", "--threads-per-stage", "1", *args]


def run_launch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(launch_cmd(*args), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


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


def digits_model(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    sys.path.insert(0, ROOT)
    from examples.digits_job import layers

    m = torch.nn.Sequential(*layers())
    m.load_state_dict(state)
    return m
