"""PIPEQ_FAULT: what it accepts, and its refusals naming what is wrong."""

from __future__ import annotations

import pytest

from pipeq.runtime.faults import Fault, from_environ, parse


def test_a_fault_parses_and_hits_its_stage_step_and_replica():
    f = parse(" stage:2, step:40, kind:kill ")
    assert f == Fault(2, 40, "kill") and f.text() == "stage:2,step:40,kind:kill"
    assert f.hits(2, 40, replica=1) and not f.hits(2, 39) and not f.hits(1, 40)
    one = parse("kind:raise,step:3,stage:0,replica:1")
    assert one.hits(0, 3, replica=1) and not one.hits(0, 3, replica=0)
    assert from_environ(3, {}) is None and from_environ(3, {"PIPEQ_FAULT": "stage:2,step:1,kind:hang"}).kind == "hang"


@pytest.mark.parametrize("text,match", [
    ("stage:2,step:40", r"needs kind"),
    ("stage:2,step:40,kind:explode", r"kind is one of kill, exit, raise, hang, got 'explode'"),
    ("stage:x,step:1,kind:kill", r"stage must be a whole number >= 0, got 'x'"),
    ("stage:1,step:0,kind:kill", r"steps count from 1"),
    ("stage:1,step:1,kind:kill,when:now", r"'when:now' is not one of stage:..., step:..., kind:..., replica:..."),
    ("stage:1,stage:2,step:1,kind:kill", r"stage is given twice"),
])
def test_refusals_name_the_part_at_fault(text, match):
    with pytest.raises(ValueError, match=match):
        parse(text)


def test_a_stage_the_run_does_not_have_is_refused():
    with pytest.raises(ValueError, match=r"stage 5 does not exist \(the run has 3 stages\)"):
        from_environ(3, {"PIPEQ_FAULT": "stage:5,step:1,kind:kill"})


def test_a_fault_names_a_replica_the_run_has() -> None:
    env = {"PIPEQ_FAULT": "stage:1,step:3,kind:kill,replica:5"}
    with pytest.raises(ValueError, match=r"replica 5 does not exist \(the run has no replicas \(data_parallel = 1\)\)"):
        from_environ(3, env, replicas=1)
    with pytest.raises(ValueError, match=r"replica 5 does not exist \(the run has 2 replicas, 0 to 1\)"):
        from_environ(3, env, replicas=2)
    assert from_environ(3, env, replicas=6).replica == 5
    assert from_environ(environ={"PIPEQ_FAULT": "stage:9,step:1,kind:kill,replica:3"}).replica == 3  # the spelling only


@pytest.mark.parametrize("key", ["heartbeat_interval", "heartbeat_timeout", "start_timeout", "stop_timeout"])
def test_fault_timeouts_must_be_positive(key) -> None:
    from pipeq.control.config import FaultConfig

    with pytest.raises(ValueError, match=rf"^{key} must be a positive number of seconds, got -1$"):
        FaultConfig(**{key: -1})


def test_an_injected_raise_names_its_step_as_the_stages_other_errors_do() -> None:
    """It hits the process's 3rd training step; its message names that step's TRAIN number
    (7: an evaluation's steps came between), which the launch turns into the run's step."""
    from pipeq.runtime.faults import inject

    with pytest.raises(RuntimeError, match=r"stage 1 fails at step 7$"):
        inject(parse("stage:1,step:3,kind:raise"), 1, 3, named=7)
    with pytest.raises(RuntimeError, match=r"stage 1 fails at step 3$"):
        inject(parse("stage:1,step:3,kind:raise"), 1, 3)
    inject(parse("stage:1,step:3,kind:raise"), 1, 4, named=3)  # another step: nothing
