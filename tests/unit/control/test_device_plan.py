"""Where each stage process runs (pipeq.control.processes.plan_devices, worker_configs), on a
machine with G GPUs as ``torch.cuda`` says (its answers replaced here: no GPU needed).

With tensor parallelism a stage's T shards must run on T different GPUs (NCCL refuses two ranks
of a group on one device): by default shard s of the host's j-th stage on cuda:((j*T + s) mod G),
with ``devices=`` shard s of a stage given cuda:d on cuda:((d + s) mod G). Without tensor
parallelism stage j is on cuda:(j mod G), as before.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipeq.control.config import PlacementConfig, RunConfig
from pipeq.control.processes import Numbering, RunSetup, plan_devices, worker_configs
from pipeq.stage.numerics import Numerics
from pipeq.wire.sockets import BindTo


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)``: torch.cuda says this machine has n GPUs (0: no CUDA)."""
    def have(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return have


def placed(n_stages: int, shards: int = 1, replicas: int = 1, devices=None, processes=None) -> dict:
    """{(replica, stage): [shard 0's device, shard 1's...]} of worker_configs' plan for the run's
    processes on one host (or ``processes``, a node's)."""
    num = Numbering(n_stages, replicas, shards)
    config = RunConfig(placement=PlacementConfig(devices=devices, tensor_parallel=shards, data_parallel=replicas))
    setup = RunSetup(config, Numerics(), [{}] * n_stages if shards > 1 else None)
    configs = worker_configs(processes if processes is not None else range(num.total), n_stages, replicas,
                             setup, control_addr="ipc:///nowhere", bind=BindTo.ipc("/nowhere"),
                             seed_of=lambda g: g, die_with_parent=False, tp_dir="/nowhere")
    out: dict = {}
    for cfg in sorted(configs, key=lambda c: (c.replica, c.chunks[0].stage, c.shard)):
        out.setdefault((cfg.replica, cfg.chunks[0].stage), []).append(cfg.device)
    return out


def test_without_tensor_parallelism_the_default_is_cuda_round_robin(gpus) -> None:
    gpus(2)
    assert placed(3) == {(0, 0): ["cuda:0"], (0, 1): ["cuda:1"], (0, 2): ["cuda:0"]}
    assert placed(2, replicas=2) == {(0, 0): ["cuda:0"], (0, 1): ["cuda:1"],
                                     (1, 0): ["cuda:0"], (1, 1): ["cuda:1"]}


def test_without_cuda_every_shard_runs_on_the_cpu(gpus) -> None:
    gpus(0)
    assert placed(2, shards=2) == {(0, 0): ["cpu", "cpu"], (0, 1): ["cpu", "cpu"]}


def test_two_stages_of_two_shards_on_two_gpus_take_both_for_each_stage(gpus) -> None:
    """The case the shards of one stage used to share a GPU in (process g on cuda:(g mod G),
    shard 1 of stage k being process N + k)."""
    gpus(2)
    assert placed(2, shards=2) == {(0, 0): ["cuda:0", "cuda:1"], (0, 1): ["cuda:0", "cuda:1"]}


def test_by_default_each_stage_takes_consecutive_gpus(gpus) -> None:
    gpus(4)
    assert placed(2, shards=2) == {(0, 0): ["cuda:0", "cuda:1"], (0, 1): ["cuda:2", "cuda:3"]}
    assert placed(3, shards=2) == {(0, 0): ["cuda:0", "cuda:1"], (0, 1): ["cuda:2", "cuda:3"],
                                   (0, 2): ["cuda:0", "cuda:1"]}  # wrapping around
    assert placed(1, shards=4) == {(0, 0): ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]}
    # replicas: the host's stages in order, replica 0's first
    assert placed(2, shards=2, replicas=2) == {(0, 0): ["cuda:0", "cuda:1"], (0, 1): ["cuda:2", "cuda:3"],
                                               (1, 0): ["cuda:0", "cuda:1"], (1, 1): ["cuda:2", "cuda:3"]}


def test_a_node_places_its_own_stages_from_its_first_gpu(gpus) -> None:
    """A node of a multi-host run starts only its stages (their leads and shards): stage 1's
    shards (processes 1 and 3 of 2 stages x 2 shards) are that host's first stage."""
    gpus(2)
    assert placed(2, shards=2, processes=[1, 3]) == {(0, 1): ["cuda:0", "cuda:1"]}


def test_devices_given_are_shard_0s_and_the_other_shards_take_the_next_gpus(gpus) -> None:
    gpus(4)
    assert placed(2, shards=2, devices=["cuda:0", "cuda:2"]) == {(0, 0): ["cuda:0", "cuda:1"],
                                                                (0, 1): ["cuda:2", "cuda:3"]}
    assert placed(2, shards=2, devices=["cuda:3", "cuda:3"]) == {(0, 0): ["cuda:3", "cuda:0"],
                                                                (0, 1): ["cuda:3", "cuda:0"]}  # wrapping around
    # an unindexed "cuda" counts as cuda:0 (shard 0 keeps it as given); a CPU stage stays on the CPU
    assert placed(2, shards=2, devices=["cuda", "cpu"]) == {(0, 0): ["cuda", "cuda:1"], (0, 1): ["cpu", "cpu"]}
    # without tensor parallelism, exactly as given
    assert placed(2, devices=["cuda:3", "cuda:3"]) == {(0, 0): ["cuda:3"], (0, 1): ["cuda:3"]}


@pytest.mark.parametrize("count, shards, devices", [
    (1, 2, None),  # one GPU: both shards of the stage on cuda:0
    (2, 3, None),
    (2, 3, ["cuda:0", "cuda:1"]),
    (1, 2, ["cuda", "cuda"]),
])
def test_a_stage_whose_shards_would_share_a_gpu_is_refused_before_it_starts(gpus, count, shards, devices) -> None:
    gpus(count)
    with pytest.raises(ValueError, match=rf"stage 0, shard 0 and stage 0, shard \d would both run on cuda:\d, .* "
                                         rf"{count} GPU.*NCCL refuses two ranks"):
        placed(2, shards=shards, devices=devices)


def test_the_plan_is_the_same_every_time(gpus) -> None:
    gpus(4)
    assert placed(3, shards=2, replicas=2) == placed(3, shards=2, replicas=2)


def test_under_torchrun_a_node_places_its_shards_within_its_share_of_the_gpus(gpus) -> None:
    """LOCAL_RANK 1 of 2 on a host with 4 GPUs: its share is cuda:2 and cuda:3."""
    gpus(4)
    rz = SimpleNamespace(local_rank=1, local_world_size=2)
    plan = plan_devices(2, None, rz, places=[(0, 0), (0, 1)], shards=2)
    assert [dev for dev, _, _ in plan] == ["cuda:2", "cuda:3"]
    plan = plan_devices(1, None, rz)  # one stage, no shards: the share's first GPU, as before
    assert [dev for dev, _, _ in plan] == ["cuda:2"]
