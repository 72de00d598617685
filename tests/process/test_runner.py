"""PipelineRunner equals plain single-process training, in process and simulated mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeq
from models import TwoIn, TwoOut, flat_state, mlp_stages
from runner_cases import SGD, assert_matches_reference, batches, run

pytestmark = pytest.mark.timeout(120)


# tests about numbers, not start-up: stages fork from a server with torch imported (~0.1 s each
# instead of ~3 s); the default (spawn: a fresh interpreter per stage, the start-up most users
# get) trains 1F1B to the same numbers in test_failures.py's test_stage_killed_by_sigkill, which
# needs spawned stages anyway
FAST = {"start_method": "forkserver"}


@pytest.mark.parametrize(("schedule", "start"), [("fill-drain", FAST), ("1f1b", FAST)], ids=["fill-drain", "1f1b"])
def test_process_mode_equals_single_process_training(schedule, start):
    stages = mlp_stages()
    data = batches(4, 48)
    losses, state, out = run(stages, data, schedule=schedule, microbatches=4, mode="process", **start)
    model = assert_matches_reference(stages, data, losses, state)
    with torch.no_grad():
        torch.testing.assert_close(out, model(data[0][0]), atol=1e-5, rtol=0)


def test_process_mode_uneven_microbatches_and_few_microbatches():
    stages = mlp_stages((8, 12, 12, 3))
    data = batches(3, 50)  # 8 microbatches of 7 or 6 samples
    losses, state, _ = run(stages, data, schedule="1f1b", microbatches=8, mode="process", **FAST)
    assert_matches_reference(stages, data, losses, state)
    losses, state, _ = run(stages, data, schedule="fill-drain", microbatches=2, mode="process", **FAST)
    assert_matches_reference(stages, data, losses, state)


def test_simulated_equals_process_mode():
    stages = mlp_stages((8, 16, 16, 16, 3))
    data = batches(3, 40)
    a = run(stages, data, schedule="1f1b", microbatches=5, mode="process", **FAST)
    b = run(stages, data, schedule="1f1b", microbatches=5, mode="simulated")
    assert a[0] == pytest.approx(b[0], abs=1e-6)
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], atol=1e-6, rtol=0)
    torch.testing.assert_close(a[2], b[2], atol=1e-6, rtol=0)


@pytest.mark.parametrize("flag_first", [False, True])
def test_tuple_activations_cross_stage_boundaries(flag_first):
    # a float activation and an integer tensor riding along, in either order
    torch.manual_seed(3)
    stages = [TwoOut(8, 16, flag_first), TwoIn(16, 3, flag_first)]
    data = batches(3, 24)
    for mode in ("simulated", "process"):
        kw = FAST if mode == "process" else {}
        losses, state, _ = run(stages, data, schedule="1f1b", microbatches=3, mode=mode, **kw)
        assert_matches_reference(stages, data, losses, state)


def test_state_dict_round_trip_and_caller_modules_untouched():
    stages = mlp_stages()
    before = {k: v.clone() for k, v in flat_state(stages).items()}
    data = batches(2, 32)
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), SGD, microbatches=4, **FAST)
    with runner:
        runner.step(*data[0])
        trained = runner.state_dict()
        runner.load_state_dict(before)
        torch.testing.assert_close(runner.state_dict(), before)
        with torch.no_grad():
            torch.testing.assert_close(
                runner.predict(data[1][0]), nn.Sequential(*stages)(data[1][0]), atol=1e-6, rtol=0
            )
        with pytest.raises(ValueError, match=r"missing keys \['2.bias'\]"):
            runner.load_state_dict({k: v for k, v in trained.items() if k != "2.bias"})
        bad = dict(trained)
        bad["4.weight"] = torch.zeros(5, 5)
        with pytest.raises(ValueError, match=r"4\.weight.*shape"):
            runner.load_state_dict(bad)
    # the workers trained private copies: the caller's modules are unchanged
    for k, v in flat_state(stages).items():
        assert torch.equal(v, before[k])


@pytest.mark.parametrize("security", ["encrypt", "authenticate"])
def test_tcp_transport(security):
    """Over authenticated tcp (the runner makes its own secret) training equals one process's."""
    stages = mlp_stages()
    data = batches(2, 32)
    losses, state, _ = run(stages, data, schedule="1f1b", microbatches=4, mode="process", transport="tcp",
                           tcp_security=security, **FAST)
    assert_matches_reference(stages, data, losses, state)


@pytest.mark.timeout(60)
def test_a_tensor_over_the_frame_cap_fails_naming_the_stage_and_the_setting():
    stages = mlp_stages()
    x, y = batches(1, 32)[0]
    with pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), SGD, microbatches=2, max_message_mb=1,
                              **FAST) as runner:
        runner.step(x, y)  # 16 x 32 floats: far below 1 MiB
    big = pipeq.PipelineRunner([nn.Linear(32, 20000), nn.Linear(20000, 3)], nn.CrossEntropyLoss(), SGD,
                               microbatches=1, max_message_mb=1, **FAST)
    with big, pytest.raises(pipeq.PipelineError, match=r"stage 0.*activation of step 1 microbatch 0 .*1\.2 MiB"
                                                           r".*max_message_mb"):
        big.step(torch.randn(16, 32), torch.randint(0, 3, (16,)))


def test_user_schedule_function_runs_in_both_modes():
    from models import reverse_drain

    stages = mlp_stages()
    data = batches(3, 40)
    for mode in ("simulated", "process"):
        kw = FAST if mode == "process" else {}
        losses, state, _ = run(stages, data, schedule=reverse_drain, microbatches=4, mode=mode, **kw)
        assert_matches_reference(stages, data, losses, state)


def test_stage_processes_say_which_process_runs_which_stage():
    """runner.stage_processes: one entry per stage process once started (their pids alive, each
    stage's), none before and none in simulated mode; a monitor's view, not the stages' layouts."""
    import os

    runner = pipeq.PipelineRunner(mlp_stages(), nn.CrossEntropyLoss(), SGD, **FAST)
    assert runner.stage_processes == []
    with runner:
        every = runner.stage_processes
        assert [(p["replica"], p["stage"], p["shard"]) for p in every] == [(0, k, 0) for k in range(runner.n_stages)]
        assert len({p["pid"] for p in every}) == runner.n_stages and os.getpid() not in {p["pid"] for p in every}
        for p in every:
            os.kill(p["pid"], 0)  # alive (raises otherwise)
            assert p["threads"] >= 1 and p["cores"] and p["forward"] and "layout" not in p
    with pipeq.PipelineRunner(mlp_stages(), nn.CrossEntropyLoss(), SGD, mode="simulated") as simulated:
        assert simulated.stage_processes == []
