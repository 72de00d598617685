"""Every setting is checked when its configuration is made: a bad value raises a ValueError there,
naming the setting, both for a :class:`pipeq.RunConfig` (``RunConfig.from_kwargs``) and for a
:class:`pipeq.PipelineRunner` given it by keyword, before any process could start.

``BAD`` holds wrong values for every setting the runner takes (values of the wrong type, out of
range, or not among the choices); a setting added without entries here fails the first test."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeq
from pipeq.control.config import RunConfig, setting_fields

NAN = float("nan")

#: setting -> values each refused when the configuration is made
BAD: dict[str, list] = {
    "schedule": ["no-such-schedule", 3],
    "microbatches": [0, -1, 2.5, "8"],
    "precision": ["fp99", None, 16],
    "clip_grad_norm": [-1, 0, NAN, float("inf"), "1.0"],
    "clip_norm_type": [0, -2, NAN, "2"],
    "check_finite": ["x", 2, None],
    "recompute": ["x", [], [1, 0], 3],
    "loss_weighting": ["tokens", None],
    "compile": ["yes", {"backend": 3}, {"no_such_option": 1}],
    "transport": ["udp", None],
    "host": ["", "  ", 127, None],
    "tcp_security": ["none", None],
    "max_message_mb": [0, -1, 1.5, "64"],
    "shm_slots": [-1, 65, 2.0],
    "queue_capacity": [0, -5, 1.5, "64"],
    "spin": [-0.01, NAN, 5, "0.01"],
    "trusted_network": ["yes", 1, None],
    "heartbeat_interval": [0, -1, NAN, "1", None],
    "heartbeat_timeout": [0, -1, NAN, "15", None],
    "step_timeout": [0, -1, NAN, "300"],
    "start_timeout": [0, -1, NAN, "120", None],
    "stop_timeout": [0, -1, NAN, "60", None],
    "fault_tolerance": ["stages", True],
    "mode": ["threads", None],
    "devices": ["cpu", 3, ["tpu:0"], ["not a device"]],
    "threads_per_stage": [0, -1, 1.5],
    "start_method": ["fork", None],
    "placement": ["0,1", [0, 1], [[0, "1"]], [[-1]]],
    "data_parallel": [0, -2, 1.5],
    "tensor_parallel": [0, -2, 1.5],
    "tp_plan": ["colwise", {"0": "colwise"}, [3]],
    "stages_per_process": [0, -1, 1.5],
    "sharding": ["zero3", None],
    "shard_size": [2],  # without sharding="hsdp"
    "fsdp_reshard": ["never", None],
    "trace": [3, ["a.json"]],
    "auto_memory_limit": [-1, "lots", "150%", 0],
}


def _cases():
    return [pytest.param(name, value, id=f"{name}={value!r}") for name, values in BAD.items() for value in values]


def test_every_setting_has_bad_values_to_try():
    names = {f.name for f in setting_fields()} | {"schedule", "microbatches"}
    assert sorted(names - set(BAD)) == [], "add bad values for each new setting to BAD"
    assert sorted(set(BAD) - names) == []


@pytest.mark.parametrize("name,value", _cases())
def test_a_run_config_refuses_a_bad_value_naming_the_setting(name, value):
    with pytest.raises(ValueError) as info:
        RunConfig.from_kwargs(**{name: value})
    assert name in str(info.value), str(info.value)


def _stages() -> list[nn.Module]:
    return [nn.Linear(4, 4), nn.Linear(4, 2)]


@pytest.mark.parametrize("name,value", _cases())
def test_a_runner_refuses_a_bad_value_when_made_naming_the_setting(name, value):
    kw = {name: value} if name != "microbatches" else {}
    args = (value,) if name == "microbatches" else ()
    with pytest.raises(ValueError) as info:
        pipeq.PipelineRunner(_stages(), nn.CrossEntropyLoss(), torch.optim.SGD, *(("1f1b",) if args else ()), *args,
                             **kw)
    assert name in str(info.value), str(info.value)
