"""Job files name every schedule with its options: the schedule table, the command line's schedule, the keys a schedule needs or refuses, the recipe's heads and AL losses (no launch starts)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from launch_util import ROOT
from pipeq.research import ALLayer
from pipeq.launch.cli import main as pipeq_main
from pipeq.launch.job import load_job
from pipeq.control.processes import job_identity
from pipeq.schedules import AssociatedLearning, AsyncOneFOneB, Interlock
from job_files import MLP_MOMENTUM


MLP = MLP_MOMENTUM  # (tests/support/job_files.py)
AL = """\
stages = "launch_jobs:al_layers"
optimizer = "torch.optim:Adam"
optimizer_args = { lr = 0.01 }
data = "launch_jobs:train_batches"
eval_data = "launch_jobs:heldout"
microbatches = 4
"""


def write_job(directory, text: str, name: str = "job") -> str:
    path = os.path.join(str(directory), f"{name}.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


# -- schedule tables ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("table", "expected"), [
    ('"pairwise"', "pairwise"),
    ('{ name = "nwise", distance = 2 }', Interlock("nwise", distance=2)),
    ('{ name = "async", warmup = 3, weight_stashing = false }', AsyncOneFOneB(warmup=3, weight_stashing=False)),
    ('{ name = "al", first_loss = "mse", inference_layer = 1 }',
     AssociatedLearning(first_loss="mse", inference_layer=1)),
    ('{ name = "gpipe" }', "gpipe"),
])
def test_schedule_table_is_parsed_into_the_schedule(tmp_path, table: str, expected) -> None:
    body = AL if '"al"' in table else MLP
    job = load_job(write_job(tmp_path, body + f"schedule = {table}\nsteps = 1\n"))
    assert job.schedule == expected


def test_command_line_schedule_replaces_the_table(tmp_path) -> None:
    path = write_job(tmp_path, MLP + 'schedule = { name = "async", warmup = 3 }\nsteps = 1\n')
    assert load_job(path, {"schedule": "fill-drain"}).schedule == "fill-drain"


@pytest.mark.parametrize(("table", "message"), [
    ('{ name = "async", warmup = 3, stash = true }',
     "schedule 'async': unknown option(s) ['stash']; allowed: ['warmup', 'weight_stashing']"),
    ('{ name = "1f1b", distance = 2 }', "schedule '1f1b': unknown option(s) ['distance']; it takes none"),
    ('"zero-bubble"', "schedule: unknown name 'zero-bubble'; choose one of 1f1b, al, async,"),
    ('{ warmup = 3 }', "schedule: a table without a name"),
    ('"nwise"', 'schedule "nwise" needs its distance: schedule = { name = "nwise", distance = 2 }'),
    ('{ name = "async", warmup = 0 }', "AsyncOneFOneB(warmup=...) must be a positive integer"),
    ('{ name = "al", first_loss = "l1" }', "must be 'ce' or 'mse'"),
])
def test_bad_schedule_table_is_refused(tmp_path, capsys, table: str, message: str) -> None:
    path = write_job(tmp_path, MLP + f"schedule = {table}\nsteps = 1\n")
    assert pipeq_main(["launch", path]) == 2
    err = capsys.readouterr().err
    assert message in err and path in err, err


def test_job_keys_the_schedule_needs_or_refuses(tmp_path, capsys) -> None:
    no_loss = write_job(tmp_path, MLP.replace('loss = "torch.nn:CrossEntropyLoss"\n', "") + "steps = 1\n", "a")
    heads_1f1b = write_job(tmp_path, MLP + 'aux_heads = "launch_jobs:heads"\nsteps = 1\n', "b")
    for path, message in ((no_loss, "missing required key(s) ['loss']"),
                          (heads_1f1b, "aux_heads trains with the interlocking schedules")):
        assert pipeq_main(["launch", path]) == 2
        assert message in capsys.readouterr().err
    assert load_job(write_job(tmp_path, AL + 'schedule = "al"\nsteps = 1\n', "c")).recipe.loss is None


# -- what a recipe builds, and what two nodes compare ------------------------------------------------

def test_recipe_builds_heads_and_al_losses(tmp_path) -> None:
    pairwise = load_job(write_job(tmp_path, MLP + 'schedule = "pairwise"\naux_heads = "launch_jobs:heads"\n'
                                  'aux_loss = "torch.nn:MultiMarginLoss"\nsteps = 1\n', "p")).recipe
    specs = [pairwise.build(k, 3) for k in range(3)]
    assert [s.aux_head is not None for s in specs] == [True, True, False]
    assert all(isinstance(s.aux_loss, nn.MultiMarginLoss) for s in specs)
    assert [s.loss_fn is not None for s in specs] == [False, False, True]
    # every host builds the same stages and heads (seeded), leaving the caller's RNG alone
    rng = torch.get_rng_state()
    again = pairwise.build(0, 3)
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(again.aux_head.weight, specs[0].aux_head.weight)
    assert torch.equal(again.module[0].weight, specs[0].module[0].weight)
    al = load_job(write_job(tmp_path, AL + 'schedule = "al"\nloss = "torch.nn:SmoothL1Loss"\nsteps = 1\n',
                            "al")).recipe
    for k in range(3):  # every AL layer gets the local criterion
        spec = al.build(k, 3)
        assert isinstance(spec.module, ALLayer) and isinstance(spec.loss_fn, nn.SmoothL1Loss)


def test_nodes_compare_schedule_options() -> None:
    stash, no_stash = AsyncOneFOneB(weight_stashing=True), AsyncOneFOneB(weight_stashing=False)
    assert job_identity(b"", stash) != job_identity(b"", no_stash)
    assert job_identity(b"", "async") == job_identity(b"", stash)
    assert job_identity(b"", Interlock("nwise", distance=2))["schedule_options"] == {"distance": 2}
    plain = job_identity(b"", "1f1b")
    assert {k: plain[k] for k in ("schedule", "schedule_options", "recipe")} == {
        "schedule": "1f1b", "schedule_options": {}, "recipe": {}}
    assert plain["numerics"]["precision"] == "fp32" and plain["numerics"]["clip_grad_norm"] is None


def test_pairwise_example_job_names_its_heads() -> None:
    job = load_job(os.path.join(ROOT, "examples", "digits_pairwise.toml"))
    assert job.schedule == "pairwise"
    assert [h.in_features for h in job.recipe.heads(job.recipe.count_stages())] == [128, 64]
