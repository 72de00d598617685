"""Tuples and dicts as inputs, outputs and targets cross stage processes and replicas as they cross simulated stages."""

from __future__ import annotations

import pytest
import torch

import pipeq
from inputs_cases import SGD, assert_states_close, batch, reference, stages, two_part_loss
from models import flat_state


@pytest.mark.timeout(120)
def test_trees_cross_process_boundaries_and_replicas_alike():
    """Process mode with two replicas: the trees travel in the data messages' headers and in
    the commands; the run equals single-process training of the whole batch."""
    data = [batch(12, s) for s in range(2)]
    model, want = reference(stages(), data)
    runner = pipeq.PipelineRunner(stages(), two_part_loss, SGD, "1f1b", 3, data_parallel=2,
                                  start_method="forkserver")
    with runner:
        got = [runner.step(x, t) for x, t in data]
        out = runner.predict(data[1][0])
        state = runner.state_dict()
    assert got == pytest.approx(want, rel=1e-5)
    assert_states_close(state, flat_state(model))
    with torch.no_grad():
        torch.testing.assert_close(out["logits"], model(data[1][0])["logits"])
