"""examples/gpt.py (a byte-level GPT trained with pipeq) on CUDA, as a user runs it: 20 steps
with ``--device cuda`` (each stage on its own GPU, round-robin), to the end, with finite losses."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

from gpu_cases import CUDA

pytestmark = CUDA

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
GPT = os.path.join(ROOT, "examples", "gpt.py")
COMMAND = [sys.executable, GPT, "--device", "cuda", "--steps", "20", "--quick"]  # and --out (a directory)

#: a number after "loss" on a line ("loss 2.31", "loss=2.31", "train loss: nan"...)
LOSS = re.compile(r"loss\b[^0-9a-z+-]{0,3}([-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|nan|inf))", re.IGNORECASE)


@pytest.mark.timeout(600)
def test_gpt_example_trains_20_steps_on_cuda(tmp_path):
    assert os.path.exists(GPT), "examples/gpt.py is missing"
    command = COMMAND + ["--out", str(tmp_path)]  # model.pt goes there, not under the repository
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))  # this pipeq
    r = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=540,
                       env={**os.environ, "PYTHONPATH": path})
    printed = r.stdout + r.stderr
    assert r.returncode == 0, f"{' '.join(command)} exited {r.returncode}:\n{printed[-4000:]}"
    losses = [float(m.group(1)) for m in LOSS.finditer(printed)]
    assert losses, f"no loss line in the output:\n{printed[-4000:]}"
    assert all(math.isfinite(v) for v in losses), losses
