"""Checkpoints of the research schedules: an interlocking run's auxiliary heads (with their
optimizer state, under ``aux_heads.{k}.*``) and an Associated Learning run's four parts and two
optimizers per layer. A run saved mid-way and resumed in fresh processes equals the uninterrupted
run exactly: losses, parameters, heads, optimizer and scheduler state."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pipeq
from pipeq import checkpoint
from pipeq import schedules
from pipeq.research.al.executor import build_al_lstm

pytestmark = pytest.mark.timeout(120)

FAST = dict(start_method="forkserver")
ADAM = functools.partial(torch.optim.Adam, lr=1e-2)
STEP_LR = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5)
# its milestones are a Counter of ints, keys the wire refuses: they travel as items
MULTISTEP = functools.partial(torch.optim.lr_scheduler.MultiStepLR, milestones=[2, 3], gamma=0.1)


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


def stages(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(0.3)),
            nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU()), nn.Linear(8, 4)]


def heads(seed: int = 1) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Dropout(0.2), nn.Linear(8, 4)), nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 4))]


def batches(steps: int, size: int = 12, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 6, generator=g), torch.randint(0, 4, (size,), generator=g)) for _ in range(steps)]


def interlocking(schedule, mode: str, seed: int = 0):
    # in process mode (the snapshots cross the wire) a MultiStepLR, StepLR otherwise
    scheduler = MULTISTEP if mode == "process" else STEP_LR
    return lambda: pipeq.PipelineRunner(stages(seed), nn.CrossEntropyLoss(), ADAM, schedule, 3, mode=mode,
                                        aux_heads=heads(seed + 1), lr_scheduler=scheduler, **FAST)


@pytest.mark.parametrize("schedule,mode", [("pairwise", "process"), (schedules.Interlock("nwise", distance=2),
                                                                       "simulated"), ("local", "simulated")])
def test_an_interlocking_run_with_heads_resumes_exactly(schedule, mode, tmp_path):
    """Dropout (the RNG), BatchNorm (buffers) in stages and heads, Adam, a StepLR or MultiStepLR
    (resumed between its milestones: the lr it reaches must be the uninterrupted run's): all of it
    resumes."""
    resumed_equals_uninterrupted(interlocking(schedule, mode), batches(4), tmp_path)


# -- Associated Learning ----------------------------------------------------------------------------
VOCAB, CLASSES = 13, 3


def tokens(steps: int, size: int = 8, seed: int = 4):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(1, VOCAB, (size, 6), generator=g)
        x[:, 4:][torch.rand(size, 2, generator=g) < 0.5] = 0
        x[:, 5][x[:, 4] == 0] = 0  # padding at the end only
        out.append((x, torch.randint(0, CLASSES, (size,), generator=g)))
    return out


def al_layers(seed: int = 0):
    torch.manual_seed(seed)
    return build_al_lstm(VOCAB, CLASSES, embed_dim=5, hidden=4, lstm_layers=2, label_width=3)


def al_run(mode: str):
    return lambda: pipeq.PipelineRunner(al_layers(), None, ADAM, schedules.AssociatedLearning(), 2, mode=mode,
                                        lr_scheduler=STEP_LR, **FAST)


@pytest.mark.parametrize("mode", ["process", "simulated"])
def test_an_al_run_resumes_exactly(mode, tmp_path):
    """f, b, g, h of every layer, both optimizers (f+b, g+h) and both schedulers per layer."""
    resumed_equals_uninterrupted(al_run(mode), tokens(4), tmp_path)
    ck = checkpoint.load(str(tmp_path / "straight"))
    assert {k.split(".")[1] for k in ck.optim} == {"f", "b", "g", "h"}
    assert all(ck.optim[k]["state"] for k in ck.optim), "every parameter has Adam state"
    assert all(len(s["pipeq_schedulers"]) == 2 for s in ck.sched)
