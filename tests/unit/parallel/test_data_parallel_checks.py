"""Data parallelism without processes: the flat gradient buckets, the order of the sum, and the settings refused before anything starts."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pipeq

from launch_util import DIGITS_JOB
from models import mlp_stages

pytestmark = pytest.mark.timeout(300)

FAST = dict(start_method="forkserver")  # stages fork from a preloaded server: ~0.1 s each
MOMENTUM = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
WIDTHS = (8, 16, 3)  # two stages: Linear(8, 16) + ReLU, Linear(16, 3)


def test_flat_layout_cuts_by_dtype_and_size_and_puts_back_in_place():
    from pipeq.parallel.data import FlatLayout

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(5, 7, generator=g), torch.arange(6, dtype=torch.int64),
               torch.randn(7, 5, generator=g).t(),  # not contiguous
               torch.randn(40, generator=g, dtype=torch.float64), torch.zeros(0), torch.randn(3, generator=g)]
    layout = FlatLayout(tensors, bucket_bytes=64)  # 16 float32, 8 int64/float64 per bucket
    assert all(n * torch.empty((), dtype=dt).element_size() <= 64 for n, dt in zip(layout.numels, layout.dtypes))
    assert sum(layout.numels) == sum(t.numel() for t in tensors)
    assert {dt for dt in layout.dtypes} == {torch.float32, torch.int64, torch.float64}
    for b in range(len(layout)):  # one dtype per bucket; a tensor is cut across buckets, in order
        assert len({tensors[i].dtype for i, _, _ in layout.pieces[b]}) == 1
    flats = [layout.gather(b, tensors) for b in range(len(layout))]
    targets = [torch.full_like(t, -1) for t in tensors]
    targets[2] = torch.empty(7, 5).t()  # the non-contiguous one too
    for b, flat in enumerate(flats):
        layout.scatter(b, flat, targets)
    for t, u in zip(tensors, targets):
        assert torch.equal(t, u)
    flats[0].add_(1)  # a bucket is a copy, never a view of the tensors
    assert torch.equal(targets[0], tensors[0])


def test_the_sum_is_added_in_replica_order_and_never_into_ones_own_bucket():
    from pipeq.stage.transfer import ordered_sum

    g = torch.Generator().manual_seed(1)
    buckets = [torch.randn(1000, generator=g) * 10 ** e for e in (0, 7, -7)]
    expect = (buckets[0] + buckets[1]) + buckets[2]
    for mine in range(3):
        got = [b.clone() for b in buckets]
        own = got[mine].clone()
        total = ordered_sum(got, mine)
        assert torch.equal(total, expect)  # the same bits on every replica
        assert torch.equal(got[mine], own)  # ZeroMQ may still be sending it


# -- 5. what is refused -------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1, "2", 2.0, True])
def test_data_parallel_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="data_parallel"):
        pipeq.PipelineRunner(mlp_stages(WIDTHS), nn.CrossEntropyLoss(), MOMENTUM, "1f1b", 2,
                             data_parallel=bad, **FAST)


@pytest.mark.parametrize("schedule", ["async", "al"])
def test_per_microbatch_update_schedules_are_refused(schedule):
    with pytest.raises(ValueError, match=f"'{schedule}'"):
        pipeq.PipelineRunner(mlp_stages(WIDTHS), nn.CrossEntropyLoss(), MOMENTUM, schedule, 2,
                             data_parallel=2, **FAST)


def test_simulated_mode_is_refused():
    with pytest.raises(ValueError, match="mode='process'"):
        pipeq.PipelineRunner(mlp_stages(WIDTHS), nn.CrossEntropyLoss(), MOMENTUM, "1f1b", 2,
                             mode="simulated", data_parallel=2)


def test_replica_stage_lists_must_match():
    with pytest.raises(ValueError, match="3 replica stage lists"):
        pipeq.PipelineRunner([mlp_stages(WIDTHS, seed=s) for s in range(3)], nn.CrossEntropyLoss(),
                             MOMENTUM, "1f1b", 2, data_parallel=2, **FAST)
    with pytest.raises(ValueError, match="replica 1"):
        pipeq.PipelineRunner([mlp_stages(WIDTHS), mlp_stages((8, 12, 3))], nn.CrossEntropyLoss(),
                             MOMENTUM, "1f1b", 2, data_parallel=2, **FAST)
    with pytest.raises(ValueError, match="replica 1"):  # a different number of stages
        pipeq.PipelineRunner([mlp_stages(WIDTHS), mlp_stages((8, 16, 16, 3))], nn.CrossEntropyLoss(),
                             MOMENTUM, "1f1b", 2, data_parallel=2, **FAST)


def test_launch_refuses_a_bad_replica_count(tmp_path):
    from pipeq.launch.cli import main

    assert main(["launch", DIGITS_JOB, "--quiet", "--data-parallel", "0",
                 "--out", str(tmp_path)]) != 0
