"""Tensor parallelism settings checked before any process starts: plans, sizes, styles, schedules and modes refused with what to change; errors without shards; the shards' group on loopback."""

from __future__ import annotations

import functools
import os
import re
import socket

import pytest
import torch
from torch import nn

import pipeq
from pipeq.errors import PipelineError
from models import TP_PLAN, UpDown, tp_stages

pytestmark = pytest.mark.timeout(300)

FAST = dict(start_method="forkserver")  # stages fork from a preloaded server: ~0.1 s each
MOMENTUM = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
CLASSES = 4


# -- 4. what is refused, before any process starts -------------------------------------------------------------
def make(stages=None, plan=TP_PLAN, schedule="1f1b", **kw):
    """Only construct the runner: it starts no process until start() / with."""
    return pipeq.PipelineRunner(tp_stages() if stages is None else stages, nn.CrossEntropyLoss(), MOMENTUM,
                                schedule, 2, tp_plan=plan, **{"tensor_parallel": 2, **FAST, **kw})


def test_a_plan_naming_a_missing_submodule_is_refused():
    with pytest.raises(ValueError) as info:
        make(plan=[TP_PLAN[0], {"0": "colwise", "nosuchlayer": "rowwise"}])
    assert "stage 1" in str(info.value) and "nosuchlayer" in str(info.value), str(info.value)


@pytest.mark.parametrize("name, style", [("up", "colwise"), ("down", "rowwise")])
def test_a_size_that_does_not_divide_is_refused(name, style):
    """Stage 1 is UpDown(8, 10, 4): up's 10 outputs (colwise) and down's 10 inputs (rowwise)
    split over 2 shards but not over 4."""
    def stages():
        return [nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), UpDown(8, 10, CLASSES)]

    plan = [TP_PLAN[0], {name: style}]
    make(stages(), plan, tensor_parallel=2)  # fine at T = 2 (not started)
    with pytest.raises(ValueError) as info:
        make(stages(), plan, tensor_parallel=4)
    msg = str(info.value)
    assert "stage 1" in msg and name in msg and "10" in msg, msg


def test_an_unknown_style_is_refused():
    with pytest.raises(ValueError, match="diagonal"):
        make(plan=[{"0": "diagonal", "2": "rowwise"}, TP_PLAN[1]])


@pytest.mark.parametrize("n_plans", [1, 3])
def test_a_plan_list_of_the_wrong_length_is_refused(n_plans):
    with pytest.raises(ValueError, match="plan"):
        make(plan=(TP_PLAN * 2)[:n_plans])


@pytest.mark.parametrize("bad", [0, -1, "2", 2.0, True])
def test_tensor_parallel_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="tensor_parallel"):
        make(tensor_parallel=bad)


@pytest.mark.parametrize("t", [None, 1])
def test_a_plan_without_tensor_parallel_is_refused(t):
    kw = {} if t is None else {"tensor_parallel": t}
    with pytest.raises(ValueError, match="tp_plan|tensor_parallel"):
        pipeq.PipelineRunner(tp_stages(), nn.CrossEntropyLoss(), MOMENTUM, "1f1b", 2, tp_plan=TP_PLAN, **kw, **FAST)


def test_simulated_mode_is_refused():
    with pytest.raises(ValueError, match="simulated|process"):
        make(mode="simulated", start_method="spawn")


def test_fill_drain_gpipe_and_1f1b_are_accepted():
    for schedule in ("fill-drain", "gpipe", "1f1b"):
        make(schedule=schedule)  # not started


@pytest.mark.parametrize("schedule", ["async", "al", "pairwise", "global", "local"])
def test_other_schedules_are_refused(schedule):
    """Each runner is fine without tensor parallelism (so the refusal is tensor parallelism's)."""
    kw: dict = {}
    if schedule == "al":
        from pipeq.research import build_al

        torch.manual_seed(0)
        stages = build_al([nn.Linear(8, 8), nn.Linear(8, 8)], [8, 8], CLASSES)
    else:
        stages = tp_stages()
    if schedule in ("pairwise", "local"):
        kw["aux_heads"] = [nn.Linear(8, CLASSES)]
    pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), MOMENTUM, schedule, 2, **kw, **FAST)
    with pytest.raises(ValueError, match=rf"\b{schedule}\b") as info:
        make(stages, [{}, {}], schedule, **kw)
    assert re.search("tensor.parallel", str(info.value)), str(info.value)


def test_pipeline_error_has_no_shard_without_tensor_parallelism():
    err = PipelineError("it broke", stage=1)
    assert err.shard is None
    assert str(err) == "stage 1: it broke"


# -- 7. the shards' own sockets: loopback only, and a stranger's bytes change nothing ------------------
def test_the_shards_group_listens_on_loopback_whatever_the_environment(monkeypatch, tmp_path):
    """gloo, which DTensor computes with, has no authentication: a stage's mesh listens on
    loopback only, even when the user's environment names another interface for gloo (here:
    a one-process group in this process, made as a stage's mesh makes its groups, whose new
    listening sockets are looked at)."""
    import datetime

    import torch.distributed as dist

    from attacker import listening_addresses
    from pipeq.parallel import mesh

    from pipeq.wire.netif import interface_address

    def routable(name: str) -> bool:
        try:
            return not (interface_address(name) or "127.").startswith("127.")
        except ValueError:  # no IPv4 address
            return False

    # an interface of this machine with an address that is not loopback (else the check is moot)
    ifaces = [name for _, name in socket.if_nameindex() if routable(name)]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", ifaces[0] if ifaces else "lo")
    before = set(listening_addresses([os.getpid()]))
    plan = mesh.MeshPlan(1, 1, 1, 0, 0, "p0", ("file", str(tmp_path / "store")))
    mesh._bind_gloo(plan, torch.device("cpu"))
    group = dist.ProcessGroupGloo(mesh.open_store(plan.store), 0, 1, datetime.timedelta(seconds=30))
    new = set(listening_addresses([os.getpid()])) - before
    del group
    assert new and {addr for addr, _ in new} == {"127.0.0.1"}, new
