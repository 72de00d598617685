"""The job files of the research schedules launch and learn: examples/digits_pairwise.toml,
digits_nwise.toml, digits_async.toml and digits_al.toml, each through ``pipeq launch`` (its
command-line entry point, in this process: the stages fork from the test session's fork server,
a driver interpreter and a fork server less to start per launch), cut short with ``--steps``;
and each file's schedule options reach the runner (a misspelled or impossible one is refused,
exit code 2, before any stage process starts).
"""

from __future__ import annotations

import os

import pytest
import torch

from launch_util import ROOT, launch_here, metrics, model_state
from pipeq import checkpoint
from pipeq.research.al.executor import ALModel
from pipeq.launch.job import load_job, resolve
from pipeq.schedules import AssociatedLearning, AsyncOneFOneB, Interlock

EXAMPLES = os.path.join(ROOT, "examples")
JOBS = ("pairwise", "nwise", "async", "al", "resnet")
# What each file's schedule is (its options as the runner gets them), and its stage count.
SCHEDULES = {
    "pairwise": ("pairwise", 3),
    "nwise": (Interlock("nwise", distance=2), 4),
    "async": (AsyncOneFOneB(warmup=3, weight_stashing=True), 3),
    "al": (AssociatedLearning(first_loss="ce", inference_layer=2), 3),
    "resnet": ("pairwise", 4),
}
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
    job's seed), as the flat model whose names model.pt uses; AL layers as pipeq.al.ALModel, their
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


@pytest.mark.parametrize("name", JOBS)
def test_job_file_schedule_and_options(name: str) -> None:
    job = load(name)
    schedule, n_stages = SCHEDULES[name]
    assert job.schedule == schedule
    assert job.recipe.count_stages() == n_stages
    heads = job.recipe.heads(n_stages)
    if name in ("pairwise", "nwise", "resnet"):  # one auxiliary head per stage but the last
        assert heads is not None and len(heads) == n_stages - 1
    else:
        assert heads is None


# A copy of a job file with one schedule option changed -> what the refusal says: reading the file
# (an unknown option, a value the schedule refuses), or in the runner, where the option meets the
# job's stages (async warmup 1 would deadlock 3 stages; AL has no layer 3 of 3); all before any
# stage process starts.
REFUSED = {
    "pairwise": [('schedule = "pairwise"', 'schedule = { name = "pairwise", distance = 1 }',
                  "schedule 'pairwise': unknown option(s) ['distance']; it takes none")],
    "nwise": [("distance = 2", "distnce = 2", "schedule 'nwise': unknown option(s) ['distnce']; did you mean "
               "'distance'?"),
              ("distance = 2", "distance = 0", "Interlock('nwise') needs distance=d, an integer >= 1, got 0")],
    "async": [("weight_stashing = true", "weight_stash = true",
               "schedule 'async': unknown option(s) ['weight_stash']; did you mean 'weight_stashing'?"),
              ("warmup = 3", "warmup = 1", "AsyncOneFOneB(warmup=1) with 3 stages would deadlock")],
    "resnet": [('schedule = "pairwise"', 'schedule = "pairwize"', "did you mean 'pairwise'?")],
    "al": [("inference_layer = 2", "inference_layers = 2",
            "schedule 'al': unknown option(s) ['inference_layers']; did you mean 'inference_layer'?"),
           ("inference_layer = 2", "inference_layer = 3", "AssociatedLearning(inference_layer=3)")],
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name,case", [(name, i) for name in JOBS for i in range(len(REFUSED[name]))])
def test_wrong_schedule_option_in_a_copied_job_file_is_refused(name: str, case: int, tmp_path) -> None:
    old, new, expected = REFUSED[name][case]
    lines = open(job_path(name)).read().splitlines(keepends=True)
    at = [i for i, line in enumerate(lines) if line.startswith("schedule =")]
    assert len(at) == 1 and old in lines[at[0]], (name, old)
    lines[at[0]] = lines[at[0]].replace(old, new)
    job = tmp_path / f"digits_{name}.toml"
    job.write_text("".join(lines))
    out = tmp_path / "out"  # (from the repository root: the job's modules are examples.digits_job)
    refused = launch_here("--out", str(out), job=str(job))
    assert refused.returncode == 2
    assert expected in refused.stderr, refused.stderr
    assert not os.path.exists(out / "metrics.jsonl") and not os.path.exists(out / "model.pt")


def launch_in(name: str, out: str, steps: int, *more: str) -> None:
    r = launch_here("--steps", str(steps), "--checkpoint-every", "3", "--eval-every", "3", "--out", out, *more,
                    job=job_path(name))
    assert r.returncode == 0, r.stderr


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
