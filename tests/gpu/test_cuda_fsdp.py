"""Sharded replicas of CUDA stages: ``data_parallel=2, sharding="fsdp"`` (pipeq.parallel.fsdp).

A stage's two replicas shard it with torch's FSDP2 over NCCL, which refuses two ranks of one
group on one GPU: each replica of a stage needs a GPU of its own (2+ GPUs; on one GPU the run is
refused before any process starts, naming why). By default process g runs on cuda:(g mod G), so
a stage count that is no multiple of G puts a stage's replicas on two GPUs. Training must equal
one process on cuda:0 with the whole batch.
"""

from __future__ import annotations

import pytest
import torch

import pipeq

from gpu_cases import CUDA, FP32_TOL, assert_matches, batches, mlp, needs_gpus, reference, train

pytestmark = [*CUDA, pytest.mark.timeout(300)]


def _processes_apart(least: int) -> int:
    """The fewest processes per replica (``least`` or more) that put a stage's two replicas on
    different GPUs by default (process j of the host on cuda:(j mod GPUs))."""
    gpus = torch.cuda.device_count()
    return next(p for p in range(least, least + gpus + 1) if p % gpus)


@needs_gpus(2)
@pytest.mark.parametrize("schedule, per_process", [("1f1b", 1), ("zbv", 2)])
def test_sharded_replicas_on_cuda_equal_one_device_training(schedule, per_process):
    n = _processes_apart(2 // per_process) * per_process  # zbv: two stages per process
    stages = mlp(n)
    data = batches(3, 12, seed=5)
    got = train(stages, data, schedule=schedule, microbatches=max(4, n), data_parallel=2, sharding="fsdp")
    assert_matches(got, reference(stages, data), FP32_TOL)


def test_two_replicas_of_a_stage_on_one_gpu_are_refused_before_anything_starts():
    with pytest.raises((ValueError, pipeq.PipelineError), match="NCCL refuses two ranks of one group on one GPU"):
        train(mlp(2), batches(1, 8), data_parallel=2, sharding="fsdp", devices=["cuda:0", "cuda:0"])
