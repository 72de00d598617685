"""pipeq.runtime.simulated.SimulatedBackend used directly (no PipelineRunner in between): every stage in
this process, one interpreter per stage, messages in a dictionary."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import pipeq
from models import float64_data, float64_stages3, FailingStepSGD, Raises, reference_train
from pipeq.control.batching import split_sizes
from pipeq.stage.spec import StageSpec
from pipeq.runtime.simulated import SimulatedBackend
from pipeq.stage.loss import microbatch_weights

pytestmark = pytest.mark.timeout(60)

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
TOL = dict(atol=1e-12, rtol=0)


def backend(stages, schedule="1f1b", loss_fn=None, opt=SGD, **spec_kw):
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    n = len(stages)
    specs = [StageSpec(m, opt, loss_fn if k == n - 1 else None, **spec_kw) for k, m in enumerate(stages)]
    return SimulatedBackend(specs, schedule)


def shards(loss_fn, y, m):
    sizes = split_sizes(y.shape[0], m)
    return [(sizes, microbatch_weights(loss_fn, y, sizes), None)]


def train(be, step, x, y, m=4, loss_fn=None):
    return be.train(step, shards(loss_fn or nn.CrossEntropyLoss(), y, m), x, y)


def flat_state(be) -> list[torch.Tensor]:
    return [t for _, tensors in be.get_state() for t in tensors]


def predict(be, x, m=4) -> torch.Tensor:
    return torch.cat([out for (out,) in be.predict(0, split_sizes(x.shape[0], m), x)])


@pytest.mark.parametrize("schedule", ["fill-drain", "1f1b"])
def test_equals_single_process_training_with_uneven_microbatches(schedule):
    assert split_sizes(10, 4) == [3, 3, 2, 2]
    stages = float64_stages3()
    model = nn.Sequential(*copy.deepcopy(stages))
    opt = SGD(model.parameters())
    be = backend(stages, schedule)
    for step, seed in enumerate((1, 2, 3)):
        x, y = float64_data(10, seed)
        loss = train(be, step, x, y, m=4)
        _, (ref,) = reference_train([], nn.functional.cross_entropy, SGD, [(x, y)], model=model, opt=opt)
        assert loss == pytest.approx(ref, abs=1e-12)
    ref_state = model.state_dict()
    got = flat_state(be)
    assert [n for names, _ in be.get_state() for n in names] == ["0.weight", "0.bias"] * 2 + ["weight", "bias"]
    assert len(got) == len(ref_state)
    for (name, ref), v in zip(ref_state.items(), got):
        torch.testing.assert_close(v, ref, **TOL, msg=name)
    x, _ = float64_data(10, 9)
    with torch.no_grad():
        torch.testing.assert_close(predict(be, x), model(x), **TOL)


def test_trains_private_copies_of_the_callers_modules():
    stages = float64_stages3()
    before = [copy.deepcopy(m.state_dict()) for m in stages]
    be = backend(stages)
    for ex, m in zip(be.executors, stages):
        assert ex.module is not m
        assert not {id(p) for p in ex.module.parameters()} & {id(p) for p in m.parameters()}
    x, y = float64_data(10)
    train(be, 0, x, y)
    train(be, 1, x, y)
    for k, m in enumerate(stages):
        for name, v in m.state_dict().items():
            assert torch.equal(v, before[k][name]), f"stage {k} {name} changed"
        assert all(p.grad is None for p in m.parameters())
    # ... while the backend's copies did train
    assert not torch.equal(flat_state(be)[0], before[0]["0.weight"])


def test_messages_are_copies_an_inplace_op_downstream_leaves_the_sender_untouched():
    """Stage 1 starts with ReLU(inplace=True) on the activation it received: the output stage 0
    kept (seen by a forward hook: the very tensor it stashed and sent) keeps its negative values,
    in training and in predict, and training still equals one process."""
    torch.manual_seed(0)
    first = nn.Linear(6, 10).double()
    second = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(10, 4).double())
    kept: list[torch.Tensor] = []
    first.register_forward_hook(lambda mod, args, out: kept.append(out))
    stages = [first, second]
    model = nn.Sequential(*copy.deepcopy(stages))
    w0 = copy.deepcopy(first)
    be = backend(stages)
    x, y = float64_data(10)
    sizes = split_sizes(10, 4)
    for training in (True, False):
        kept.clear()
        if training:
            loss = train(be, 0, x, y)
        else:
            predict(be, x)
        assert len(kept) == len(sizes)
        with torch.no_grad():
            # the weights stage 0 ran with: the initial ones, then the trained ones
            w = w0 if training else be.executors[0].module
            expected = nn.functional.linear(x, w.weight, w.bias).split(sizes)  # (no hook)
        for j, out in enumerate(kept):
            assert (out < 0).any()
            torch.testing.assert_close(out.detach(), expected[j], **TOL, msg=f"microbatch {j}")
    opt = SGD(model.parameters())
    ref = nn.functional.cross_entropy(model(x), y)
    ref.backward()
    opt.step()
    assert loss == pytest.approx(ref.item(), abs=1e-12)
    for (name, r), v in zip(model.state_dict().items(), flat_state(be)):
        torch.testing.assert_close(v, r, **TOL, msg=name)


@pytest.mark.parametrize("schedule", ["fill-drain", "1f1b"])
def test_stage_that_raises_in_forward_is_named(schedule):
    torch.manual_seed(0)
    stages = [nn.Linear(6, 6).double(), Raises(6).double(), nn.Linear(6, 4).double()]
    be = backend(stages, schedule)
    x, y = float64_data(10)
    with pytest.raises(pipeq.PipelineError) as info:
        train(be, 0, x, y)
    err = info.value
    assert err.stage == 1
    assert "boom from the stage" in err.message and "forward of microbatch 0" in err.message
    assert str(err).startswith("stage 1: forward of microbatch 0 (step 0)")
    assert "boom from the stage" in str(err)
    assert "ValueError: boom from the stage" in err.remote_traceback  # the stage's own traceback


def test_stage_that_raises_in_its_optimizer_step_is_named():
    # the step of stage 0 comes last (1F1B): every other stage has finished when it fails
    torch.manual_seed(0)
    stages = [nn.Linear(8, 5).double(), nn.Linear(5, 5).double(), nn.Linear(5, 4).double()]
    be = backend(stages, opt=functools.partial(FailingStepSGD, lr=0.1))
    x, y = float64_data(10, d_in=8)
    with pytest.raises(pipeq.PipelineError, match="optimizer step failed on purpose") as info:
        train(be, 0, x, y)
    assert info.value.stage == 0


def test_get_state_returns_copies_and_set_state_round_trips():
    x, y = float64_data(10)
    be = backend(float64_stages3())
    train(be, 0, x, y)
    state = be.get_state()
    kept = [[t.clone() for t in tensors] for _, tensors in state]
    out = predict(be, x)
    for _, tensors in state:  # the caller scribbles over what it got
        for t in tensors:
            t.zero_()
    for (_, now), before in zip(be.get_state(), kept):
        for t, b in zip(now, before):
            assert torch.equal(t, b)
    torch.testing.assert_close(predict(be, x), out, atol=0, rtol=0)

    # into another backend (other initial weights): same state, same outputs
    fresh = backend(float64_stages3(seed=5))
    assert not torch.equal(predict(fresh, x), out)
    given = [(names, [t.clone() for t in tensors]) for (names, _), tensors in zip(be.get_state(), kept)]
    fresh.set_state(given)
    for (names_a, a), (names_b, b) in zip(fresh.get_state(), be.get_state()):
        assert names_a == names_b
        for ta, tb in zip(a, b):
            assert torch.equal(ta, tb)
    torch.testing.assert_close(predict(fresh, x), out, atol=0, rtol=0)
    for _, tensors in given:  # set_state copied too: the model does not follow the caller's tensors
        for t in tensors:
            t.zero_()
    torch.testing.assert_close(predict(fresh, x), out, atol=0, rtol=0)


def test_snapshots_restore_continue_training_exactly():
    """Three steps == one step, snapshot, then a fresh backend restores the snapshot and does
    the other two (while the first backend trained on, which must not reach the snapshot):
    weights, Adam's moments, StepLR's count and the dropout RNG all come back."""

    def make_stages(seed):
        torch.manual_seed(seed)
        return [nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Dropout(0.3)).double(),
                nn.Sequential(nn.Linear(10, 10), nn.Tanh()).double(),
                nn.Linear(10, 4).double()]

    # step_size=2: the lr halves after the 2nd step, so a lost scheduler count shows in step 3
    kw = dict(opt=functools.partial(torch.optim.Adam, lr=0.01),
              lr_scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5))
    batches = [float64_data(10, seed) for seed in (1, 2, 3)]
    torch.manual_seed(42)
    a = backend(make_stages(0), **kw)
    train(a, 0, *batches[0])
    snaps = a.get_snapshots()
    losses_a = [train(a, step, *batches[step]) for step in (1, 2)]
    expected = flat_state(a)
    assert [ex.stepper.optimizer.param_groups[0]["lr"] for ex in a.executors] == [0.005] * 3

    b = backend(make_stages(7), **kw)  # other weights, and a history of its own (moments,
    for step in (0, 1):  # scheduler count, RNG draws) that restore must replace
        train(b, step, *batches[2])
    torch.manual_seed(1234)
    b.restore(snaps)
    losses_b = [train(b, step, *batches[step]) for step in (1, 2)]
    assert losses_b == losses_a
    for k, (ta, tb) in enumerate(zip(expected, flat_state(b))):
        assert torch.equal(ta, tb), f"tensor {k}"
    assert [ex.stepper.optimizer.param_groups[0]["lr"] for ex in b.executors] == [0.005] * 3
