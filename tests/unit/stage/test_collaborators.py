"""A stage's collaborators on their own: the Stepper (optimizers, schedulers, loss scaling, the
replicas' sync), the StateIO (snapshots and their restore) and the Backprop (B, or I then W)."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from torch import nn

from pipeq.stage.backprop import Backprop
from pipeq.stage.numerics import Numerics, StepStats
from pipeq.stage.spec import StageSpec
from pipeq.stage.state import StateIO
from pipeq.stage.step import Stepper

CPU = torch.device("cpu")


def _spec(module: nn.Module, lr: float = 0.1, halve_every: int | None = None) -> StageSpec:
    sched = (lambda opt: torch.optim.lr_scheduler.StepLR(opt, halve_every, gamma=0.5)) if halve_every else None
    return StageSpec(module, functools.partial(torch.optim.SGD, lr=lr, momentum=0.9), lr_scheduler=sched)


def _two_paths(halve_every: int | None = 1) -> tuple[nn.ModuleDict, Stepper]:
    """A stage trained by two optimizers, as AL's is: ``a``'s first, then ``b``'s."""
    torch.manual_seed(0)
    module = nn.ModuleDict({"a": nn.Linear(3, 2), "b": nn.Linear(2, 2)})
    spec = _spec(module, halve_every=halve_every)
    stepper = Stepper(0, module, CPU, spec, list(module["a"].parameters()))
    stepper.add(spec, list(module["b"].parameters()))
    return module, stepper


def _grads(module: nn.Module, value: float = 1.0) -> None:
    for p in module.parameters():
        p.grad = torch.full_like(p, value)


def test_two_optimizers_step_in_order_each_with_its_scheduler_and_the_first_is_what_replicas_sync():
    module, stepper = _two_paths()
    want = copy.deepcopy(module)
    opts = [torch.optim.SGD(want[k].parameters(), lr=0.1, momentum=0.9) for k in ("a", "b")]
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in opts]
    for _ in range(3):
        stepper.begin(True, 1)
        _grads(module)
        stepper.step()
        for o, s in zip(opts, scheds):
            o.zero_grad(set_to_none=True)
        _grads(want)
        for o, s in zip(opts, scheds):
            o.step()
            s.step()
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), want.parameters()))
    assert stepper.learning_rates() == [0.0125] * 2 and stepper.learning_rate() == 0.0125
    assert stepper.optimizers()[0] is stepper.optimizer and len(stepper.schedulers()) == 2
    assert [id(p) for p in stepper.params()] == [id(p) for p in module["a"].parameters()]


def test_begin_clears_every_gradient_and_the_replicas_sync_starts_after_the_last_backward_once():
    module, stepper = _two_paths(None)
    calls = []

    class Sync:  # the stage's parallel layers, as the stepper sees them
        def arm(self):
            calls.append("arm")

        def start(self):
            calls.append("start")

        def finish(self):
            calls.append("finish")

        def weighted(self, grads):
            return None

        def combine(self, mine, norm_type):
            return mine

    stepper.parallel = Sync()
    _grads(module)
    stepper.begin(True, 2)
    assert all(p.grad is None for p in module.parameters())
    stepper.before_backward()
    stepper.backward_done()
    assert calls == []
    stepper.before_backward()  # the last backward: its buckets are armed
    stepper.backward_done()
    stepper.sync_replicas()
    stepper.stats()  # synced already: not again
    assert calls == ["arm", "start", "finish"]
    stepper.begin(False, 1)  # an evaluation step clears nothing, but counts afresh
    stepper.backward_done()
    stepper.sync_replicas()
    assert calls == ["arm", "start", "finish", "start", "finish"]


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # as a torch loop's skip does
def test_a_step_the_stages_agree_to_skip_steps_no_optimizer_but_every_scheduler():
    module, stepper = _two_paths()
    stepper.set_numerics(Numerics(check_finite="skip"))
    before = [p.detach().clone() for p in module.parameters()]
    stepper.begin(True, 1)
    _grads(module, math.nan)
    own = stepper.stats()
    assert own.first_bad == 0.0
    stepper.apply(StepStats(0.0, 2.0), step=7)  # another stage's gradient was bad: skip here too
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), before))
    assert stepper.skipped_steps == 1 and stepper.learning_rates() == [0.05, 0.05]


def test_a_non_finite_gradient_under_check_finite_raise_names_the_parameter_and_the_step():
    module, stepper = _two_paths(None)
    stepper.set_numerics(Numerics(check_finite="raise"))
    stepper.begin(True, 1)
    _grads(module)
    module["a"].bias.grad[0] = math.inf
    with pytest.raises(FloatingPointError, match=r"stage 0: the gradient of a\.bias .*step 3"):
        stepper.apply(stepper.stats(), step=3)
    stepper.apply(StepStats(0.0, 1.0), step=3)  # stage 1 reports its own: this one neither steps nor raises


def test_a_snapshot_restores_the_module_every_optimizer_and_scheduler_and_the_loss_scale():
    module, stepper = _two_paths()
    stepper.set_numerics(Numerics(precision="fp16"))
    state = StateIO(0, module, CPU, stepper)
    stepper.begin(True, 1)
    _grads(module)
    stepper.step()
    stepper.scaler.update(True)  # an overflow: the scale halves
    snap = copy.deepcopy(state.snapshot())
    want = copy.deepcopy(module.state_dict())
    for _ in range(2):  # moved on: weights, momenta, lr and scale all change
        _grads(module)
        stepper.step()
        stepper.scaler.update(True)
    state.restore(snap)
    assert all(torch.equal(module.state_dict()[k], want[k]) for k in want)
    assert float(stepper.scaler.scale) == 2.0 ** 15 and stepper.learning_rates() == [0.05, 0.05]
    assert copy.deepcopy(state.snapshot()).keys() == snap.keys()
    names, tensors = state.tensors()
    state.load(names, [torch.zeros_like(t) for t in tensors])
    assert all(not p.detach().any() for p in module.parameters())


def test_backprop_I_then_W_is_B_bitwise_and_W_before_I_is_refused():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    b = copy.deepcopy(a)
    x, g = torch.randn(2, 4), (torch.randn(2, 3),)
    whole, split = Backprop(1, 3, a, CPU), Backprop(1, 3, b, CPU)
    for bp in (whole, split):
        bp.begin(5)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = whole.whole(0, (xa,), (a(xa),), g)
    with pytest.raises(ValueError, match=r"stage 1, step 5: action W0 before I0"):
        split.weight_grad(0)
    got = split.input_grad(0, (xb,), (b(xb),), g)
    assert all(p.grad is None for p in b.parameters()) and list(split.pending) == [0]
    split.weight_grad(0)
    assert torch.equal(got[0], want[0]) and not split.pending
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))
    with pytest.raises(ValueError, match=r"stage 1: no gradient for microbatch 1 \(step 5\)"):
        whole.whole(1, (xa,), (a(xa),), None)
