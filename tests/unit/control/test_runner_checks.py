"""PipelineRunner in simulated mode equals single-process training, and what it refuses before anything starts."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pipeq
from models import mlp_stages
from runner_cases import SGD, assert_matches_reference, batches, run

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("schedule", ["fill-drain", "1f1b"])
@pytest.mark.parametrize(
    "n_stages,batch,microbatches",
    [
        (3, 50, 8),  # uneven: sizes 7,7,6,6,6,6,6,6
        (4, 24, 2),  # fewer microbatches than stages
        (3, 16, 1),  # a single microbatch
        (2, 5, 8),  # batch smaller than the microbatch count: one sample each
        (1, 20, 4),  # a single stage
    ],
)
def test_simulated_mode_equals_single_process_training(schedule, n_stages, batch, microbatches):
    widths = (8,) + (12,) * (n_stages - 1) + (3,)
    stages = mlp_stages(widths)
    data = batches(3, batch)
    losses, state, _ = run(stages, data, schedule=schedule, microbatches=microbatches, mode="simulated")
    assert_matches_reference(stages, data, losses, state)


def test_sum_reduced_loss_and_adam():
    stages = mlp_stages()
    data = batches(3, 30)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    adam = functools.partial(torch.optim.Adam, lr=0.01)
    losses, state, _ = run(
        stages, data, schedule="1f1b", microbatches=4, mode="simulated", loss_fn=loss_fn, opt=adam
    )
    assert_matches_reference(stages, data, losses, state, loss_fn=loss_fn, opt=adam, tol=1e-4)


def test_security_settings_are_checked():
    stages = mlp_stages()
    with pytest.raises(ValueError, match=r"tcp_security must be one of \('encrypt', 'authenticate'\), got 'none'"):
        pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), SGD, transport="tcp", tcp_security="none")
    with pytest.raises(ValueError, match="max_message_mb must be a whole number of MiB"):
        pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), SGD, max_message_mb=0.5)


def test_bad_arguments_are_refused_before_anything_starts():
    stages = mlp_stages()
    loss = nn.CrossEntropyLoss()
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'.*1f1b"):
        pipeq.PipelineRunner(stages, loss, SGD, schedule="zigzag")
    with pytest.raises(ValueError, match="microbatches"):
        pipeq.PipelineRunner(stages, loss, SGD, microbatches=0)
    with pytest.raises(ValueError, match="stage 1 is a str"):
        pipeq.PipelineRunner([stages[0], "nope"], loss, SGD)
    with pytest.raises(ValueError, match="reduction='none'"):
        pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(reduction="none"), SGD)
    with pytest.raises(ValueError, match="optimizer cannot be pickled"):
        pipeq.PipelineRunner(stages, loss, lambda params: torch.optim.SGD(params, lr=0.1))
    with pytest.raises(ValueError, match="mode"):
        pipeq.PipelineRunner(stages, loss, SGD, mode="threads")
    runner = pipeq.PipelineRunner(stages, loss, SGD, mode="simulated")
    with pytest.raises(pipeq.PipelineError, match="not running"):
        runner.step(torch.zeros(4, 8), torch.zeros(4, dtype=torch.long))
    with runner:
        with pytest.raises(ValueError, match=r"x has 4 samples.*target has 3"):
            runner.step(torch.zeros(4, 8), torch.zeros(3, dtype=torch.long))


def test_deadlocking_user_schedule_is_refused_before_anything_starts():
    from models import eager_backward

    with pytest.raises(pipeq.ScheduleError, match=r"deadlocks: stage 0 waits for the grad of microbatch 0"):
        pipeq.PipelineRunner(mlp_stages(), nn.CrossEntropyLoss(), SGD, schedule=eager_backward,
                             microbatches=2)
    assert pipeq.PipelineRunner(mlp_stages(), nn.CrossEntropyLoss(), SGD, schedule=eager_backward,
                                microbatches=1) is not None  # one microbatch: nothing to deadlock on
