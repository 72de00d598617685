"""A schedule defined outside pipeq plugs in through the schedule policy protocol alone: its plan
and its own executor run in both modes, equal to single-process training, and the core asks the
schedule what it needs instead of knowing it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeq
from pipeq import schedules
from pipeq.schedules import SchedulePolicy
from models import float64_stages3
from plugin_cases import JOB, SGD, check_trains_like_one_process
from plugin_schedule import ReverseDrain

def test_a_users_schedule_and_executor_train_like_one_process():
    check_trains_like_one_process("simulated")


def test_a_registered_plugin_is_usable_by_name():
    schedules.register("reverse-drain", ReverseDrain())
    try:
        assert "reverse-drain" in pipeq.SCHEDULES
        assert schedules.resolve("reverse-drain") == ReverseDrain()
        table = pipeq.format_table("reverse-drain", 2, 2)
        assert table.splitlines()[1].split("|")[1].split() == ["F0", "F1", ".", ".", "B1", "B0", "ST"]
    finally:
        del pipeq.SCHEDULES["reverse-drain"]


def test_the_core_asks_the_schedule_not_its_class():
    """A plug-in's answers reach the runner: here, the stages that take the target and the
    refusal of structured inputs by a schedule that does not run plain backprop."""

    class FirstStageLoss(ReverseDrain):
        plain_backprop = False

        def loss_stages(self, n_stages):
            return [0]

    runner = pipeq.PipelineRunner(float64_stages3(), nn.CrossEntropyLoss(), SGD, FirstStageLoss(), 2,
                                  mode="simulated")
    assert runner.schedule.loss_stages(3) == [0]
    with runner, pytest.raises(ValueError, match="takes x as one tensor"):
        runner.step((torch.zeros(4, 6, dtype=torch.float64),), torch.zeros(4, dtype=torch.long))


def test_a_schedule_without_a_plan_is_refused_naming_it():
    class NoPlan(SchedulePolicy):
        name = "no-plan"

    with pytest.raises(NotImplementedError, match="NoPlan must define plan"):
        pipeq.PipelineRunner(float64_stages3(), nn.CrossEntropyLoss(), SGD, NoPlan(), 2, mode="simulated")


def test_a_config_object_is_the_keywords_front_end():
    from pipeq.control.config import FaultConfig, PlacementConfig, RunConfig

    cfg = RunConfig(ReverseDrain(), 4, placement=PlacementConfig(mode="simulated"),
                    fault=FaultConfig(heartbeat_timeout=30.0))
    runner = pipeq.PipelineRunner(float64_stages3(), nn.CrossEntropyLoss(), SGD, config=cfg)
    assert runner.config is cfg and runner.microbatches == 4 and runner.mode == "simulated"
    assert pipeq.PipelineRunner(float64_stages3(), nn.CrossEntropyLoss(), SGD, "1f1b", 4, mode="simulated",
                                heartbeat_timeout=30.0).config.fault == cfg.fault
    with pytest.raises(ValueError, match="not both"):
        pipeq.PipelineRunner(float64_stages3(), nn.CrossEntropyLoss(), SGD, config=cfg, mode="simulated")
    with pytest.raises(ValueError, match="heartbeat_timeout must be longer"):
        FaultConfig(heartbeat_interval=2.0, heartbeat_timeout=1.0)




def test_a_job_files_own_schedule_is_checked_when_read(tmp_path):
    from pipeq.launch.job import load_job

    for spec, want in (('"plugin_schedule:Nope"', "module 'plugin_schedule' has no 'Nope'"),
                       ('"plugin_schedule:HalvedStepExecutor"', "not a pipeq.schedules.SchedulePolicy"),
                       ('{ name = "plugin_schedule:ReverseDrain", depth = 2 }', "ReverseDrain")):
        path = tmp_path / "job.toml"
        path.write_text(JOB.replace('"plugin_schedule:ReverseDrain"', spec))
        with pytest.raises(ValueError, match=want):
            load_job(str(path))
