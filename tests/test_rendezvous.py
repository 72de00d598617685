"""Multi-host settings: flags over torchrun's and SLURM's environment, placement, bind address;
and job files (keys, types, overrides)."""

from __future__ import annotations

import os

import pytest

from launch_util import DIGITS_JOB
from pipeq import rendezvous as rdzv
from pipeq.job import load_job


def test_single_host_without_settings() -> None:
    assert rdzv.from_settings(env={}) is None
    assert rdzv.from_settings(env={"WORLD_SIZE": "1", "RANK": "0"}) is None


def test_torchrun_environment() -> None:
    env = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555",
           "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True",
           "TORCHELASTIC_RUN_ID": "job7"}
    rz = rdzv.from_settings(env=env)
    assert rz is not None
    assert (rz.nnodes, rz.node_rank, rz.master_addr, rz.master_port) == (2, 1, "127.0.0.1", 29555)
    assert rz.agent_store and rz.local_rank == 1 and rz.local_world_size == 2
    assert rz.run_id == "job7" and rz.bind == "127.0.0.1"


def test_slurm_environment_and_flags_win() -> None:
    env = {"SLURM_NTASKS": "3", "SLURM_PROCID": "2", "MASTER_ADDR": "127.0.0.1", "SLURM_JOB_ID": "99"}
    rz = rdzv.from_settings(env=env)
    assert rz is not None and (rz.nnodes, rz.node_rank, rz.master_port) == (3, 2, rdzv.DEFAULT_PORT)
    assert rz.run_id == "99" and not rz.agent_store
    rz = rdzv.from_settings(nnodes=2, node_rank=0, master_port=30000, env=env)
    assert rz is not None and (rz.nnodes, rz.node_rank, rz.master_port) == (2, 0, 30000)


@pytest.mark.parametrize(
    "kwargs, env, match",
    [
        ({"nnodes": 2}, {"MASTER_ADDR": "127.0.0.1"}, "needs this node's rank"),
        ({"nnodes": 2, "node_rank": 2}, {"MASTER_ADDR": "127.0.0.1"}, "outside 0..1"),
        ({"nnodes": 2, "node_rank": 0}, {}, "--master-addr"),
        ({"nnodes": 2, "node_rank": 0, "master_addr": "127.0.0.1", "master_port": 70000}, {}, "not a TCP port"),
        ({}, {"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
        ({"bind": "127.0.0.1"}, {}, "--bind only applies"),
        ({"nnodes": 2, "node_rank": 0, "master_addr": "127.0.0.1", "bind": "no-such-if0"}, {},
         "neither an address, an interface nor a host name"),
    ],
)
def test_bad_settings_say_what_to_do(kwargs, env, match) -> None:
    with pytest.raises(ValueError, match=match):
        rdzv.from_settings(env=env, **kwargs)


def test_bind_takes_an_address_or_an_interface() -> None:
    assert rdzv.resolve_bind("lo", "10.1.2.3", 1) == "127.0.0.1"
    assert rdzv.resolve_bind("127.0.0.1", "10.1.2.3", 1) == "127.0.0.1"
    assert rdzv.resolve_bind(None, "127.0.0.1", 29500) == "127.0.0.1"  # the route to the master


def test_placement() -> None:
    assert rdzv.placement(3, 2) == [[0], [1, 2]]
    assert rdzv.placement(4, 2) == [[0, 1], [2, 3]]
    assert rdzv.placement(3, 2, [[0, 1], [2]]) == [[0, 1], [2]]
    with pytest.raises(ValueError, match="some nodes would run nothing"):
        rdzv.placement(2, 3)
    with pytest.raises(ValueError, match="exactly once"):
        rdzv.placement(3, 2, [[0], [0, 2]])
    with pytest.raises(ValueError, match="lists 1 node"):
        rdzv.placement(3, 2, [[0, 1, 2]])


def test_job_file_overrides_and_recipe(tmp_path) -> None:
    job = load_job(DIGITS_JOB, {"steps": 5, "schedule": "fill-drain", "out": None})
    assert (job.steps, job.schedule, job.out, job.microbatches) == (5, "fill-drain", "runs/digits", 4)
    r = job.recipe
    assert r.count_stages() == 3
    spec = r.build(2, 3)
    assert spec.loss_fn is not None and r.build(0, 3).loss_fn is None
    o = spec.optimizer(spec.module.parameters())
    assert o.param_groups[0]["lr"] == 0.05 and o.param_groups[0]["momentum"] == 0.9
    assert spec.lr_scheduler(o).step_size == 60
    # every host builds the same weights
    a, b = r.build_stage(1, 3), r.build_stage(1, 3)
    assert all((p == q).all() for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "missing required key"),
        ('stages = 3', "stages must be a str"),
        ('stages = "a:b"\nloss = "c:d"\noptimizer = "e:f"\ndata = "g:h"', "set steps or epochs"),
        ('stages = "a:b"\nloss = "c:d"\noptimizer = "e:f"\ndata = "g:h"\nsteps = 0', "steps must be at least 1"),
        ('stages = "a:b"\nloss = "c:d"\noptimizer = "e:f"\ndata = "g:h"\nsteps = 2\nlr = 3', "unknown key"),
        ('stages = [', "job file"),
    ],
)
def test_bad_job_files(tmp_path, text, match) -> None:
    path = tmp_path / "job.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_job(str(path))


def test_unimportable_names_are_reported_with_their_key(tmp_path) -> None:
    path = tmp_path / "job.toml"
    path.write_text('stages = "no_such_module_xyz:stages"\nloss = "torch.nn:CrossEntropyLoss"\n'
                    'optimizer = "torch.optim:SGD"\ndata = "g:h"\nsteps = 1\n')
    with pytest.raises(ValueError, match="stages = 'no_such_module_xyz:stages': cannot import"):
        load_job(str(path)).recipe.count_stages()
    path.write_text(path.read_text().replace("no_such_module_xyz:stages", "os.path"))
    with pytest.raises(ValueError, match="expected 'package.module:name'"):
        load_job(str(path)).recipe.count_stages()
    assert os.path.exists(DIGITS_JOB)


@pytest.mark.parametrize(("schedule", "reason"), [
    ("al", "schedule 'al' trains pipeq.al.ALLayer stages"),
    ("pairwise", "schedule 'pairwise' trains with auxiliary heads: name them in the job"),
])
def test_job_recipes_refuse_schedules_their_stages_cannot_train(schedule, reason) -> None:
    """The digits recipe has plain stages and no heads (tests/test_launch_stream.py trains recipes
    with both)."""
    import pipeq

    recipe = load_job(DIGITS_JOB).recipe
    with pytest.raises(ValueError, match=reason):
        pipeq.PipelineRunner(recipe, None, None, schedule)
