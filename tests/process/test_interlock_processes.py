"""Interlocking backpropagation in stage processes: the numbers of the hand computation and of simulated mode, and a run that learns digits."""

from __future__ import annotations

import pytest
import torch

from interlock_cases import (
    SCHEMES, SCHEME_IDS, TWO_SAMPLES, assert_state_equal, batches, digits_accuracy, digits_split, run,
    scalar_step
)

pytestmark = pytest.mark.timeout(300)


# -- the scalar chain ---------------------------------------------------------------------------
def test_scalar_chain_process_mode_matches_hand():
    assert scalar_step("pairwise", None, [1.0, -2.0], [0.5, 1.0], microbatches=2,
                       mode="process") == pytest.approx(TWO_SAMPLES["pairwise"], abs=1e-4)


# -- small Linear stages with Linear heads -----------------------------------------------------------
@pytest.mark.parametrize(("schedule", "d"), SCHEMES, ids=SCHEME_IDS)
def test_process_mode_equals_simulated(schedule, d):
    data = batches(4, size=11, seed=7)  # 11 samples: microbatches of 4, 4, 3
    x_eval = batches(1, seed=8)[0][0]
    sim = run(schedule, d, data=data, x_eval=x_eval)
    proc = run(schedule, d, data=data, x_eval=x_eval, mode="process")
    assert_state_equal(proc[0], sim[0], exact=False, atol=1e-6)
    assert proc[1] == pytest.approx(sim[1], abs=1e-6)
    torch.testing.assert_close(proc[2], sim[2], atol=1e-6, rtol=0)


# -- real data ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def digits():
    return digits_split()


def test_pairwise_learns_digits_in_process_mode(digits):
    accuracy = digits_accuracy(digits, "pairwise", mode="process")
    assert accuracy > 0.90, f"held-out accuracy {accuracy:.1%}"
