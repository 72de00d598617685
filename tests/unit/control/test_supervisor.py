"""The supervisor (pipeq.control.supervisor): every wait of the driver ends in a PipelineError
naming the stage at fault when a stage raises, dies, goes silent or gets stuck.

The stages are real event loops in threads of this process, on an in-memory wire, commanded
by the driver's own backend (tests/support/inproc.py); their failures are made to order.
"""

from __future__ import annotations

import functools
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import pipeq
from fake_clock import FakeClock
from inproc import InProcessPipeline, error_reply
from pipeq.errors import CodecError
from pipeq.wire.messages import Kind, Message
from pipeq.wire.control_link import STAGE, Peer

SGD = functools.partial(torch.optim.SGD, lr=0.1)


class Faulty(nn.Module):
    """A stage that computes ``Linear(8, 8)`` until its ``n``-th forward, which ``fault`` decides."""

    def __init__(self, fault: str, at: int = 0) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.fault, self.at, self.calls = fault, at, 0
        self.release = threading.Event()  # a stuck forward waits for this (set when the test ends)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, self.calls = self.calls, self.calls + 1
        if n >= self.at and self.fault == "raise":
            raise ArithmeticError("the stage's own bug")
        if n >= self.at and self.fault == "hang":
            self.release.wait(20.0)
        return self.lin(x)


def data(batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, 8, generator=g), torch.randint(0, 3, (batch,), generator=g)


def pipeline(middle: nn.Module, **kwargs) -> InProcessPipeline:
    torch.manual_seed(0)
    pipe = InProcessPipeline([nn.Linear(8, 8), middle, nn.Linear(8, 3)], nn.CrossEntropyLoss(), SGD,
                             microbatches=2, **kwargs)
    if isinstance(middle, Faulty):
        pipe.on_close.append(middle.release.set)
    return pipe


@pytest.mark.timeout(60)
def test_a_stage_that_raises_fails_the_step_naming_it_with_its_traceback() -> None:
    pipe = pipeline(Faulty("raise"))
    with pipe:
        with pytest.raises(pipeq.PipelineError) as info:
            pipe.train(*data())
        err = info.value
        assert err.stage == 1 and err.replica is None and err.shard is None
        assert "ArithmeticError: the stage's own bug" in str(err)
        assert "in forward" in err.remote_traceback  # the stage's own traceback, to its line
        assert pipe.teardowns == 1  # every stage was stopped before the error was raised
        with pytest.raises(pipeq.PipelineError, match="has failed and is closed"):
            pipe.train(*data())


@pytest.mark.timeout(60)
def test_a_silent_stage_fails_after_heartbeat_timeout_naming_it_not_its_waiting_neighbours() -> None:
    middle = Faulty("hang")
    pipe = pipeline(middle, heartbeat_timeout=0.5)
    with pipe:
        pipe.stages[1].silent.set()  # its heartbeats stop (a hung process, a host cut off)
        start = time.monotonic()
        with pytest.raises(pipeq.PipelineError) as info:
            pipe.train(*data())
        assert time.monotonic() - start < 5.0
    assert info.value.stage == 1
    assert "no heartbeat" in str(info.value) and "heartbeat_timeout=0.5" in str(info.value)


@pytest.mark.timeout(60)
def test_a_stage_stuck_in_its_computation_fails_after_step_timeout_naming_the_action() -> None:
    """It heartbeats (it is alive), but one forward has not ended: it, not the stages waiting
    for it, is named, with the action it is stuck in."""
    middle = Faulty("hang")
    pipe = pipeline(middle, step_timeout=0.5)
    with pipe:
        with pytest.raises(pipeq.PipelineError) as info:
            pipe.train(*data())
    assert info.value.stage == 1
    assert "stuck" in str(info.value) and "F(step 0, microbatch 0)" in str(info.value)
    assert "step_timeout=0.5" in str(info.value)


@pytest.mark.timeout(60)
def test_a_long_step_whose_actions_keep_finishing_is_not_stuck() -> None:
    class Slow(nn.Linear):
        def forward(self, x):
            time.sleep(0.2)
            return super().forward(x)

    pipe = InProcessPipeline([nn.Linear(8, 8), Slow(8, 8), nn.Linear(8, 3)], nn.CrossEntropyLoss(), SGD,
                             microbatches=4, step_timeout=0.5)
    with pipe:
        assert pipe.train(*data(16)) > 0  # 4 x 0.2 s of forwards, none longer than 0.5 s


@pytest.mark.timeout(60)
def test_time_between_calls_does_not_count_against_heartbeat_timeout(monkeypatch) -> None:
    from pipeq.control import supervisor

    clock = FakeClock()
    monkeypatch.setattr(supervisor, "time", clock)
    pipe = pipeline(nn.Linear(8, 8), heartbeat_timeout=0.5)
    with pipe:
        pipe.train(*data())
        for s in pipe.stages:  # nobody waits: silence is no failure
            s.silent.set()
        clock.ahead += 1.0  # the caller's own second between two steps, twice the heartbeat timeout
        for s in pipe.stages:
            s.silent.clear()
        assert pipe.train(*data()) > 0


@pytest.mark.timeout(60)
def test_a_stage_process_that_exits_fails_the_wait_naming_it_and_how_it_ended() -> None:
    middle = Faulty("hang")
    proc = SimpleNamespace(exitcode=None, pid=4242)  # stage 1's process, as the supervisor watches it
    pipe = pipeline(middle, procs={1: proc})
    with pipe:
        threading.Timer(0.3, lambda: setattr(proc, "exitcode", -9)).start()  # the OOM killer
        with pytest.raises(pipeq.PipelineError) as info:
            pipe.train(*data())
    assert info.value.stage == 1
    assert "pid 4242" in str(info.value) and "SIGKILL" in str(info.value)


@pytest.mark.timeout(60)
def test_a_stage_whose_control_socket_is_gone_is_named_when_sending() -> None:
    pipe = pipeline(nn.Linear(8, 8))
    with pipe:
        pipe.wire.gone.add(2)
        with pytest.raises(pipeq.PipelineError) as info:
            pipe.train(*data())
    assert info.value.stage == 2 and "control socket is gone" in str(info.value)


@pytest.mark.timeout(60)
def test_a_malformed_control_message_fails_the_run() -> None:
    pipe = pipeline(nn.Linear(8, 8))
    with pipe:
        pipe.wire.replies.put(CodecError("a header that is not msgpack"))
        with pytest.raises(pipeq.PipelineError, match="malformed message on the control channel"):
            pipe.train(*data())
        assert pipe.teardowns == 1


@pytest.mark.timeout(60)
def test_messages_from_strangers_are_ignored() -> None:
    pipe = pipeline(nn.Linear(8, 8))
    with pipe:
        want = pipe.train(*data())
        for peer in (None, Peer(STAGE, 7)):  # no identity; a process this run does not have
            pipe.wire.replies.put((peer, Message(Kind.ERROR, extra={"message": "not one of ours"})))
            pipe.wire.replies.put((peer, Message(Kind.LOSS, 1)))
        assert pipe.train(*data()) < want  # the next step, undisturbed (and trained on)


@pytest.mark.timeout(60)
def test_a_failure_in_a_later_step_of_a_stream_lets_the_earlier_steps_finish() -> None:
    """Steps 0 and 1 are in flight; stage 1 fails in step 1 (its third forward): step 0's loss
    still comes, and waiting for step 1 raises the failure."""
    pipe = pipeline(Faulty("raise", at=2))
    with pipe:
        x, y = data()
        s0, s1 = pipe.submit(x, y), pipe.submit(x, y)
        assert pipe.backend.result(s0) > 0
        with pytest.raises(pipeq.PipelineError) as info:
            pipe.backend.result(s1)
    assert info.value.stage == 1 and "ArithmeticError" in str(info.value)


@pytest.mark.timeout(60)
def test_a_stage_that_raised_and_exited_is_named_with_its_error_not_its_gone_socket() -> None:
    """Stage 1 raised and exited: its socket is gone before its ERROR has arrived. The error the
    caller gets is the stage's own, as when the process is seen to exit (check_health)."""
    pipe = pipeline(nn.Linear(8, 8))
    with pipe:
        try:
            raise ArithmeticError("the stage's own bug")
        except ArithmeticError as exc:
            error = error_reply(exc, None)
        pipe.wire.gone.add(1)
        threading.Timer(0.1, lambda: pipe.wire.replies.put((Peer(STAGE, 1), error))).start()
        with pytest.raises(pipeq.PipelineError) as info:
            pipe.train(*data())
    assert info.value.stage == 1 and "ArithmeticError: the stage's own bug" in str(info.value)


@pytest.mark.timeout(3)
def test_a_dead_stage_is_named_even_while_the_others_heartbeat_often() -> None:
    middle = Faulty("hang")
    proc = SimpleNamespace(exitcode=-9, pid=4242)  # stage 1's process, found dead at once
    pipe = pipeline(middle, procs={1: proc}, beat_s=0.01)
    with pipe:
        with pytest.raises(pipeq.PipelineError) as info:
            pipe.train(*data())
    assert info.value.stage == 1 and "SIGKILL" in str(info.value)


@pytest.mark.timeout(3)
def test_a_dead_process_of_two_stages_is_named_by_the_first_with_every_stage_it_took() -> None:
    """Stages 1 and 2 in one process (stages_per_process): its death takes both."""
    proc = SimpleNamespace(exitcode=-9, pid=4242)
    pipe = pipeline(Faulty("hang"), procs={1: proc, 2: proc}, beat_s=0.01)
    with pipe:
        with pytest.raises(pipeq.PipelineError) as info:
            pipe.train(*data())
    assert info.value.stage == 1
    assert info.value.message == "stage process (pid 4242) of stages 1 and 2 was killed by SIGKILL"


class _Wire:
    """The control server as the supervisor reads it: these messages in turn (None: a quiet poll)."""

    def __init__(self, replies: list) -> None:
        self.replies = list(replies)

    def recv(self, timeout_ms: int):
        if self.replies:
            return self.replies.pop(0)
        time.sleep(timeout_ms / 1000)
        return None


def _ready(g: int) -> tuple[Peer, Message]:
    from pipeq.wire import control
    from pipeq.wire.control import Ready

    return Peer(STAGE, g), control.message(Ready(forward="f", backward="b", pid=100 + g, device="cpu", replica=0,
                                                 stage=g, shard=0, threads=1, host="h", cores=[], layout={}))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("absorbed", [False, True], ids=["run-ends", "replica-dropped"])
def test_a_healthy_stages_ready_read_while_looking_for_a_dead_ones_error_blames_the_dead_one(absorbed) -> None:
    """Stage 1 died before its READY; stages 0 and 2's READYs arrive while the supervisor looks for
    stage 1's ERROR in flight: they are kept for the start, and stage 1 is named (or, absorbed
    like a dropped replica, the start goes on with the others' READYs)."""
    from pipeq.control.processes import Numbering
    from pipeq.control.supervisor import Supervisor

    procs = {0: SimpleNamespace(exitcode=None, pid=100), 1: SimpleNamespace(exitcode=-9, pid=101),
             2: SimpleNamespace(exitcode=None, pid=102)}
    sup = Supervisor(_Wire([None, _ready(0), _ready(2)]), procs, n_stages=3, n_processes=3, n_nodes=1,
                     heartbeat_timeout=15.0, step_timeout=None, teardown=lambda: None, numbering=Numbering(3, 1))
    if absorbed:
        sup.absorb = lambda g, err: (sup.ignore([g]), True)[1]
        got = sup.collect(Kind.READY, dict.fromkeys(range(3), 1), timeout=10.0, what="start")
        assert [len(got[g]) for g in range(3)] == [1, 0, 1]
        return
    with pytest.raises(pipeq.PipelineError) as info:
        sup.collect(Kind.READY, dict.fromkeys(range(3), 1), timeout=10.0, what="start")
    assert info.value.stage == 1, info.value
    assert "pid 101" in str(info.value) and "SIGKILL" in str(info.value)
