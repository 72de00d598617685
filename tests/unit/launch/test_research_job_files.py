"""The research schedules' example job files as the launch reads them: their schedule and options, and a wrong option refused before anything starts."""

from __future__ import annotations

import os

import pytest

from launch_util import ROOT, launch_here
from pipeq.launch.job import load_job
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


def job_path(name: str) -> str:
    return os.path.join(EXAMPLES, f"digits_{name}.toml")


def load(name: str):
    """The example job as the launch reads it."""
    return load_job(job_path(name))


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
