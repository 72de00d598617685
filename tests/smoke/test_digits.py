"""A 3-stage MLP learns scikit-learn's digits through the runner (real data, offline)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pipeq


@pytest.mark.timeout(180)
def test_three_stage_mlp_learns_digits():
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    y = torch.tensor(data.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    x = (x - x[360:].mean(0)) / (x[360:].std(0) + 1e-6)
    x_test, y_test, x_train, y_train = x[:360], y[:360], x[360:], y[360:]
    torch.manual_seed(0)
    stages = [
        nn.Sequential(nn.Linear(64, 96), nn.ReLU()),
        nn.Sequential(nn.Linear(96, 48), nn.ReLU()),
        nn.Linear(48, 10),
    ]
    runner = pipeq.PipelineRunner(
        stages, nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
        schedule="1f1b", microbatches=4, start_method="forkserver",  # about learning, not start-up
    )
    with runner:
        before = (runner.predict(x_test).argmax(1) == y_test).float().mean().item()
        first = last = None
        for epoch in range(6):
            for i in range(0, len(x_train), 64):
                loss = runner.step(x_train[i : i + 64], y_train[i : i + 64])
                first = loss if first is None else first
                last = loss
        accuracy = (runner.predict(x_test).argmax(1) == y_test).float().mean().item()
    assert before < 0.3
    assert last < first / 4
    assert accuracy > 0.90, f"held-out accuracy {accuracy:.1%}"


@pytest.mark.timeout(30)
def test_train_digits_says_what_it_does_within_a_second():
    """``python examples/train_digits.py`` prints what it does before torch's import (seconds) and
    the stages' start-up: its first line comes within a second (then it is stopped: simulated mode,
    no stage process to leave behind)."""
    import os
    import select
    import subprocess
    import sys
    import time

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, os.path.join(root, "examples", "train_digits.py"), "--mode", "simulated",
                          "--epochs", "1"], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         env={**os.environ, "PYTHONPATH": root, "PYTHONUNBUFFERED": "1"})
    try:
        ready, _, _ = select.select([p.stdout], [], [], 1.0)
        first = p.stdout.readline().decode() if ready else ""
        waited = time.perf_counter() - t0
    finally:
        p.kill()
        p.communicate()
    assert first.startswith("pipeq example: a 3-stage MLP learns scikit-learn's digits"), (first, waited)
    assert waited < 1.0, waited
