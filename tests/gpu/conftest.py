"""Tests of tests/gpu/ need CUDA (marker ``cuda``): without it they are skipped, saying why.

A machine with a GPU runs them with ``python -m pytest -m cuda``.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (torch.cuda.is_available() is False)")
