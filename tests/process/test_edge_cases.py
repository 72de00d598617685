"""Edge cases a demanding user hits: idle gaps, late errors, bad inputs, restarts, losses with
ignored targets, RNG streams, tied weights, eval-mode submodules, large state, foreign peers."""

from __future__ import annotations

import functools
import os
import signal
import math
import time

import pytest
import torch
import zmq
from torch import nn

import pipeq
from pipeq.testing import backend_of
import msgpack

from models import FailingStepSGD
from fake_clock import FakeClock
from strays import gone

SGD = functools.partial(torch.optim.SGD, lr=0.1)
FAST = dict(start_method="forkserver")


# -- module-level helpers (pickled into the stage processes) --------------------------------------
class RandProbe(nn.Module):
    """Stage 0 emits torch.rand; stage 1 subtracts its own torch.rand: zero iff same RNG stream."""

    def __init__(self, first: bool):
        super().__init__()
        self.first = first

    def forward(self, x):
        r = torch.rand(x.shape)
        return r if self.first else x - r


def _rebuild_only_in_parent(parent_pid: int) -> nn.Module:
    if os.getpid() != parent_pid:
        raise RuntimeError("this stage cannot be rebuilt in the child (marker 7f3a)")
    return nn.Linear(8, 3)


class ChildUnpicklable(nn.Linear):
    """Pickles fine in the driver; unpickling fails in the stage process (like a __main__ class
    in a notebook, or a module missing in the child's environment)."""

    def __reduce__(self):
        return (_rebuild_only_in_parent, (os.getpid(),))


def xy(batch=16, d=8, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, d, generator=g), torch.randint(0, classes, (batch,), generator=g)


# -- 1. heartbeat bookkeeping: idle time between calls is taken for a hung stage ------------------
@pytest.mark.timeout(60)
def test_idle_between_calls_longer_than_heartbeat_timeout_is_not_a_failure(monkeypatch):
    from pipeq.control import supervisor

    clock = FakeClock()  # the driver's supervisor judges the heartbeats on it
    monkeypatch.setattr(supervisor, "time", clock)
    stages = [nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)]
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), SGD, microbatches=2,
                                  heartbeat_interval=0.2, heartbeat_timeout=1.0, **FAST)
    with runner:
        runner.step(*xy())
        clock.ahead += 2.5  # the caller evaluates / logs / checkpoints on the host; stages are fine
        assert math.isfinite(runner.step(*xy()))  # it was: PipelineError: "stage k: no heartbeat for 2.5 s"


# -- 2. a stage that died between calls: ZMQError instead of PipelineError, error text lost -------
@pytest.mark.timeout(60)
def test_error_after_loss_then_next_step_reports_the_stage_error():
    stages = [nn.Linear(8, 5), nn.Linear(5, 3)]
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(),
                                  functools.partial(FailingStepSGD, lr=0.1), **FAST)
    runner.start()
    try:
        pid = runner.stage_processes[0]["pid"]
        runner.step(*xy())  # stage 0 fails in its optimizer step after the LOSS went out
        assert gone(pid, 30)  # ... and has exited by the time the caller comes back
        with pytest.raises(pipeq.PipelineError, match="optimizer step failed on purpose"):
            runner.step(*xy())  # raises zmq.error.ZMQError: Host unreachable
    finally:
        backend_of(runner).processes.teardown()


@pytest.mark.timeout(60)
def test_stage_killed_while_idle_gives_pipeline_error_and_cleans_up():
    runner = pipeq.PipelineRunner([nn.Linear(8, 8), nn.Linear(8, 3)], nn.CrossEntropyLoss(), SGD,
                                  **FAST)
    runner.start()
    ipc_dir = backend_of(runner).ipc_dir
    try:
        pid = runner.stage_processes[1]["pid"]
        os.kill(pid, signal.SIGKILL)
        assert gone(pid, 30)
        with pytest.raises(pipeq.PipelineError) as info:
            runner.step(*xy())  # zmq.error.ZMQError: Host unreachable, nothing torn down
        assert info.value.stage == 1
        assert not os.path.exists(ipc_dir)
    finally:
        backend_of(runner).processes.teardown()


# -- 3. a command that cannot be encoded for a later stage leaves earlier stages mid-step ---------
@pytest.mark.timeout(60)
def test_unsendable_target_does_not_wedge_the_pipeline():
    runner = pipeq.PipelineRunner([nn.Linear(8, 8), nn.Linear(8, 3)], nn.CrossEntropyLoss(), SGD,
                                  microbatches=2, stop_timeout=20, **FAST)
    x, y = xy()
    with runner:
        with pytest.raises(ValueError):  # codec.DtypeError: uint32 cannot be sent
            runner.step(x, y.to(torch.uint32))
        # stage 0 already got STEP and now waits forever for stage 1's gradients
        t0 = time.monotonic()
    # leaving the block waits stop_timeout (60 s by default) and raises a time-out PipelineError;
    # a further runner.step(x, y) would hang forever (no deadline, heartbeats keep coming)
    assert time.monotonic() - t0 < 10


# -- 4. stage-startup errors (unpickling, device pinning) lose their message ----------------------
@pytest.mark.timeout(60)
def test_stage_that_cannot_be_unpickled_in_the_child_reports_why():
    stages = [nn.Linear(8, 8), ChildUnpicklable(8, 3)]
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), SGD, **FAST)
    with pytest.raises(pipeq.PipelineError) as info:
        with runner:
            pass
    # today: "stage 1: stage process (pid N) exited with code 1"
    assert "marker 7f3a" in str(info.value)


# -- 5. a runner runs once: a restart would silently begin again from the initial weights -------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["simulated", "process"])
def test_restart_is_refused_rather_than_silently_reset(mode):
    torch.manual_seed(0)
    stages = [nn.Linear(8, 8), nn.Linear(8, 3)]
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), SGD, microbatches=2, mode=mode, **FAST)
    with runner:
        runner.step(*xy())
        trained = runner.state_dict()
    with pytest.raises(pipeq.PipelineError, match="already run"):
        runner.start()
    # the documented way on: a new runner loaded with the kept state
    again = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), SGD, microbatches=2, mode=mode, **FAST)
    with again:
        again.load_state_dict(trained)
        for k, v in again.state_dict().items():
            torch.testing.assert_close(v, trained[k])


# -- 8. all stage processes draw the very same random numbers ------------------------------------
@pytest.mark.timeout(60)
def test_stage_processes_do_not_share_one_rng_stream():
    torch.manual_seed(1234)
    runner = pipeq.PipelineRunner([RandProbe(True), RandProbe(False)], nn.MSELoss(), SGD,
                                  microbatches=1, **FAST)
    with runner:
        out = runner.predict(torch.zeros(4, 16))
    # stage 1's torch.rand equals stage 0's: dropout masks of equal shape coincide across stages
    assert not torch.equal(out, torch.zeros(4, 16))


# -- 11. tcp: any local process connecting to the control port crashes the driver -----------------
@pytest.mark.timeout(60)
def test_foreign_peer_on_tcp_control_port_does_not_crash_the_driver():
    runner = pipeq.PipelineRunner([nn.Linear(8, 8), nn.Linear(8, 3)], nn.CrossEntropyLoss(), SGD,
                                  transport="tcp", **FAST)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)  # no identity: the ROUTER makes up a binary one
    s.setsockopt(zmq.LINGER, 0)
    try:
        with runner:
            s.connect(backend_of(runner).server.address)
            s.send_multipart([msgpack.packb([1, 26, 1, 0, [], None])])  # a well-formed HEARTBEAT
            time.sleep(0.3)
            # it was: ValueError: invalid literal for int() (in _stage_of); now the peer, who has
            # not the job's keys, is refused at the handshake and the run never hears of it
            assert math.isfinite(runner.step(*xy()))
    finally:
        s.close()
        ctx.term()


# -- 13. state_dict()/load_state_dict() of a stage with more than 256 state tensors ---------------
def _deep_stage(n_layers: int = 130) -> nn.Module:
    return nn.Sequential(*[nn.Linear(2, 2) for _ in range(n_layers)])  # 260 state tensors


@pytest.mark.timeout(60)
def test_state_dict_of_a_stage_with_many_tensors():
    torch.manual_seed(0)
    stages = [_deep_stage(), nn.Linear(2, 2)]
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), SGD, microbatches=2, **FAST)
    with runner:
        runner.step(torch.randn(4, 2), torch.randint(0, 2, (4,)))
        # PipelineError: stage 0: CodecError: a message carries at most 256 tensors, got 260
        # (the whole pipeline is torn down by a state_dict() call)
        state = runner.state_dict()
        assert len(state) > 256, len(state)  # more than a message once carried
        runner.load_state_dict(state)
        assert all(torch.equal(v, state[k]) for k, v in runner.state_dict().items())
        assert math.isfinite(runner.step(torch.randn(4, 2), torch.randint(0, 2, (4,))))
