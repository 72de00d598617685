"""``fault_tolerance="replicas"``: a replica whose stage fails is dropped for the step and rebuilt.

With ``data_parallel=2``, replica 1's stage 1 fails (PIPEQ_FAULT: killed, raising, or stuck) as
step K starts. The run goes on: step K is the mean over replica 0's samples only (its update and
its loss), replica 1 is rebuilt from replica 0's live state and every later step runs on both.
So the weights after the run equal a single-process reference that trains on the whole batch at
every step but K, and on replica 0's half of it at step K.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import pipeq
from pipeq.testing import backend_of
from pipeq.checkpoint import StageLayout, global_state
from pipeq.wire.messages import Kind

from models import CarryFirst, Chain, DropLast, SlowBackwardAt, batches64, flat_state, reference_train, stages64
from strays import gone, wait_no_strays

pytestmark = pytest.mark.timeout(90)

FAST = dict(start_method="forkserver", threads_per_stage=1)
ADAM = functools.partial(torch.optim.Adam, lr=0.01)
STEPS, FAILS_AT, BATCH = 5, 3, 10  # replica 0 trains on samples 0..4, replica 1 on 5..9


def reference(stages, data, degraded_step, keep=slice(0, BATCH // 2)):
    """Single-process training; at ``degraded_step`` only the samples ``keep`` (by default
    replica 0's of two: the first half)."""
    data = [(x[keep], y[keep]) if step == degraded_step else (x, y) for step, (x, y) in enumerate(data, start=1)]
    model, losses = reference_train(stages, nn.CrossEntropyLoss(), ADAM, data)
    return flat_state(model), losses


def per_stage_reference(stages, data, summed, batch=BATCH):
    """Plain torch for a run whose step s summed, at stage k, the replicas ``summed[s][k]``
    (``runner.degraded_stages``; by default both of two): each stage's gradient is the mean loss's
    over those replicas' samples (replica 0 holds a batch's first half, replica 1 its second).
    The state, and each step's loss over the samples its last stage summed."""
    model = Chain(*copy.deepcopy(stages))
    opt = ADAM(model.parameters())
    parts = {(0, 1): slice(0, batch), (0,): slice(0, batch // 2), (1,): slice(batch // 2, batch)}
    losses = []
    for step, (x, y) in enumerate(data, start=1):
        grads, loss = {}, {}
        for part, keep in parts.items():
            model.zero_grad()
            value = nn.CrossEntropyLoss()(model(x[keep]), y[keep])
            value.backward()
            grads[part], loss[part] = [[p.grad.clone() for p in stage.parameters()] for stage in model], value.item()
        row = summed.get(step, {})
        for k, stage in enumerate(model):
            for p, g in zip(stage.parameters(), grads[tuple(row.get(k, (0, 1)))][k]):
                p.grad = g
        opt.step()
        losses.append(loss[tuple(row.get(len(model) - 1, (0, 1)))])
    return flat_state(model), losses


def replica_state(runner, r):
    """Replica r's parameters and buffers, keyed like ``state_dict()`` (which reads replica 0)."""
    be = backend_of(runner)
    procs = [r * be.n_stages + k for k in range(be.n_stages)]
    got = be.ask_each(Kind.GET_STATE, Kind.STATE, f"replica {r}'s state", procs)
    per_stage = [(got[g].extra["names"], [t.clone() for t in got[g].tensors]) for g in procs]
    return dict(global_state(per_stage, [StageLayout(**lay) for lay in be.layouts()]))


@pytest.mark.parametrize("kind,wire,schedule", [("kill", "ipc", "1f1b"), ("raise", "ipc", "1f1b"), ("hang", "ipc", "1f1b"),
                                                ("kill", "tcp", "1f1b"), ("kill", "ipc", "zbv"), ("hang", "ipc", "zbv")])
def test_a_failed_replica_is_left_out_of_its_step_and_rebuilt(monkeypatch, capfd, kind, wire, schedule):
    """(Over tcp with a MAC per message, the rebuilt replica's links are new sockets whose
    sequence numbers start again. With zbv, 4 stages, 2 per process in a V (stages 0+3, 1+2):
    stage 1's failure takes stage 2, its process's other stage, with it; a hang is still named by
    the stage that hangs.)"""
    monkeypatch.setenv("PIPEQ_FAULT", f"stage:1,step:{FAILS_AT},kind:{kind},replica:1")
    n, m = (4, 4) if schedule == "zbv" else (3, 2)
    stages, data = stages64(n), batches64(STEPS, BATCH)
    ref, ref_losses = reference(stages, data, FAILS_AT)
    kw: dict = dict(step_timeout=1.0, heartbeat_interval=0.2) if kind == "hang" else {}
    if wire == "tcp":
        kw.update(transport="tcp", tcp_security="authenticate")
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), ADAM, schedule, m, data_parallel=2,
                                  fault_tolerance="replicas", **FAST, **kw)
    with runner:
        losses = [runner.step(x, y) for x, y in data]
        state = runner.state_dict()
        rebuilt = replica_state(runner, 1)
        assert runner.degraded_steps == {FAILS_AT: 1}
        failures = runner.replica_failures
    assert not wait_no_strays(5.0), "stage processes outlived the run"
    assert len(failures) == 1 and (failures[0].stage, failures[0].replica) == (1, 1)
    assert "the other replicas finish the step without replica 1" in capfd.readouterr().err
    assert losses == pytest.approx(ref_losses, abs=1e-12)
    for key in ref:
        torch.testing.assert_close(state[key], ref[key], atol=1e-12, rtol=0, msg=key)
        assert torch.equal(state[key], rebuilt[key]), key  # the replicas are alike again


def test_three_replicas_lose_replica_0_and_rebuild_it_from_replica_1(monkeypatch):
    """Replica 0's last stage raises at step 2: replicas 1 and 2 (3 + 3 of the 10 samples) finish
    the step, their sum scaled by 10 / 6; replica 0 is rebuilt from replica 1 (state_dict reads it)."""
    monkeypatch.setenv("PIPEQ_FAULT", "stage:1,step:2,kind:raise,replica:0")
    stages, data = stages64(2), batches64(3, BATCH)
    ref, ref_losses = reference(stages, data, 2, keep=slice(4, BATCH))  # replica 0 holds samples 0..3
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), ADAM, "fill-drain", 1, data_parallel=3,
                                  fault_tolerance="replicas", **FAST)
    with runner:
        losses = [runner.step(x, y) for x, y in data]
        assert runner.degraded_steps == {2: 2}
        state = runner.state_dict()
    assert losses == pytest.approx(ref_losses, abs=1e-12)
    for key in ref:
        torch.testing.assert_close(state[key], ref[key], atol=1e-12, rtol=0, msg=key)
    assert not wait_no_strays(5.0)


def test_without_fault_tolerance_the_same_failure_ends_the_run(monkeypatch):
    monkeypatch.setenv("PIPEQ_FAULT", "stage:1,step:2,kind:kill,replica:1")
    data = batches64(2, BATCH)
    with pipeq.PipelineRunner(stages64(2), nn.CrossEntropyLoss(), ADAM, "1f1b", 2, data_parallel=2, **FAST) as r:
        r.step(*data[0])
        with pytest.raises(pipeq.PipelineError, match=r"replica 1, stage 1: stage process") as info:
            r.step(*data[1])
    assert (info.value.stage, info.value.replica) == (1, 1)
    assert not wait_no_strays(5.0)


def test_pipeq_launch_records_the_step_with_fewer_replicas(monkeypatch, tmp_path):
    """``fault_tolerance = "replicas"`` in a job file: the launch goes on, and metrics.jsonl says
    which steps had one replica. pipeq launch streams its batches: step 4 was sent with step 3
    (4 in flight with 3 stages), so replica 1, lost as step 3 starts, misses both."""
    from launch_util import DIGITS_JOB, launch_here, metrics

    job = tmp_path / "job.toml"
    job.write_text(open(DIGITS_JOB).read() + 'fault_tolerance = "replicas"\ndata_parallel = 2\n')
    monkeypatch.setenv("PIPEQ_FAULT", "stage:1,step:3,kind:kill,replica:1")
    out = str(tmp_path / "out")
    r = launch_here("--steps", "4", "--out", out, job=str(job))
    assert r.returncode == 0, r.stderr
    steps = [m for m in metrics(out) if "step" in m and "loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert [m.get("replicas") for m in steps] == [None, None, 1, 1]
    assert not wait_no_strays(5.0)


def test_a_step_still_summing_when_the_next_one_fails_is_not_degraded(monkeypatch):
    """The step before the failing one is never degraded by the driver's own stop of the lost
    replica. runner.step() sends step 3 once step 2's loss is in, while replica 1's stage 0 is
    still in its last backward of step 2 (slowed here, 1.5 s): replica 1's stage 1 raises as
    step 3 starts. Replica 1's processes are stopped only once replica 0's stage 0 has summed
    step 2 with replica 1's gradients, so only step 3 is the mean over replica 0's samples."""
    monkeypatch.setenv("PIPEQ_FAULT", f"stage:1,step:{FAILS_AT},kind:raise,replica:1")
    stages, data = stages64(3), batches64(STEPS, BATCH)
    marker = 42.0
    data[FAILS_AT - 2][0][BATCH - 1, 0] = marker  # in replica 1's last microbatch of step FAILS_AT - 1
    slow = [SlowBackwardAt(stages[0], marker, 1.5), *stages[1:]]
    calm = [SlowBackwardAt(stages[0], marker, 1.5, armed=False), *stages[1:]]
    ref, ref_losses = reference(calm, data, FAILS_AT)
    runner = pipeq.PipelineRunner(slow, nn.CrossEntropyLoss(), ADAM, "1f1b", 2, data_parallel=2,
                                  fault_tolerance="replicas", **FAST)
    with runner:
        losses = [runner.step(x, y) for x, y in data]
        state = runner.state_dict()
        assert runner.degraded_steps == {FAILS_AT: 1}
    assert not wait_no_strays(5.0), "stage processes outlived the run"
    assert losses == pytest.approx(ref_losses, abs=1e-12)
    for key in ref:
        torch.testing.assert_close(state[key], ref[key], atol=1e-12, rtol=0, msg=key)


def test_a_rebuilt_replica_is_not_failed_again_by_the_same_injected_fault(monkeypatch):
    """PIPEQ_FAULT fires once: replica 1's processes, started again after step 2, count their own
    training steps from 1, and must not fail again at their own step 2 (step 4 of the run)."""
    monkeypatch.setenv("PIPEQ_FAULT", "stage:1,step:2,kind:raise,replica:1")
    stages, data = stages64(2), batches64(5, BATCH)
    ref, ref_losses = reference(stages, data, 2)
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), ADAM, "1f1b", 2, data_parallel=2,
                                  fault_tolerance="replicas", **FAST)
    with runner:
        losses = [runner.step(x, y) for x, y in data]
        assert runner.degraded_steps == {2: 1}
    assert losses == pytest.approx(ref_losses, abs=1e-12)
    assert not wait_no_strays(5.0), "stage processes outlived the run"


def _stages_slow_at_1(armed):
    """stages64(3), stage 1's backward slowed (2 s) at a microbatch whose data holds MARKER: the
    marker reaches stage 1 through stage 0's carried column (the same numbers as stages64(3))."""
    s = stages64(3)
    return [CarryFirst(s[0]), SlowBackwardAt(DropLast(s[1]), MARKER, 2.0, armed=armed), s[2]]


MARKER = 42.0


def test_a_stage_lost_before_its_gradients_of_the_step_before_stalls_nobody(monkeypatch):
    """Issue 40, defect 2. Replica 1's stage 1 is slow (2 s) in its last backward of step 3, whose
    loss is in; the run sends step 4 and replica 1's stage 1 is SIGKILLed then. Its stage 0, alive,
    waits for gradients that never come: told at once that its replica is lost, it gives step 3 up,
    and replica 0 sums step 3 without replica 1 at stages 0 and 1 (stage 2 had its gradients)
    without waiting for any time-out. Step 4 is replica 0's alone, and replica 1 is rebuilt before
    step 5. The weights equal plain torch's: step 3 with replica 0's half at stages 0 and 1 and the
    whole batch at stage 2; step 4 with replica 0's half everywhere."""
    import os
    import signal
    import threading
    import time

    steps, lost = 6, 4
    data = batches64(steps, BATCH)
    data[lost - 2][0][BATCH - 1, 0] = MARKER  # replica 1's last microbatch of step 3
    where = {lost - 1: {0: [0], 1: [0]}, lost: {0: [0], 1: [0], 2: [0]}}  # step -> stage -> replicas summed
    ref, ref_losses = per_stage_reference(_stages_slow_at_1(False), data, where)

    runner = pipeq.PipelineRunner(_stages_slow_at_1(True), nn.CrossEntropyLoss(), ADAM, "1f1b", 2,
                                  data_parallel=2, fault_tolerance="replicas", **FAST)
    times = []
    with runner:
        victim = runner.stage_processes[1 * 3 + 1]["pid"]
        losses = []
        for step, (x, y) in enumerate(data, start=1):
            killer = threading.Timer(0.6, os.kill, (victim, signal.SIGKILL)) if step == lost else None
            if killer is not None:
                killer.start()
            t0 = time.monotonic()
            losses.append(runner.step(x, y))
            times.append(time.monotonic() - t0)
        state = runner.state_dict()
        rebuilt = replica_state(runner, 1)
        assert runner.degraded_steps == {lost - 1: 1, lost: 1}
        assert runner.degraded_stages == where
    assert not wait_no_strays(5.0), "stage processes outlived the run"
    # step 4 (the loss, and the rebuild: about 1 s on an idle machine) waits for no time-out (the
    # heartbeat_timeout of 15 s it used to wait for); no other step is slower than usual (step 3 is
    # handed back once its loss is in: its slow backward is step 4's wait)
    median = sorted(times)[len(times) // 2]
    assert times[lost - 1] < 7.5 and all(t < max(2 * median, 1.0) for t in times[1:lost - 1] + times[lost:]), times
    assert losses == pytest.approx(ref_losses, abs=1e-12)
    for key in ref:
        torch.testing.assert_close(state[key], ref[key], atol=1e-12, rtol=0, msg=key)
        assert torch.equal(state[key], rebuilt[key]), key


def _wide_then_narrow(armed):
    """Stage 0 wide (its gradients, 16 rows x 601 float64 a microbatch, cross in shared-memory
    slots), stage 1 narrow (its gradients fit a lane), stage 1's backward slowed (0.1 s) at a
    microbatch holding MARKER (carried from the data through stage 0, as in _stages_slow_at_1)."""
    torch.manual_seed(0)
    s0 = nn.Sequential(nn.Linear(6, 600), nn.Tanh()).double()
    s1 = nn.Sequential(nn.Linear(600, 8), nn.Tanh()).double()
    return [CarryFirst(s0), SlowBackwardAt(DropLast(s1), MARKER, 0.1, armed=armed), nn.Linear(8, 4).double()]


def test_a_lost_replicas_stage_finishing_the_step_before_never_waits_on_its_dead_previous_stage():
    """Replica 1's stage 1 is slow in every backward of step 3 (fill-drain, 16 microbatches), so
    that when step 3's loss is in, it still has most of them to do, each sending a gradient to
    stage 0 through a shared-memory slot (4 a channel). Replica 1's stage 0 is SIGKILLed then. Its
    stage 1 has no dead stage downstream: it finishes step 3, and its sends to the dead stage 0,
    whose slots are never freed again, are dropped instead of waiting for ever (which held up
    replica 0's stage 1 until heartbeat_timeout). Step 3 is degraded at stage 0 only."""
    import os
    import signal
    import threading
    import time

    steps, lost, batch, m = 5, 4, 512, 16
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(batch, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(steps)]
    data[lost - 2][0][batch // 2:, 0] = MARKER  # every microbatch of replica 1's at step 3
    where = {lost - 1: {0: [0]}, lost: {0: [0], 1: [0], 2: [0]}}  # step -> stage -> replicas summed
    ref, _ = per_stage_reference(_wide_then_narrow(False), data, where, batch)

    runner = pipeq.PipelineRunner(_wide_then_narrow(True), nn.CrossEntropyLoss(), ADAM, "fill-drain", m,
                                  data_parallel=2, fault_tolerance="replicas", heartbeat_timeout=10.0, **FAST)
    times = []
    with runner:
        victim = runner.stage_processes[1 * 3 + 0]["pid"]
        for step, (x, y) in enumerate(data, start=1):
            if step == lost:
                threading.Timer(0.05, os.kill, (victim, signal.SIGKILL)).start()
            t0 = time.monotonic()
            runner.step(x, y)
            times.append(time.monotonic() - t0)
        state = runner.state_dict()
        assert runner.degraded_stages == where
    assert not wait_no_strays(5.0), "stage processes outlived the run"
    assert times[lost - 1] < 6.0, times  # stage 1's slow backwards (1.6 s) and the rebuild: no time-out
    for key in ref:
        torch.testing.assert_close(state[key], ref[key], atol=1e-12, rtol=0, msg=key)


def test_a_stage_failing_after_its_steps_loss_is_in_is_absorbed_while_the_caller_pauses():
    """Replica 1's stage 0 raises in its last backward of step 3, 0.5 s after step 3's loss is in
    (the first stages finish a step last), while the caller does something else between steps
    (until that process has gone). Its ERROR is read as step 4 is sent: it is that step's failure (the run goes on), not
    one outside training (it once ended the run). Step 3 is degraded at stage 0, step 4 everywhere."""

    from models import RaiseBackwardAt

    steps, lost = 5, 4
    data = batches64(steps, BATCH)
    data[lost - 2][0][BATCH - 1, 0] = MARKER  # replica 1's last microbatch of step 3

    def stages(armed):
        s = stages64(3)
        return [RaiseBackwardAt(s[0], MARKER, 0.5, armed=armed), *s[1:]]

    where = {lost - 1: {0: [0]}, lost: {0: [0], 1: [0], 2: [0]}}  # step -> stage -> replicas summed
    ref, _ = per_stage_reference(stages(False), data, where)

    runner = pipeq.PipelineRunner(stages(True), nn.CrossEntropyLoss(), ADAM, "1f1b", 2, data_parallel=2,
                                  fault_tolerance="replicas", **FAST)
    with runner:
        for step, (x, y) in enumerate(data, start=1):
            runner.step(x, y)
            if step == lost - 1:  # the caller does something else until the failing stage has gone
                assert gone(next(p["pid"] for p in runner.stage_processes if p["replica"] == 1 and p["stage"] == 0),
                            30)
        state = runner.state_dict()
        assert runner.degraded_stages == {lost - 1: {0: [0]}, lost: {0: [0], 1: [0], 2: [0]}}
        assert len(runner.replica_failures) == 1
    assert not wait_no_strays(5.0), "stage processes outlived the run"
    for key in ref:
        torch.testing.assert_close(state[key], ref[key], atol=1e-12, rtol=0, msg=key)


def test_a_replica_lost_in_a_stream_is_rebuilt_without_the_buckets_sent_to_its_lost_processes():
    """runner.stream keeps 4 steps in flight (3 stages, stage 0's backward slowed): replica 1's
    stage 0 is SIGKILLed once step 2's loss is handed back. Replica 0 sent its buckets of the steps
    in flight to it as always, and they waited in ZeroMQ for its address, where the rebuilt process
    binds: they filled its queue and failed it again ("a peer is running ahead"), or the run. Now a
    replica sends nothing for a round a peer is lost for, and a rebuilt one drops what is older
    than the round it rejoins at."""
    import os
    import signal

    steps = 10
    s = stages64(3)
    stages, data = [SlowBackwardAt(s[0], MARKER, 0.02), *s[1:]], batches64(steps, BATCH)
    for x, _ in data:
        x[:, 0] = MARKER  # every backward of stage 0 slowed: the stream's steps stay in flight
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), ADAM, "1f1b", 2, data_parallel=2,
                                  fault_tolerance="replicas", **FAST)
    with runner:
        victim = runner.stage_processes[1 * 3 + 0]["pid"]
        losses = []
        for step, loss in enumerate(runner.stream(data), start=1):
            losses.append(loss)
            if step == 2:
                os.kill(victim, signal.SIGKILL)
        state = runner.state_dict()
        rebuilt = replica_state(runner, 1)
        degraded = runner.degraded_stages
        assert len(runner.replica_failures) == 1, runner.replica_failures
    assert not wait_no_strays(5.0), "stage processes outlived the run"
    assert len(losses) == steps and 2 <= len(degraded) <= 5, degraded
    ref, _ = per_stage_reference([SlowBackwardAt(s[0], MARKER, 0.02, armed=False), *s[1:]], data, degraded)
    for key in ref:
        torch.testing.assert_close(state[key], ref[key], atol=1e-12, rtol=0, msg=key)
        assert torch.equal(state[key], rebuilt[key]), key


@pytest.mark.parametrize("layout", ["tensor_parallel", "hsdp"])
def test_a_lost_replica_of_shards_or_of_a_shard_group_is_left_out_and_rebuilt(monkeypatch, layout):
    """With tensor parallelism, replica 1's stage 1 dies (both its shards: they are one stage):
    replica 0's shards each finish step 3 summing with no one, and replica 1's 4 processes are
    rebuilt. With HSDP (4 replicas in 2 shard groups of 2), replica 1's stage 1 dies: its shard
    group (replicas 0 and 1: their pieces need each other) is left out of step 3 and rebuilt from
    the other group, which finishes the step on its samples (6..9 of 10). Both end equal to plain
    training on those samples at step 3."""
    monkeypatch.setenv("PIPEQ_FAULT", f"stage:1,step:{FAILS_AT},kind:kill,replica:1")
    stages, data = stages64(3), batches64(STEPS, BATCH)
    if layout == "tensor_parallel":
        kw: dict = dict(data_parallel=2, tensor_parallel=2, tp_plan=[{"0": "colwise"}, {"0": "colwise"}, {"": "colwise"}])
        keep, survivors = slice(0, BATCH // 2), 1
    else:
        kw = dict(data_parallel=4, sharding="hsdp", shard_size=2)
        keep, survivors = slice(6, BATCH), 2  # replicas 2 and 3 hold samples 6..7 and 8..9
    ref, ref_losses = reference(stages, data, FAILS_AT, keep=keep)
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), ADAM, "1f1b", 2, fault_tolerance="replicas",
                                  **FAST, **kw)
    with runner:
        losses = [runner.step(x, y) for x, y in data]
        state = runner.state_dict()
        assert runner.degraded_steps == {FAILS_AT: survivors}
        assert len(runner.replica_failures) == 1
    assert not wait_no_strays(5.0), "stage processes outlived the run"
    assert losses == pytest.approx(ref_losses, abs=1e-12)
    for key in ref:
        torch.testing.assert_close(state[key], ref[key], atol=1e-12, rtol=0, msg=key)
