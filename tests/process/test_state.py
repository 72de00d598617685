"""PipelineRunner.save / load (checkpoints through the stage processes) and lr schedulers."""

from __future__ import annotations

import functools
import sys

import pytest
import torch
from torch import nn

import pipeq
from launch_util import ROOT
from models import Chain, flat_state, reference_train

sys.path.insert(0, ROOT)
from examples.digits_job import stages as _stages  # noqa: E402
from examples.digits_job import two_stages as digits_two_stages  # noqa: E402


def digits_stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return _stages()

pytestmark = pytest.mark.timeout(180)

MODES = ["process", "simulated"]
FAST = {"start_method": "forkserver"}  # these tests are about state, not process start-up


def _batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("mode", MODES)
def test_a_checkpoint_continues_exactly_and_loads_into_another_split(mode: str, tmp_path) -> None:
    """3 steps, save (with the caller's meta): a new 3-stage runner loads it and does 3 more ==
    6 uninterrupted steps (Adam + StepLR: weights, optimizer and scheduler state); and a 2-stage
    runner of the same layers loads it and predicts what the 3 stages did."""
    adam = functools.partial(torch.optim.Adam, lr=1e-2)
    sched = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5)
    batches = _batches(6)
    x = torch.randn(20, 64)
    kw = dict(microbatches=4, mode=mode, lr_scheduler=sched, **FAST)
    with pipeq.PipelineRunner(digits_stages(), nn.CrossEntropyLoss(), adam, **kw) as full:
        for xb, yb in batches:
            full.step(xb, yb)
        want = full.state_dict()
    with pipeq.PipelineRunner(digits_stages(), nn.CrossEntropyLoss(), adam, **kw) as first:
        for xb, yb in batches[:3]:
            first.step(xb, yb)
        first.save(str(tmp_path / "ckpt"), {"note": "three"})
        expected = first.predict(x)
    torch.manual_seed(7)  # other initial weights: the load must replace all of them
    with pipeq.PipelineRunner(digits_stages(), nn.CrossEntropyLoss(), adam, **kw) as second:
        second.load(str(tmp_path / "ckpt"))
        for xb, yb in batches[3:]:
            second.step(xb, yb)
        got = second.state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    torch.manual_seed(123)
    with pipeq.PipelineRunner(digits_two_stages(), nn.CrossEntropyLoss(), adam, **kw) as r2:
        assert not torch.allclose(r2.predict(x), expected)
        meta = r2.load(str(tmp_path / "ckpt"))
        assert meta == {"note": "three"}
        assert torch.allclose(r2.predict(x), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_lr_scheduler_steps_once_per_step_like_one_process(mode: str) -> None:
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    sched = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)
    batches = _batches(4, seed=3)
    stages = digits_stages()
    ref = Chain(*[s for s in __import__("copy").deepcopy(stages)])
    opt = sgd(ref.parameters())
    lr = sched(opt)
    reference_train([], nn.CrossEntropyLoss(), sgd, batches, model=ref, opt=opt, after_step=lambda _: lr.step())
    with pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), sgd, microbatches=4, mode=mode,
                              lr_scheduler=sched, **FAST) as runner:
        for xb, yb in batches:
            runner.step(xb, yb)
        got = runner.state_dict()
    want = flat_state(ref)
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-6), k
    # and without the scheduler the result differs (the test can fail)
    plain, _ = reference_train(stages, nn.CrossEntropyLoss(), sgd, batches)
    assert not torch.allclose(plain[-1][0].weight, want["4.weight"])


def wide_digits_stages(hidden: int = 96) -> list[nn.Module]:
    """The digits stages' names with another hidden width: a checkpoint of these does not fit."""
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(64, hidden), nn.ReLU()), nn.Sequential(nn.Linear(hidden, 64), nn.ReLU()),
            nn.Sequential(nn.Linear(64, 10))]


@pytest.mark.parametrize("mode", MODES)
def test_load_of_a_checkpoint_with_other_shapes_is_refused_and_the_runner_lives_on(mode: str, tmp_path) -> None:
    """Names that fit but shapes (or dtypes) that do not, names that do not, a folder that is no
    checkpoint: refused before any stage changes (a process-mode stage used to fail loading it and
    take the whole pipeline down)."""
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    with pipeq.PipelineRunner(wide_digits_stages(), nn.CrossEntropyLoss(), sgd, mode="simulated") as r:
        r.save(str(tmp_path / "wide"))
    with pipeq.PipelineRunner([s.double() for s in digits_stages()], nn.CrossEntropyLoss(), sgd,
                              mode="simulated") as r:
        r.save(str(tmp_path / "double"))
    with pipeq.PipelineRunner([nn.Sequential(nn.Linear(64, 128), nn.ReLU()), nn.Linear(128, 10)],
                              nn.CrossEntropyLoss(), sgd, mode="simulated") as r:
        r.save(str(tmp_path / "other"))
    (x, y), (x2, y2) = _batches(2)
    with pipeq.PipelineRunner(digits_stages(), nn.CrossEntropyLoss(), sgd, microbatches=4, mode=mode, **FAST) as r:
        r.step(x, y)
        r.save(str(tmp_path / "good"))
        before = r.state_dict()
        with pytest.raises(ValueError) as err:
            r.load(str(tmp_path / "wide"))
        text = str(err.value)
        assert "0.weight has shape (96, 64) in the checkpoint, stage 0 expects (128, 64)" in text, text
        assert "2.weight has shape (64, 96) in the checkpoint, stage 1 expects (64, 128)" in text, text
        with pytest.raises(ValueError, match="0.weight is float64 in the checkpoint, stage 0 holds float32"):
            r.load(str(tmp_path / "double"))
        with pytest.raises(ValueError, match="missing|unexpected"):  # other names
            r.load(str(tmp_path / "other"))
        with pytest.raises(ValueError, match="no manifest.json"):  # not a checkpoint
            r.load(str(tmp_path))
        after = r.state_dict()
        assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
        # the runner lives on, and trains exactly as if nothing had been tried
        loss = r.step(x2, y2)
        got = r.state_dict()
    with pipeq.PipelineRunner(digits_stages(), nn.CrossEntropyLoss(), sgd, microbatches=4, mode="simulated") as ref:
        ref.load(str(tmp_path / "good"))
        assert ref.step(x2, y2) == pytest.approx(loss, abs=1e-6)
        want = ref.state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=0, msg=k)


def test_one_naming_state_dict_checkpoint_files_and_the_flat_model(tmp_path) -> None:
    """runner.state_dict(), load_state_dict(), a checkpoint's files and the flat model
    nn.Sequential(*layers) all name the digits model's weights 0.weight, 2.weight, 4.weight."""
    import os

    from pipeq import checkpoint

    names = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    stages = digits_stages()
    initial = flat_state(stages)
    (x, y), = _batches(1)
    with pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), sgd, microbatches=4, mode="process", **FAST) as r:
        r.step(x, y)
        state = r.state_dict()
        assert list(state) == names == list(initial)
        r.save(str(tmp_path / "ckpt"))
        assert list(checkpoint.load(str(tmp_path / "ckpt")).model) == names
        on_disk = [torch.load(str(tmp_path / "ckpt" / f), weights_only=True)["model"]
                   for f in sorted(os.listdir(tmp_path / "ckpt")) if f.endswith(".pt")]
        assert [k for part in on_disk for k in part] == names
        assert all(torch.equal(part[k], state[k]) for part in on_disk for k in part)
        # the user's own flat model takes the state as it is, and computes what the runner does
        mine = checkpoint.flat_model(digits_stages())
        mine.load_state_dict(state)
        with torch.no_grad():
            torch.testing.assert_close(r.predict(x), mine(x), atol=1e-6, rtol=0)
        # load_state_dict(state_dict()) round-trips ...
        r.load_state_dict(initial)
        assert all(torch.equal(r.state_dict()[k], initial[k]) for k in names)
        r.load_state_dict(state)
        assert all(torch.equal(r.state_dict()[k], state[k]) for k in names)
        # ... and stage-prefixed keys (nn.Sequential(*stages), earlier pipeq versions) still load
        r.load_state_dict(nn.Sequential(*stages).state_dict())
        assert all(torch.equal(r.state_dict()[k], initial[k]) for k in names)


def test_lr_scheduler_must_be_a_factory() -> None:
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="lr_scheduler must be a factory"):
        pipeq.PipelineRunner(digits_stages(), nn.CrossEntropyLoss(), sgd, lr_scheduler=3)


def test_frozen_parameters_save_and_load(tmp_path) -> None:
    """A stage whose parameters are partly frozen (not in its optimizer) still round-trips."""
    def stages() -> list[nn.Module]:
        s = digits_stages()
        s[0][0].weight.requires_grad_(False)
        return s

    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    x, y = _batches(1)[0]
    with pipeq.PipelineRunner(stages(), nn.CrossEntropyLoss(), sgd, mode="process", **FAST) as r:
        r.step(x, y)
        r.save(str(tmp_path / "ckpt"))
        r.step(x, y)
        want = r.state_dict()
    with pipeq.PipelineRunner(stages(), nn.CrossEntropyLoss(), sgd, mode="process", **FAST) as r:
        r.load(str(tmp_path / "ckpt"))
        r.step(x, y)
        got = r.state_dict()
    assert torch.equal(got["0.weight"], stages()[0][0].weight)  # frozen: never trained
    for k in want:
        assert torch.equal(got[k], want[k]), k
