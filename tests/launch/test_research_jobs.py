"""The job files of the research schedules launch and learn: examples/digits_pairwise.toml,
digits_nwise.toml, digits_async.toml and digits_al.toml, each through ``pipeq launch`` (its
command-line entry point, in this process: the stages fork from the test session's fork server,
a driver interpreter and a fork server less to start per launch), cut short with ``--steps``,
and resume to the uninterrupted state (each file's schedule options, and the refusal of a wrong
one, are checked without a launch in tests/unit/launch/test_research_job_files.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from launch_util import ROOT, launch_here, metrics, model_state
from pipeq import checkpoint
from pipeq.research import ALModel
from pipeq.launch.job import load_job, resolve
from pipeq.schedules import AssociatedLearning

EXAMPLES = os.path.join(ROOT, "examples")
JOBS = ("pairwise", "nwise", "async", "al", "resnet")
# How the launch's summary names the schedule: the object the runner was given, options included.
SUMMARY = {
    "pairwise": "3 stages, pairwise, 4 microbatches",
    "nwise": "4 stages, Interlock('nwise(d=2)'), 4 microbatches",
    "async": "3 stages, AsyncOneFOneB(warmup=3, weight_stashing=True), 4 microbatches",
    "al": "3 stages, AssociatedLearning(first_loss='ce', inference_layer=2), 4 microbatches",
    "resnet": "4 stages, pairwise, 4 microbatches",
}

# A bit over two epochs of the files' 6 (23 batches of 64 each). With the files' seed the runs
# repeat exactly; at step 50 their held-out accuracies (359 images, 10 classes: chance is 10%)
# were pairwise 88%, 3-wise 84%, async 1F1B 96% and AL 95%, all still climbing (the full runs:
# 97-98%). 60% is far above chance, and 24 points below the slowest of them: margin for other
# torch versions' numerics, not a bar a run that learns can miss.
STEPS = 50
MIN_ACCURACY = 0.6


def job_path(name: str) -> str:
    return os.path.join(EXAMPLES, f"digits_{name}.toml")


def load(name: str):
    """The example job as the launch reads it."""
    return load_job(job_path(name))


def initial_model(name: str) -> torch.nn.Module:
    """The job's model before training: its stages as every stage process builds them (under the
    job's seed), as the flat model whose names model.pt uses; AL layers as pipeq.research.ALModel, their
    inference path in one process, with the job's first_loss and inference_layer."""
    job = load(name)
    n = job.recipe.count_stages()
    stages = [job.recipe.build_stage(k, n) for k in range(n)]
    if isinstance(job.schedule, AssociatedLearning):
        return ALModel(stages, **job.schedule.options)
    return checkpoint.flat_model(stages)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", JOBS)
def test_job_file_learns(name: str, tmp_path) -> None:
    # from the repository root, as a user runs it; the file's own settings but its length (its
    # eval_every and checkpoint_every are 50: one evaluation and one checkpoint, at the last step)
    out = str(tmp_path / "out")
    printed = launch_here("--steps", str(STEPS), "--out", out, job=job_path(name))
    assert printed.returncode == 0, printed.stderr
    assert SUMMARY[name] in printed.stdout, printed.stdout  # the schedule, with its options, that trained
    lines = metrics(out)
    assert [ln["step"] for ln in lines] == list(range(1, STEPS + 1))
    accuracy = lines[-1]["eval_accuracy"]
    assert accuracy > MIN_ACCURACY, (name, accuracy)
    losses = [ln["loss"] for ln in lines]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    # the cross-entropy of interlocking and async 1F1B falls from ~2.3 to 0.1-0.55 (the mean of the
    # last 5 steps) in 50 steps; AL reports its last layer's associated loss (an MSE around 0.012
    # at first, which rises around steps 10-25 while the layers below settle, then falls to 0.006)
    assert last < (0.75 if name == "al" else 0.5) * first, (name, first, last)

    # model.pt: a plain state_dict (weights only) under the flat model's names, of the job's layers
    state = torch.load(os.path.join(out, "model.pt"), weights_only=True)
    model = initial_model(name)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in start.items()}
    # every stage learned (interlocking: stage 0 from a head's loss; AL: every part of every layer)
    unchanged = [k for k in start if torch.equal(state[k], start[k])]
    assert not unchanged, (name, unchanged)
    # and it scores what the run's evaluation said: the main path (interlocking: without the heads),
    # or AL's inference path with the file's options
    model.load_state_dict(model_state(out))
    x, y = resolve(load(name).eval_data, "eval_data")()  # (the job put the repository root on sys.path)
    with torch.no_grad():  # in eval mode, as predict runs it (the ResNet's BatchNorm)
        scored = float((model.eval()(x).argmax(1) == y).float().mean())
    assert scored == pytest.approx(accuracy, abs=1e-6)


def launch_in(name: str, out: str, steps: int, *more: str) -> None:
    r = launch_here("--steps", str(steps), "--checkpoint-every", "3", "--eval-every", "3", "--out", out, *more,
                    job=job_path(name))
    assert r.returncode == 0, r.stderr


@pytest.mark.timeout(120)
def test_an_async_launch_resumes_to_the_uninterrupted_state(tmp_path) -> None:
    """Asynchronous 1F1B carries work across batches and drains only where a consistent state is
    due (here every 6th step): twelve steps in one launch, and six then --resume to twelve, end
    bit for bit alike. (The memory figures a launch logs after its first step used to drain a
    resumed launch at its first step, mid-segment, and the weights differed by about 1e-3.)"""
    straight, halves = str(tmp_path / "straight"), str(tmp_path / "halves")
    for out, steps, more in ((straight, 12, ()), (halves, 6, ()), (halves, 12, ("--resume",))):
        r = launch_here("--steps", str(steps), "--checkpoint-every", "6", "--eval-every", "0", "--out", out, *more,
                        job=job_path("async"))
        assert r.returncode == 0, r.stderr
    want, got = model_state(straight), model_state(halves)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert [ln["loss"] for ln in metrics(halves)] == [ln["loss"] for ln in metrics(straight)]
    # each launch's memory figures: at its first drain (6, and the resumed one's at 12)
    assert [ln["step"] for ln in metrics(halves) if "memory" in ln] == [6, 12]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["nwise", "al"])
def test_job_file_resumes_to_the_uninterrupted_state(name: str, tmp_path) -> None:
    """Six steps in one launch; and three, then --resume to six: the same final checkpoint, bit for
    bit (the heads and their optimizer state; AL's four parts, two optimizers), and the same losses."""
    straight, halves = str(tmp_path / "straight"), str(tmp_path / "halves")
    launch_in(name, straight, 6)
    launch_in(name, halves, 3)
    launch_in(name, halves, 6, "--resume")
    want, got = (checkpoint.load(os.path.join(out, "final")) for out in (straight, halves))
    for part in ("model", "aux_model"):
        a, b = getattr(got, part), getattr(want, part)
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), part
    for part in ("optim", "aux_optim"):
        a, b = getattr(got, part), getattr(want, part)
        assert sorted(a) == sorted(b), part
        for k in a:
            for s in b[k]["state"]:
                assert torch.equal(torch.as_tensor(a[k]["state"][s]), torch.as_tensor(b[k]["state"][s])), (part, k, s)
    assert bool(want.aux_model) == (name == "nwise")
    assert [ln["loss"] for ln in metrics(halves)] == [ln["loss"] for ln in metrics(straight)]
    assert want.meta["schedule_options"] == load(name).schedule.options  # what the resume checks against
