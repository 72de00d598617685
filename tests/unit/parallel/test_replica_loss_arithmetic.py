"""``fault_tolerance="replicas"`` without processes: the rescaling of a sum made without a lost replica, and the settings refused before anything starts."""

from __future__ import annotations

import functools
import math
import types

import pytest
import torch
from torch import nn

import pipeq
from pipeq import schedules
from pipeq.control.config import FaultConfig, PlacementConfig, RunConfig
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


class FakeGroup:
    """A replicate group in one process: member ``me`` of ``members``; each all-reduce adds the
    other members' next contributions (``theirs[m]``: one tensor per call, in order), or fails
    while ``fail`` holds calls left to fail; :meth:`all_gather` answers ``rows``."""

    def __init__(self, me, members, theirs, fail=0, rows=None):
        self.me, self.members, self.theirs, self.fail, self.rows = me, list(members), theirs, fail, rows
        self.formed = []
        self.device = torch.device("cpu")
        self.on_fail = lambda: None  # what happens as a collective fails (the driver's LOST comes)

    def wait(self, done, what):
        assert done(), f"would wait for ever: {what}"

    def form(self, members, tag):
        self.members = sorted(members)
        self.formed.append((tuple(self.members), tag))

    def all_reduce(self, t, op="sum"):
        if self.fail:
            self.fail -= 1
            self.on_fail()
            return "failed"
        if op == "min":
            return "done"
        for m in self.members:
            if m != self.me:
                t.add_(self.theirs[m].pop(0))
        return "done"

    def finish(self, works, what):
        from pipeq.parallel.mesh import CollectiveError

        if "failed" in works:
            raise CollectiveError(what)

    def all_gather(self, t):
        return [torch.tensor(row, dtype=torch.int64) for row in self.rows]


def _sync(group, rounds=None, replicas=3, bucket_bytes=16):
    params = [nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4))]
    for p, g in zip(params, [torch.full((4,), 1.0), torch.full((4,), 2.0)]):
        p.grad = g.clone()
    return params, GradSync(params, group, replicas, rounds=rounds, bucket_bytes=bucket_bytes, hooks=False)


def _membership(group, replicas=3, me=0):
    import collections

    from pipeq.parallel.membership import Membership

    acks = []
    m = Membership(group, collections.deque(), acks.append, types.SimpleNamespace(backward_gone=False), stage=0,
                   replica=me, replicas=replicas)
    return m, acks


def _lost(replica, from_round):
    from pipeq.wire import control
    from pipeq.wire.control import Lost

    return control.message(Lost(replica=replica, from_round=from_round), 7)


def test_a_replica_lost_mid_round_is_left_out_of_every_bucket_and_the_sum_rescaled():
    """Replica 2 dies during round 1's all-reduce: every survivor's failed (FAILED rows), so the
    round is summed again in the group rebuilt without it, and scaled by the shares summed."""
    group = FakeGroup(0, [0, 1, 2], {1: [torch.full((4,), 10.0), torch.full((4,), 20.0)]}, fail=2,
                      rows=[(1, 0), (1, 0)])
    rounds, acks = _membership(group)
    group.on_fail = lambda: rounds.commands.append(_lost(2, 1)) if not rounds.commands else None
    params, sync = _sync(group, rounds)
    sync.shares.append([0.5, 0.25, 0.25])
    sync.finish()
    assert group.formed == [((0, 1), "lost2@1")]
    assert sync.summed == [0, 1]
    scale = 1.0 / 0.75
    assert torch.equal(params[0].grad, torch.full((4,), 11.0) * scale)  # not 111: replica 2 is out of the round
    assert torch.equal(params[1].grad, torch.full((4,), 22.0) * scale)
    assert [control_ack(a) for a in acks] == [[]]  # its LOST ACKed: round 1 (from_round) not summed with it


def control_ack(msg):
    from pipeq.wire import control
    from pipeq.wire.control import Ack

    return control.read(msg, Ack).with_lost


def test_without_a_loss_the_sum_is_the_collectives_and_unscaled():
    group = FakeGroup(1, [0, 1], {0: [torch.full((4,), 1e-8), torch.full((4,), 3.0)]})
    params, sync = _sync(group, replicas=2)
    sync.shares.append([0.5, 0.5])
    sync.finish()
    assert sync.summed == [0, 1]
    assert torch.equal(params[0].grad, torch.full((4,), 1e-8) + torch.full((4,), 1.0))
    assert torch.equal(params[1].grad, torch.full((4,), 5.0))


@pytest.mark.parametrize("ok,rows,decision", [
    (True, [(4, 1), (4, 1)], "keep"),  # every survivor's sum completed: it counts the lost replica
    (True, [(4, 1), (5, 2)], "keep"),  # a survivor is past round 4 (its confirm completed): keep it
    (False, [(4, 0), (4, 1)], "redo"),  # one survivor's sum failed: everyone sums it again without
    (True, [(4, 1), (4, 0)], "redo"),
    (False, [(4, 0), (4, 2)], "redo"),  # a survivor learnt of the loss before round 4: it never summed it
])
def test_survivors_decide_alike_whether_the_round_in_flight_counted_the_lost_replica(ok, rows, decision):
    """(:mod:`pipeq.parallel.membership`.) The rule every survivor applies to the rows of the
    rebuilt group's first exchange: (round, status) of each, status 0 failed, 1 completed, 2 fresh."""
    group = FakeGroup(0, [0, 1, 2], {}, fail=1 if ok else 0, rows=rows)  # (ok: its confirm fails)
    rounds, _ = _membership(group)
    rounds.commands.append(_lost(2, 5))
    assert rounds.settle(4, ok, [0, 1, 2]) == decision
    assert group.members == [0, 1]


def test_a_round_that_failed_here_but_completed_elsewhere_is_an_error():
    group = FakeGroup(0, [0, 1, 2], {}, rows=[(4, 0), (5, 2)])
    rounds, _ = _membership(group)
    rounds.commands.append(_lost(2, 5))
    with pytest.raises(RuntimeError, match="the replicas disagree"):
        rounds.settle(4, False, [0, 1, 2])


def test_a_stage_that_learns_of_a_loss_between_rounds_starts_the_next_in_the_new_group():
    group = FakeGroup(1, [0, 1, 2], {}, rows=[(3, 2), (3, 2)])
    rounds, _ = _membership(group, me=1)
    rounds.commands.append(_lost(0, 3))
    rounds.before_round(2)  # the round before the loss: still with replica 0
    assert group.formed == []
    rounds.before_round(3)
    assert group.formed == [((1, 2), "lost0@3")]


def _config(**placement):
    return RunConfig(fault=FaultConfig(fault_tolerance="replicas"), placement=PlacementConfig(**placement))


def test_what_replicas_mode_does_not_support_is_refused_by_name():
    from pipeq import compat

    with pytest.raises(ValueError, match=r"fault_tolerance must be None .* or 'replicas', got 'all'"):
        FaultConfig(fault_tolerance="all")
    with pytest.raises(ValueError, match=r"with data_parallel=1 \(this run: data_parallel=1\): the other replicas carry on"):
        pipeq.PipelineRunner(mlp_stages((4, 8, 2)), nn.CrossEntropyLoss(), SGD, "1f1b", 2, fault_tolerance="replicas")
    with pytest.raises(ValueError, match="with mode='simulated'"):
        _config(data_parallel=2, mode="simulated")
    with pytest.raises(ValueError, match="with sharding='fsdp': every replica holds the only copy"):
        _config(data_parallel=2, sharding="fsdp")
    with pytest.raises(ValueError, match="in a multi-host run"):
        compat.check(_config(data_parallel=2), multi_host=True)
    with pytest.raises(ValueError, match="carries work across batches"):
        RunConfig(schedule=schedules.AsyncOneFOneB(), fault=FaultConfig(fault_tolerance="replicas"),
                  placement=PlacementConfig(data_parallel=2))
    _config(data_parallel=2, tensor_parallel=2)  # what it supports: tensor parallelism, HSDP, V schedules
    _config(data_parallel=4, sharding="hsdp", shard_size=2)
    RunConfig(schedule=schedules.resolve("interleaved-1f1b"), fault=FaultConfig(fault_tolerance="replicas"),
              placement=PlacementConfig(data_parallel=2))


def test_the_record_names_each_stage_that_left_a_lost_replica_out_even_when_its_loss_counted():
    """Replica 1 is lost at gradient round 5 (the step outstanding) after its last stage sent the
    step's loss (the driver counts it: no finished() row), while its stage 0 died before sending
    rounds 4 and 5. Replica 0's stage 0 ACKs having summed neither with it, stages 1 and 2 both:
    the record says step 4 and step 5 were degraded at stage 0 (step 5 was once missed)."""
    from pipeq.control.degraded import DegradedSteps
    from pipeq.control.replica_loss import ReplicaLoss, _Parting

    from pipeq.control.processes import Numbering

    loss = ReplicaLoss(types.SimpleNamespace(n_stages=3, replicas=2, numbering=Numbering(3, 2)), lambda: True,
                       lambda: (5, 5), lambda: 1)
    record = DegradedSteps(2, 3, loss.rounds)
    for rnd in range(1, 6):
        record.sent(rnd, 10 + rnd)  # round k is the driver's step 10 + k
    part = _Parting(5, 1, 0.0, {0}, acked={0: set(), 1: {4, 5}, 2: {4, 5}}, last_round=5)
    loss._note_rounds(1, part)
    assert record.stages() == {14: {0: [0]}, 15: {0: [0]}}
    assert record.counts() == {14: 1, 15: 1}
