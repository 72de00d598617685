"""Data parallelism of CUDA stages: ``data_parallel=2``.

Each stage sums its gradients with its replicas in a torch process group (pipeq.parallel.mesh):
NCCL when the replicas have a GPU each, gloo (through host memory, said once) when they share
one, as stage k's two replicas do here on one or two GPUs (tests/gpu/test_cuda_collectives.py
has the NCCL path). Training must equal one process on cuda:0 with the whole batch.
"""

from __future__ import annotations

import pytest

from gpu_cases import CUDA, FP32_TOL, assert_matches, batches, mlp, reference, round_robin, train

pytestmark = [*CUDA, pytest.mark.timeout(300)]


@pytest.mark.parametrize("schedule", ["fill-drain", "1f1b"])
def test_two_replicas_on_cuda_equal_one_device_training(schedule):
    """2 replicas x 2 stages, placed round-robin (with 2 GPUs: each replica has a stage on
    each GPU, and stage k's two replicas share GPU k); 11 samples: replica shards of 6 and 5."""
    stages = mlp(2)
    data = batches(3, 11, seed=5)
    got = train(stages, data, schedule=schedule, microbatches=2, data_parallel=2)
    assert got.devices == round_robin(4)  # replica 0's stages, then replica 1's
    assert_matches(got, reference(stages, data), FP32_TOL)
