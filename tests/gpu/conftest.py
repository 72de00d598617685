"""tests/gpu/: pipeq's CUDA paths, on a machine with one GPU or more (marker ``cuda``).

Every module here starts with ``pytestmark = CUDA`` (tests/support/gpu_cases.py): without CUDA
its tests are collected and reported skipped, and nothing else runs (no process, no CUDA call).
Tests that need two GPUs say so (``needs_gpus(2)``) and are skipped, with the reason, on one.
The helpers, models and the one-device reference are in gpu_cases.py (the stage processes
import the models from there); README.md here says how to run the folder and what it covers.
"""

from __future__ import annotations

import os

import pytest
import torch

from pipeq.control.config import START_METHOD_ENV


@pytest.fixture(autouse=True)
def _fork_server(monkeypatch):
    """Stage processes from a fork server (a fresh interpreter that never touches CUDA: its
    children initialise CUDA themselves, as spawned ones do) rather than one interpreter each, so
    that the folder fits the GPU check's time limit. spawn is tested by name (test_cuda_devices.py;
    the GPU check runs examples/gpt.py with the default). A value the caller set wins."""
    if START_METHOD_ENV not in os.environ:
        monkeypatch.setenv(START_METHOD_ENV, "forkserver")


def pytest_report_header(config) -> str:
    """The GPUs this run sees (shown when tests/gpu is named on the command line)."""
    if not torch.cuda.is_available():
        return "cuda: not available (tests/gpu/ is skipped)"
    names = [torch.cuda.get_device_name(k) for k in range(torch.cuda.device_count())]
    return f"cuda: {len(names)} device(s): {', '.join(names)}; torch {torch.__version__}, CUDA {torch.version.cuda}"
