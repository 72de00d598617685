"""Stage inputs cross process boundaries: the driver's commands carry each stage's mask and position ids
(each replica its shard), and the run equals one process's training of the same model."""

from __future__ import annotations

import pytest
import torch

import pipeq
from stage_inputs_cases import SGD, assert_states_close, batch, flat, forward, reference, stages, token_loss

DATA = [batch(10, s) for s in range(3)]


@pytest.mark.timeout(120)
def test_named_inputs_reach_the_stage_processes_in_steps_streams_and_predict():
    """1F1B, inputs routed by name (the stages' declarations come back in their READY): a step,
    a stream of (x, target, stage_inputs) triples, predict and evaluate all equal one process."""
    model, want = reference(stages(), DATA)
    runner = pipeq.PipelineRunner(stages(), token_loss, SGD, "1f1b", 3, start_method="forkserver")
    with runner:
        with pytest.raises(ValueError, match="stage 1 takes the inputs 'mask', 'pos'"):
            runner.step(DATA[0][0], DATA[0][1])
        got = [runner.step(*DATA[0][:2], stage_inputs=DATA[0][2])] + list(runner.stream(DATA[1:]))
        state = runner.state_dict()
        out = runner.predict(DATA[0][0], stage_inputs=DATA[0][2])
        metrics = runner.evaluate(DATA[:1])
    assert got == pytest.approx(want, rel=1e-9)
    assert_states_close(state, flat(model))
    with torch.no_grad():
        torch.testing.assert_close(out, forward(model, DATA[0][0], DATA[0][2]))
        assert metrics["loss"] == pytest.approx(token_loss(out, DATA[0][1]).item(), rel=1e-9)


@pytest.mark.timeout(120)
def test_each_replica_gets_its_shard_of_the_inputs_and_recompute_reuses_them():
    """Fill-drain over two replicas with recomputation, inputs given by stage index: every
    replica trains on its half of each input, and the run still equals one process."""
    model, want = reference(stages(), DATA)
    runner = pipeq.PipelineRunner(stages(), token_loss, SGD, "fill-drain", 2, data_parallel=2, recompute=True,
                                  start_method="forkserver")
    with runner:
        got = [runner.step(x, y, stage_inputs={1: i, 2: i}) for x, y, i in DATA]
        state = runner.state_dict()
        assert all(s["recompute"] for s in runner.stats())
    assert got == pytest.approx(want, rel=1e-9)
    assert_states_close(state, flat(model))
