"""Sharded replicas (``sharding="fsdp"``, pipeq.parallel.fsdp) refused where they cannot run, before any process starts, each refusal naming the setting and why; the job keys that set them."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pipeq
from pipeq.control.config import RunConfig

from tie_cases import SGD, lm_stages

MOMENTUM = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def make(stages=None, schedule="1f1b", **kw):
    """Only construct the runner: it starts no process until start() / with."""
    stages = [nn.Linear(4, 4), nn.Linear(4, 2)] if stages is None else stages
    settings = {"data_parallel": 2, "sharding": "fsdp", **kw}
    return pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), MOMENTUM, schedule, 4, **settings)


def test_the_defaults_are_whole_replicas_kept_gathered_through_a_step():
    place = RunConfig().placement
    assert (place.sharding, place.fsdp_reshard) == ("none", "step")
    runner = make(fsdp_reshard="microbatch")  # a sharded run is built (no process yet)
    assert runner.config.placement.sharding == "fsdp"


@pytest.mark.parametrize("settings, match", [
    (dict(sharding="zero3"), r"sharding must be 'none' .*, 'fsdp' .* or 'hsdp' .*got 'zero3'"),
    (dict(fsdp_reshard="forward"), r"fsdp_reshard must be 'step' .* or 'microbatch'.*got 'forward'"),
    (dict(data_parallel=1), r"sharding='fsdp' .* needs data_parallel >= 2, got data_parallel=1"),
    (dict(mode="simulated"), r"data_parallel > 1 with mode='simulated' \(this run: data_parallel=2\).*use mode='process'"),
    (dict(fault_tolerance="replicas"), r"fault_tolerance='replicas' with sharding='fsdp': every replica holds the only "
                                       r"copy.*use sharding='hsdp'"),
    (dict(sharding="hsdp"), r"sharding='hsdp' needs shard_size.*data_parallel=2 from 2 to 1 \(none here"),
    (dict(data_parallel=6, sharding="hsdp", shard_size=4), r"one of \[2, 3\]\), got shard_size=4"),
    (dict(shard_size=2), r"shard_size=2 is for sharding='hsdp'.*this run's sharding is 'fsdp'"),
])
def test_what_does_not_compose_is_refused_naming_the_setting(settings, match):
    with pytest.raises(ValueError, match=match):
        make(**settings)


def test_what_composes_is_taken():
    """Tensor parallelism (a 2-D shard x tp mesh), compile, tied weights and HSDP with fault
    tolerance: built (no process yet)."""
    make(tensor_parallel=2, tp_plan=[{}, {}])
    make(compile=True)
    make(data_parallel=4, sharding="hsdp", shard_size=2, fault_tolerance="replicas")
    pipeq.PipelineRunner(lm_stages(shared=False), nn.CrossEntropyLoss(), SGD, "1f1b", 2, data_parallel=2,
                         sharding="fsdp", ties=[["0.weight", "3.weight"]])


@pytest.mark.parametrize("schedule", ["async", "pairwise"])
def test_schedules_that_compute_their_own_way_are_refused(schedule):
    kw = {}
    if schedule == "pairwise":
        kw = dict(aux_heads=[nn.Linear(4, 2)])
    with pytest.raises(ValueError, match=rf"schedule '{schedule}'"):
        make(schedule=schedule, **kw)


@pytest.mark.parametrize("schedule", ["fill-drain", "1f1b", "zb-h1", "zb-h2", "zbv", "dualpipev", "interleaved-1f1b"])
def test_every_synchronous_schedule_is_taken(schedule):
    stages = [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)]
    make(stages, schedule=schedule, **({"stages_per_process": 2} if schedule == "interleaved-1f1b" else {}))


def test_the_job_keys_set_them(tmp_path):
    from pipeq.launch.job import load_job

    path = tmp_path / "job.toml"
    path.write_text('stages = "m:stages"\nloss = "m:loss"\noptimizer = "m:opt"\ndata = "m:data"\n'
                    'steps = 2\ndata_parallel = 2\nsharding = "fsdp"\nfsdp_reshard = "microbatch"\n')
    place = load_job(str(path), {}).run_config().placement
    assert (place.data_parallel, place.sharding, place.fsdp_reshard) == (2, "fsdp", "microbatch")


def test_two_replicas_of_a_cuda_stage_on_one_gpu_are_refused():
    """NCCL refuses two ranks of one group on one GPU: refused before any process starts (the
    sharding replicas of one slice; two slices' replicas never meet in one NCCL group)."""
    from pipeq.control.processes import Numbering, _check_mesh_apart

    num = Numbering(2, 2)  # processes 0, 1: replica 0's stages; 2, 3: replica 1's
    one_slice = lambda g: 0  # noqa: E731  (sharding="fsdp": both replicas in slice 0)
    _check_mesh_apart(num, [0, 1, 2, 3], [("cuda:0", [], 1), ("cuda:1", [], 1), ("cuda:1", [], 1),
                                          ("cuda:0", [], 1)], one_slice)
    _check_mesh_apart(num, [0, 1, 2, 3], [("cpu", [], 1)] * 4, one_slice)
    same = [("cuda:0", [], 1), ("cuda:1", [], 1), ("cuda:0", [], 1), ("cuda:1", [], 1)]
    _check_mesh_apart(num, [0, 1, 2, 3], same, lambda g: num.replica(g))  # sharding="none": two slices
    with pytest.raises(ValueError, match="replica 0, stage 0 and replica 1, stage 0 would both run on cuda:0.*NCCL "
                                         "refuses"):
        _check_mesh_apart(num, [0, 1, 2, 3], same, one_slice)
