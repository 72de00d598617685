"""Two stages per process on CUDA (ZBV, interleaved 1F1B, DualPipeV): each process's stages on one
device, activations between them handed over on the device, equal to one process on cuda:0."""

from __future__ import annotations

import pytest
import torch

from gpu_cases import CUDA, FP32_TOL, assert_matches, batches, mlp, reference, train

pytestmark = [*CUDA, pytest.mark.timeout(300)]


@pytest.mark.parametrize("schedule", ["zbv", "interleaved-1f1b", "dualpipev"])
def test_two_stages_per_process_on_cuda_equal_one_device(schedule):
    steps = batches(3, [16, 13, 16])  # one uneven batch
    want = reference(mlp(4), steps)
    got = train(mlp(4), steps, schedule=schedule, microbatches=4)  # 2 processes, CUDA round-robin
    assert_matches(got, want, FP32_TOL)
    by_stage = {w["stage"]: w for w in got.workers}
    groups = ([0, 3], [1, 2]) if schedule != "interleaved-1f1b" else ([0, 2], [1, 3])
    for a, b in groups:  # a process's stages share its pid and its device
        assert by_stage[a]["pid"] == by_stage[b]["pid"] and by_stage[a]["device"] == by_stage[b]["device"]
        assert torch.device(by_stage[a]["device"]).type == "cuda"
