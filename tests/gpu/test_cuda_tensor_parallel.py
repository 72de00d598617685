"""Tensor parallelism over NCCL: ``tensor_parallel=2`` on CUDA (needs 2 GPUs or more).

A CUDA stage's shards join a "cpu:gloo,cuda:nccl" process group (pipeq.parallel.mesh.StageMesh):
DTensor's collectives (the weights' scatter at start-up, the rowwise all-reduces) run over
NCCL, which refuses two shards of one group on the same GPU. The Linear layers are
ShardedLinear probes: a forward fails unless its weight really is split. Training must equal
one process on cuda:0 (the CPU tests' bound: 1e-5).

Two stages of two shards: by default shard s of stage k runs on cuda:((k*2 + s) mod GPUs)
(pipeq.control.processes.plan_devices), so each stage's shards take two GPUs even on exactly two;
over CUDA IPC a lead receives device tensors and shares host copies of them with its other shard
(pipeq.wire.shard_link.host_tensors). Both were found by reading the code (CPU unit tests:
tests/unit/control/test_device_plan.py, tests/unit/wire/test_shard_link.py).
"""

from __future__ import annotations

import collections

import pytest
import torch

from gpu_cases import CUDA, FP32_TOL, assert_matches, batches, needs_gpus, predict, reference, train
from models import TP_PLAN, tp_stages

pytestmark = [*CUDA, needs_gpus(2), pytest.mark.timeout(300)]


def shard_devices(workers) -> dict[int, list[str]]:
    """Each stage's shards' devices."""
    out = collections.defaultdict(list)
    for w in sorted(workers, key=lambda w: (w["stage"], w["shard"])):
        out[w["stage"]].append(w["device"])
    return dict(out)


def test_one_stage_on_two_gpus_equals_one_device_training():
    """One stage, its two shards on cuda:0 and cuda:1 (the default round-robin)."""
    stages = [tp_stages(seed=0, probe=True)[1]]  # Linear 8->16 colwise, 16->8 rowwise, 8->4 colwise
    data = batches(4, 10, d_in=8, classes=4)
    x_eval = batches(1, 7, seed=2, d_in=8, classes=4)[0][0]
    got = train(stages, data, microbatches=3, tensor_parallel=2, tp_plan=[TP_PLAN[1]], x_eval=x_eval)
    assert shard_devices(got.workers) == {0: ["cuda:0", "cuda:1"]}
    want = reference(stages, data)
    assert_matches(got, want, FP32_TOL)
    assert got.pred.shape == (7, 4)
    torch.testing.assert_close(got.pred, predict(want, x_eval), atol=FP32_TOL, rtol=0)


def test_two_stages_of_two_shards_equal_one_device_training():
    """Two stages x two shards (4 processes), default placement: every stage's shards on two
    different GPUs. shm_slots=0: the leads exchange host copies (pinned), which they share with
    their followers as they are."""
    stages = tp_stages(seed=0, probe=True)
    data = batches(4, 10, d_in=8, classes=4)
    got = train(stages, data, microbatches=3, tensor_parallel=2, tp_plan=TP_PLAN, shm_slots=0)
    for stage, devices in shard_devices(got.workers).items():
        assert len(set(devices)) == 2, f"stage {stage}'s shards share a GPU: {devices}"
    assert_matches(got, reference(stages, data), FP32_TOL)


def test_two_stages_of_two_shards_over_cuda_ipc_equal_one_device_training():
    """The same with the default wire: the leads' activations and gradients over CUDA IPC."""
    stages = tp_stages(seed=0, probe=True)
    data = batches(4, 10, d_in=8, classes=4)
    got = train(stages, data, microbatches=3, tensor_parallel=2, tp_plan=TP_PLAN)
    for stage, devices in shard_devices(got.workers).items():
        assert len(set(devices)) == 2, f"stage {stage}'s shards share a GPU: {devices}"
    assert_matches(got, reference(stages, data), FP32_TOL)
