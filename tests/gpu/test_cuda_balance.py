"""pipeq.balance on a GPU (no stage processes): it profiles on the device it is given
(torch.cuda.synchronize around each timed layer) and leaves the caller's CUDA random stream
as it was (torch.random.fork_rng over the device: dropout in the profiled layers draws)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeq
from pipeq.balance import profile_sizes, profile_times

from gpu_cases import CUDA

pytestmark = CUDA


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Dropout(0.5), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))


@pytest.mark.parametrize("by", ["time", "memory"])
def test_balance_on_cuda_gives_a_split_and_leaves_the_caller_as_it_was(by):
    m = model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    sample = torch.randn(32, 64)
    torch.cuda.manual_seed(5)
    rng = torch.cuda.get_rng_state("cuda:0")
    counts = pipeq.balance(m, 3, sample, by=by, device="cuda:0")
    assert len(counts) == 3 and min(counts) >= 1 and sum(counts) == len(m)
    assert torch.equal(torch.cuda.get_rng_state("cuda:0"), rng)
    assert all(p.device.type == "cpu" for p in m.parameters())  # profiled on private copies
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


def test_profiles_measured_on_cuda():
    m, sample = model(), torch.randn(32, 64)
    times = profile_times(m, sample, repeats=3, device="cuda:0")
    assert len(times) == len(m) and all(t > 0 for t in times)
    sizes = profile_sizes(m, sample, device="cuda:0")  # 2 x the parameters, plus the saved activations
    assert sizes[0] > 2 * (64 * 512 + 512) * 4 and sizes[3] > 2 * (512 * 512 + 512) * 4
