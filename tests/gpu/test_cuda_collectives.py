"""The replicas' gradient sum on CUDA never leaves the device (pipeq.parallel.data, pipeq.parallel.mesh).

A CUDA stage's gradients are gathered into flat buckets on its GPU, all-reduced there by NCCL and
put back on the GPU: no bucket, no gradient, goes through host memory (the replica link it
replaced copied each bucket to pinned host memory and added them on the CPU). The first test
watches :class:`~pipeq.parallel.data.GradSync`'s whole path with the CUDA profiler, in this
process (one GPU: the group's collective is stood in for by a device-side sum, which is what NCCL
computes), and finds no device-to-host copy. With two GPUs or more, two replicas of a stage on two
GPUs sum over NCCL for real and train like one device.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpu_cases import CUDA, FP32_TOL, assert_matches, batches, mlp, needs_gpus, reference, train

pytestmark = [*CUDA, pytest.mark.timeout(300)]


class _DeviceGroup:
    """A replicate group of two whose other member's gradients equal this one's: its sum doubles
    each bucket, on the device, as NCCL's all-reduce would leave it."""

    members, me = [0, 1], 0

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        t.mul_(2)

    def finish(self, works, what: str) -> None:
        pass


def test_the_gradient_path_makes_no_copy_to_the_host():
    from torch.profiler import ProfilerActivity, profile

    from pipeq.parallel.data import GradSync

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256)).cuda()
    x = torch.randn(32, 256, device="cuda")
    sync = GradSync(list(model.parameters()), _DeviceGroup(), replicas=2, bucket_bytes=1 << 18)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sync.arm()  # the step's last backward: each bucket goes as its gradients are final
        model(x).square().mean().backward()
        sync.start()
        sync.finish()
        torch.cuda.synchronize()
    grads = [p.grad.clone() for p in model.parameters()]
    names = [e.name for e in prof.events()]
    assert any("Memcpy" in n or "cat" in n for n in names), "the profiler saw nothing of the path"
    assert not [n for n in names if "DtoH" in n or "Device -> Host" in n or "pin_memory" in n], names
    model.zero_grad()
    model(x).square().mean().backward()
    for g, p in zip(grads, model.parameters()):  # the bucket came back, summed, into the gradients
        torch.testing.assert_close(g, 2 * p.grad)


@needs_gpus(2)
def test_two_replicas_on_two_gpus_sum_over_nccl_like_one_device():
    """One stage, 2 replicas: replica r on cuda:r (the default placement, process g on cuda:(g mod
    G)), their replicate group NCCL's; 9 samples: replica shards of 5 and 4."""
    stages = mlp(1)
    data = batches(3, 9, seed=2)
    got = train(stages, data, schedule="1f1b", microbatches=1, data_parallel=2)
    assert got.devices == ["cuda:0", "cuda:1"]
    assert_matches(got, reference(stages, data), FP32_TOL)
