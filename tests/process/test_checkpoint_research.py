"""Checkpoints of the research schedules: an interlocking run's auxiliary heads (with their
optimizer state, under ``aux_heads.{k}.*``) and an Associated Learning run's four parts and two
optimizers per layer. A run saved mid-way and resumed in fresh processes equals the uninterrupted
run exactly: losses, parameters, heads, optimizer and scheduler state."""

from __future__ import annotations

import pytest
import torch

from checkpoint_cases import al_run, batches, interlocking, tokens
from pipeq import checkpoint
from pipeq import schedules

pytestmark = pytest.mark.timeout(120)


def assert_same(got: dict, want: dict, what: str) -> None:
    """Every entry equal, bit for bit (tensors nested in dicts and lists too)."""
    assert list(got) == list(want), f"{what}: names differ"
    for k in want:
        a, b = got[k], want[k]
        if isinstance(b, torch.Tensor):
            assert torch.equal(a, b), f"{what}: {k} differs"
        elif isinstance(b, dict):
            assert_same(a, b, f"{what}[{k}]")
        elif isinstance(b, list):
            assert_same(dict(enumerate(a)), dict(enumerate(b)), f"{what}[{k}]")
        else:
            assert a == b, f"{what}: {k}: {a!r} != {b!r}"


def assert_same_checkpoints(a: str, b: str) -> None:
    x, y = checkpoint.load(a), checkpoint.load(b)
    for part in ("model", "optim", "aux_model", "aux_optim"):
        assert_same(getattr(x, part), getattr(y, part), part)
    assert_same(dict(enumerate(x.sched)), dict(enumerate(y.sched)), "sched")
    assert_same(dict(enumerate(x.rng)), dict(enumerate(y.rng)), "rng")


def resumed_equals_uninterrupted(make, data, tmp_path, split: int = 2) -> None:
    """Train on ``data`` in one run; and in two: save after ``split`` steps, load into fresh
    processes, train on. Losses after the split and the final checkpoints must be equal."""
    with make() as r:
        straight = [r.step(x, y) for x, y in data]
        r.save(str(tmp_path / "straight"))
    with make() as r:
        first = [r.step(x, y) for x, y in data[:split]]
        r.save(str(tmp_path / "half"))
    with make() as r:  # fresh processes, other initial weights would be overwritten
        r.load(str(tmp_path / "half"))
        rest = [r.step(x, y) for x, y in data[split:]]
        r.save(str(tmp_path / "resumed"))
    assert first + rest == straight
    assert_same_checkpoints(str(tmp_path / "resumed"), str(tmp_path / "straight"))


@pytest.mark.parametrize("schedule,mode", [("pairwise", "process"), (schedules.Interlock("nwise", distance=2),
                                                                       "simulated"), ("local", "simulated")])
def test_an_interlocking_run_with_heads_resumes_exactly(schedule, mode, tmp_path):
    """Dropout (the RNG), BatchNorm (buffers) in stages and heads, Adam, a StepLR or MultiStepLR
    (resumed between its milestones: the lr it reaches must be the uninterrupted run's): all of it
    resumes."""
    resumed_equals_uninterrupted(interlocking(schedule, mode), batches(4), tmp_path)


# -- Associated Learning ----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["process", "simulated"])
def test_an_al_run_resumes_exactly(mode, tmp_path):
    """f, b, g, h of every layer, both optimizers (f+b, g+h) and both schedulers per layer."""
    resumed_equals_uninterrupted(al_run(mode), tokens(4), tmp_path)
    ck = checkpoint.load(str(tmp_path / "straight"))
    assert {k.split(".")[1] for k in ck.optim} == {"f", "b", "g", "h"}
    assert all(ck.optim[k]["state"] for k in ck.optim), "every parameter has Adam state"
    assert all(len(s["pipeq_schedulers"]) == 2 for s in ck.sched)
