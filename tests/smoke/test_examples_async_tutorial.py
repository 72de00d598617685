"""examples/async_tutorial.py reproduces the parallelism tutorial's printed pipeline losses (its first two).

Iteration 3 prints batch 0's loss, before any update: it checks the initial weights, i.e. the
RNG draws the example replays (without cell 4's four throwaway layers it is 0.717). Iteration
1003 prints batch 1000's: it checks the schedule too (warmup 2 or 4 instead of 3 gives other
numbers). Simulated mode, so the numbers do not depend on how received buffers are aligned.
"""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path.insert(0, ROOT)
from examples import async_tutorial  # noqa: E402


@pytest.mark.timeout(60)
def test_first_printed_losses_are_the_notebooks(capsys):
    out = async_tutorial.main(["--batches", "1004", "--mode", "simulated"])
    printed = capsys.readouterr().out
    assert len(out["losses"]) == 1004
    assert sorted(out["printed"]) == [3, 1003]
    assert f"{out['printed'][3]:.3f}" == "0.691"
    assert f"{out['printed'][1003]:.3f}" == "0.599"
    assert "loss at iteration 3: 0.691" in printed and "loss at iteration 1003: 0.599" in printed
    assert "(2 of 2 equal to the printed 3 decimals)" in printed
