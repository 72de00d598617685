"""A batch given as its microbatches crosses stage processes and replicas: microbatches of different
lengths and rows, each with its own stage inputs, padded targets; the run equals one process computing
the mean over every kept token of the batch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import pipeq
from pipeq import Microbatches
from stage_inputs_cases import SGD, V, assert_states_close, flat, forward, stages, token_loss

LENGTHS, ROWS = (5, 3, 4, 2), (2, 3, 1, 2)  # per microbatch: two replicas take two each


def step_data(seed: int) -> list[tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]:
    """(tokens, targets with -100 padding, {"mask", "pos"}) per microbatch."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for length, rows in zip(LENGTHS, ROWS):
        tokens = torch.randint(0, V, (rows, length), generator=g)
        y = torch.randint(0, V, (rows, length), generator=g)
        y[0, length // 2:] = -100  # the first row padded
        mask = (torch.rand(rows, length, generator=g) > 0.3).double()
        mask[:, 0] = 1.0
        pos = torch.randint(0, length, (rows, length), generator=g)
        out.append((tokens, y, {"mask": mask, "pos": pos}))
    return out


def reference(steps):
    """One process (:func:`models.reference_train`): each step's loss is the mean cross-entropy over
    the batch's kept tokens."""
    from models import reference_train

    def loss_of(model, data):
        logits = torch.cat([forward(list(model), x, i).reshape(-1, V) for x, _, i in data])
        return F.cross_entropy(logits, torch.cat([y.reshape(-1) for _, y, _ in data]))

    model, losses = reference_train([], None, SGD, steps, model=nn.ModuleList(copy.deepcopy(stages())), loss_of=loss_of)
    return list(model), losses


@pytest.mark.timeout(120)
def test_microbatches_of_different_lengths_train_over_replicas_equal_to_one_process():
    steps = [step_data(s) for s in range(2)]
    model, want = reference(steps)
    runner = pipeq.PipelineRunner(stages(), token_loss, SGD, "zb-h1", 2, data_parallel=2, start_method="forkserver")
    with runner:
        got = [runner.step(Microbatches(steps[0]))]  # (x, target, stage_inputs) triples
        x, y, inputs = (Microbatches(part) for part in zip(*steps[1]))
        got += [runner.step(x, y, stage_inputs=inputs)]  # the same, item by item
        state = runner.state_dict()
        out = runner.predict(Microbatches(x[:2]), stage_inputs=Microbatches(inputs[:2]))  # on one replica
        with pytest.raises(ValueError, match="holds 4 microbatches; it must hold 1 to microbatches=2"):
            runner.predict(x, stage_inputs=inputs)
    assert got == pytest.approx(want, abs=1e-9)
    assert_states_close(state, flat(model))
    with torch.no_grad():
        assert len(out) == 2
        for o, (tokens, _, given) in zip(out, steps[1]):
            torch.testing.assert_close(o, forward(model, tokens, given))
