"""PipelineRunner cases: the data, a run of a runner, and the check against single-process training."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pipeq
from models import flat_state, reference_train

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def batches(n_steps: int, batch: int, seed: int = 1, d_in: int = 8, classes: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, d_in, generator=g), torch.randint(0, classes, (batch,), generator=g))
        for _ in range(n_steps)
    ]


def run(stages, data, *, schedule, microbatches, mode, loss_fn=None, opt=SGD, **kw):
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    runner = pipeq.PipelineRunner(
        stages, loss_fn=loss_fn, optimizer=opt, schedule=schedule, microbatches=microbatches,
        mode=mode, **kw,
    )
    with runner:
        losses = [runner.step(x, y) for x, y in data]
        state = runner.state_dict()
        out = runner.predict(data[0][0])
    return losses, state, out


def assert_matches_reference(stages, data, losses, state, loss_fn=None, opt=SGD, tol=1e-5):
    model, ref_losses = reference_train(stages, loss_fn or nn.CrossEntropyLoss(), opt, data)
    assert losses == pytest.approx(ref_losses, abs=tol)
    ref_state = flat_state(model)
    assert list(state) == list(ref_state)
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, atol=tol, rtol=0, msg=name)
    return model
