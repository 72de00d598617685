"""What a runner says when it is misused: each message names what to do instead."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pipeq

SGD = functools.partial(torch.optim.SGD, lr=0.1)


class ReturnsNone(nn.Module):
    def forward(self, x):
        return None


def runner(stages=None):
    return pipeq.PipelineRunner(stages or [nn.Linear(8, 8), nn.Linear(8, 3)], nn.CrossEntropyLoss(), SGD,
                                microbatches=2, mode="simulated")


def xy():
    return torch.randn(4, 8), torch.randint(0, 3, (4,))


def test_a_closed_runner_says_to_build_a_new_one_not_to_start_it():
    x, y = xy()
    r = runner()
    with r:
        r.step(x, y)
    with pytest.raises(pipeq.PipelineError, match="build a new runner and load_state_dict") as info:
        r.step(x, y)
    assert "runner.start()" not in str(info.value)
    with pytest.raises(pipeq.PipelineError, match="build a new runner"):
        r.state_dict()
    with pytest.raises(pipeq.PipelineError, match="Create a new runner"):  # as start() itself says
        r.start()


def test_a_stream_of_tensors_says_what_a_batch_is():
    x, y = xy()
    with runner() as r:
        with pytest.raises(ValueError, match=r"a batch is an \(x, target\) pair or an \(x, target, "
                                             r"stage_inputs\) triple, got a Tensor"):
            list(r.stream([x, x]))
        assert len(list(r.stream([(x, y), [x, y]]))) == 2  # the runner goes on


def test_a_stage_returning_none_is_named_itself_not_the_next_stage():
    x, y = xy()
    with runner([nn.Linear(8, 8), ReturnsNone(), nn.Linear(8, 3)]) as r:
        with pytest.raises(pipeq.PipelineError) as info:
            r.step(x, y)
    assert info.value.stage == 1
    assert "its forward returned None" in info.value.message
    assert "shape :" not in str(info.value)
