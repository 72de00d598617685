"""``fault_tolerance="replicas"`` without processes: the rescaling of a sum made without a lost replica, and the settings refused before anything starts."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

import pipeq
from pipeq import schedules
from pipeq.control.config import FaultConfig, PlacementConfig, RunConfig
from pipeq.control.replica_loss import check_replicas_mode
from pipeq.parallel.data import GradSync, survivor_scale

from models import mlp_stages

pytestmark = pytest.mark.timeout(60)

SGD = functools.partial(torch.optim.SGD, lr=0.1)


def test_the_scale_is_the_whole_batch_weight_over_the_summed_replicas():
    shares = [0.375, 0.375, 0.25]  # microbatch weights of 16 samples split 6 / 6 / 4
    assert survivor_scale(shares, [0, 1, 2], 3) == 1.0  # nobody lost: nothing scaled
    assert survivor_scale(shares, [0, 2], 3) == 1.0 / 0.625 == 1.6
    assert survivor_scale(shares, [1], 3) == math.fsum(shares) / 0.375
    assert survivor_scale(None, [0, 2], 3) == 1.5  # no shares given: equal ones
    with pytest.raises(ValueError, match="no replica to sum"):
        survivor_scale(shares, [], 3)
    with pytest.raises(ValueError, match="hold no loss weight"):
        survivor_scale([0.0, 1.0], [0], 2)
    with pytest.raises(ValueError, match="2 shares for 3 replicas"):
        survivor_scale([0.5, 0.5], [0], 3)


def test_rescaled_sum_is_the_mean_loss_gradient_over_the_completed_samples():
    """The survivors' weighted gradients, times the scale, are the gradient of the mean loss
    over their samples only (what the documented semantics promise)."""
    torch.manual_seed(0)
    model = nn.Linear(5, 3).double()
    x, y = torch.randn(10, 5, dtype=torch.float64), torch.randint(0, 3, (10,))
    shards = [slice(0, 4), slice(4, 7), slice(7, 10)]  # three replicas, 4 / 3 / 3 samples
    shares = [4 / 10, 3 / 10, 3 / 10]
    grads = []
    for part in shards:  # each replica: its samples' loss, weighted by their share of the whole batch
        model.zero_grad()
        (nn.functional.cross_entropy(model(x[part]), y[part]) * (part.stop - part.start) / 10).backward()
        grads.append(model.weight.grad.clone())
    summed = (grads[0] + grads[2]) * survivor_scale(shares, [0, 2], 3)  # replica 1 lost
    model.zero_grad()
    keep = torch.cat([torch.arange(0, 4), torch.arange(7, 10)])
    nn.functional.cross_entropy(model(x[keep]), y[keep]).backward()
    torch.testing.assert_close(summed, model.weight.grad, atol=1e-15, rtol=0)


class FakeLink:
    """A replica link whose other replicas' buckets are given; a replica in ``lost_after[r] = b``
    is lost once it has delivered b buckets (its LOST comes mid-round)."""

    def __init__(self, me: int, replicas: int, buckets: dict[int, list[torch.Tensor]], lost_after: dict[int, int]):
        self.replica, self.replicas = me, replicas
        self.buckets, self.lost_after = buckets, lost_after
        self.gone: set[int] = set()
        self.sent: list[tuple[int, int]] = []

    def others(self):
        return [r for r in range(self.replicas) if r != self.replica]

    def send(self, step, index, tensors, to=None):
        self.sent.append((step, index))

    def round_done(self, n, summed=None):
        self.done_round = n

    def wait_replica(self, sender, step, index):
        if index >= self.lost_after.get(sender, 1 << 30):
            self.gone.add(sender)
            return None
        return [self.buckets[sender][index].clone()]


def test_a_replica_lost_mid_round_is_left_out_of_every_bucket_and_the_sum_rescaled():
    params = [nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4))]
    mine = [torch.full((4,), 1.0), torch.full((4,), 2.0)]
    for p, g in zip(params, mine):
        p.grad = g.clone()
    theirs = {1: [torch.full((4,), 10.0), torch.full((4,), 20.0)], 2: [torch.full((4,), 100.0), torch.full((4,), 200.0)]}
    link = FakeLink(0, 3, theirs, lost_after={2: 1})  # replica 2 sends bucket 0, then is lost
    sync = GradSync(params, link, bucket_bytes=16)  # one 4-float parameter per bucket
    sync.shares.append([0.5, 0.25, 0.25])
    sync.finish()
    assert sync.summed == [0, 1]
    scale = 1.0 / 0.75
    assert torch.equal(params[0].grad, torch.full((4,), 11.0) * scale)  # not 111: replica 2 is out of the round
    assert torch.equal(params[1].grad, torch.full((4,), 22.0) * scale)
    assert link.sent == [(1, 0), (1, 1)]  # (sent to the others as usual)


def test_without_a_loss_the_sum_is_bitwise_the_old_one():
    params = [nn.Parameter(torch.zeros(3))]
    params[0].grad = torch.tensor([0.1, 0.2, 0.3])
    link = FakeLink(1, 2, {0: [torch.tensor([1e-8, 3.0, 7.0])]}, {})
    sync = GradSync(params, link)
    sync.shares.append([0.5, 0.5])
    sync.finish()
    assert torch.equal(params[0].grad, torch.tensor([1e-8, 3.0, 7.0]) + torch.tensor([0.1, 0.2, 0.3]))


def _config(**placement):
    return RunConfig(fault=FaultConfig(fault_tolerance="replicas"), placement=PlacementConfig(**placement))


def test_what_replicas_mode_does_not_support_is_refused_by_name():
    with pytest.raises(ValueError, match=r"fault_tolerance must be None .* or 'replicas', got 'all'"):
        FaultConfig(fault_tolerance="all")
    with pytest.raises(ValueError, match=r"needs data_parallel >= 2 .* got data_parallel=1"):
        pipeq.PipelineRunner(mlp_stages((4, 8, 2)), nn.CrossEntropyLoss(), SGD, "1f1b", 2, fault_tolerance="replicas")
    with pytest.raises(ValueError, match="needs mode='process'"):
        check_replicas_mode(_config(data_parallel=2, mode="simulated"), multi_host=False)
    with pytest.raises(ValueError, match=r"does not support tensor_parallel=2"):
        check_replicas_mode(_config(data_parallel=2, tensor_parallel=2), multi_host=False)
    with pytest.raises(ValueError, match="one host only"):
        check_replicas_mode(_config(data_parallel=2), multi_host=True)
    with pytest.raises(ValueError, match="carries work across batches"):
        check_replicas_mode(RunConfig(schedule=schedules.AsyncOneFOneB(), fault=FaultConfig(fault_tolerance="replicas"),
                                      placement=PlacementConfig(data_parallel=2)), multi_host=False)
    check_replicas_mode(_config(data_parallel=2), multi_host=False)  # what it supports, several stages
    check_replicas_mode(RunConfig(schedule=schedules.resolve("interleaved-1f1b"),  # per process too
                                  fault=FaultConfig(fault_tolerance="replicas"),
                                  placement=PlacementConfig(data_parallel=2)), multi_host=False)


def test_the_record_names_each_stage_that_left_a_lost_replica_out_even_when_its_loss_counted():
    """Replica 1 is lost at gradient round 5 (the step outstanding) after its last stage sent the
    step's loss (the driver counts it: no finished() row), while its stage 0 died before sending
    rounds 4 and 5. Replica 0's stage 0 ACKs having summed neither with it, stages 1 and 2 both:
    the record says step 4 and step 5 were degraded at stage 0 (step 5 was once missed)."""
    import types

    from pipeq.control.degraded import DegradedSteps
    from pipeq.control.replica_loss import ReplicaLoss, _Parting

    loss = ReplicaLoss(types.SimpleNamespace(n_stages=3), lambda: True, lambda: (5, 5), lambda: 1)
    record = DegradedSteps(2, 3, loss.rounds)
    for rnd in range(1, 6):
        record.sent(rnd, 10 + rnd)  # round k is the driver's step 10 + k
    part = _Parting(5, 1, 0.0, {0}, acked={0: set(), 1: {4, 5}, 2: {4, 5}}, last_round=5)
    loss._note_rounds(1, part)
    assert record.stages() == {14: {0: [0]}, 15: {0: [0]}}
    assert record.counts() == {14: 1, 15: 1}
