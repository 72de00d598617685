"""Stages pinned to CUDA devices: each stage process runs on the device it is given (by default
``cuda:k`` round-robin) and says so in its READY, and training equals one process on cuda:0.

Covers pipeq.runtime.worker.select_device (torch.cuda.set_device, an unindexed "cuda"),
pipeq.control.processes.plan_devices (the round-robin), the executor's moves to its device
(pipeq.stage.microbatch.to_device, non_blocking), predict's way back (pinned host copies,
pipeq.stage.transfer), and checkpoints of CUDA state (optimizer state to the CPU and back onto
other devices).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipeq
from gpu_cases import (CUDA, FP32_TOL, MOMENTUM, assert_matches, assert_states_close, batches, mlp, predict,
                       reference, round_robin, spread, train)

pytestmark = [*CUDA, pytest.mark.timeout(300)]


@pytest.mark.parametrize("schedule", ["fill-drain", "1f1b"])
def test_stages_on_the_devices_given_equal_one_device_training(schedule):
    """One stage per GPU (2 to 4 stages; two on cuda:0 with a single GPU)."""
    n = spread()
    devices = round_robin(n)
    stages = mlp(n)
    data = batches(4, 48)
    x_eval = batches(1, 13, seed=9)[0][0]
    got = train(stages, data, schedule=schedule, microbatches=4, devices=devices, x_eval=x_eval)
    assert got.devices == devices
    assert [s["memory"] for s in got.stats] == ["cuda allocated"] * n
    want = reference(stages, data)
    assert_matches(got, want, FP32_TOL)
    torch.testing.assert_close(got.pred, predict(want, x_eval), atol=FP32_TOL, rtol=0)


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_default_placement_is_cuda_round_robin(start_method):
    """devices=None: stage k on cuda:(k mod GPUs). Both start methods: a forked stage must still
    be able to initialise CUDA (the fork server imports torch, never CUDA)."""
    stages = mlp(3)
    data = batches(3, 30)
    got = train(stages, data, microbatches=3, start_method=start_method)
    assert got.devices == round_robin(3)
    assert_matches(got, reference(stages, data), FP32_TOL)


def test_an_unindexed_cuda_device_is_the_current_one():
    """devices=["cuda", "cuda"]: each stage process takes its current device, cuda:0."""
    stages = mlp(2)
    data = batches(2, 16)
    got = train(stages, data, microbatches=2, devices=["cuda", "cuda"])
    assert got.devices == ["cuda:0", "cuda:0"]
    assert_matches(got, reference(stages, data), FP32_TOL)


def test_a_checkpoint_of_cuda_stages_resumes_on_other_devices(tmp_path):
    """Two steps, a checkpoint (weights and momentum buffers come off the GPUs), then two more
    steps in a runner with the stages on the devices in reverse order: the four steps equal
    four uninterrupted steps on cuda:0."""
    n = spread()
    stages = mlp(n)
    data = batches(4, 32)
    first = train(stages, data[:2], devices=round_robin(n), save_to=tmp_path / "ckpt")
    runner = pipeq.PipelineRunner(copy.deepcopy(stages), nn.CrossEntropyLoss(), MOMENTUM, "1f1b", 4,
                                  devices=round_robin(n)[::-1])
    with runner:
        runner.load(str(tmp_path / "ckpt"))
        losses = first.losses + [runner.step(x, y) for x, y in data[2:]]
        state = runner.state_dict()
    want = reference(stages, data)
    assert losses == pytest.approx(want.losses, abs=FP32_TOL)
    assert_states_close(state, want.state, FP32_TOL)
