"""A run a user tries to break: two threads on one runner, a killed fork server, a stage that
dies during start-up. Each must end in a PipelineError naming what happened (or carry on), with
no process left behind."""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from torch import nn

import pipeq
from pipeq.testing import backend_of

SGD = functools.partial(torch.optim.SGD, lr=0.1)
FAST = dict(start_method="forkserver")


def xy(batch=8, d=8, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, d, generator=g), torch.randint(0, classes, (batch,), generator=g)


def runner(**kw):
    torch.manual_seed(0)
    return pipeq.PipelineRunner([nn.Linear(8, 8), nn.Linear(8, 3)], nn.CrossEntropyLoss(), SGD,
                                microbatches=2, **{**FAST, **kw})


# -- 1. two threads on one runner: the second is refused, the sockets stay whole ---------------
@pytest.mark.timeout(60)
def test_a_second_thread_is_refused_while_a_step_runs_and_the_runner_carries_on():
    x, y = xy()
    r = runner()
    with r:
        r.step(x, y)
        inside, release = threading.Event(), threading.Event()
        backend = backend_of(r)
        result = backend.result

        def slow_result(step):  # the first thread holds the runner inside its step
            inside.set()
            assert release.wait(30)
            return result(step)

        backend.result = slow_result
        out: list = []
        t = threading.Thread(target=lambda: out.append(r.step(x, y)), name="trainer")
        t.start()
        assert inside.wait(30)
        for call in (lambda: r.step(x, y), lambda: r.predict(x), r.state_dict, lambda: next(r.stream([(x, y)])),
                     r.close):
            with pytest.raises(pipeq.PipelineError, match=r"in use by thread 'trainer' \(step\); a runner is not "
                                                          r"thread-safe: use it from one thread, or guard it"):
                call()
        release.set()
        t.join(30)
        del backend.result
        assert len(out) == 1 and out[0] == out[0]
        # nothing was corrupted: this thread goes on with the runner, nested calls included
        assert isinstance(r.step(x, y), float)
        assert len(list(r.stream([(x, y)] * 3))) == 3
        assert "loss" in r.evaluate([(x, y)])


@pytest.mark.timeout(90)
def test_two_threads_stepping_at_once_never_crash_the_driver():
    x, y = xy()
    r = runner()
    refused: list[Exception] = []
    done: list[float] = []

    def train():
        for _ in range(15):
            try:
                done.append(r.step(x, y))
            except pipeq.PipelineError as exc:
                assert "not thread-safe" in str(exc)
                refused.append(exc)

    with r:
        threads = [threading.Thread(target=train) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(done) + len(refused) == 30
        assert isinstance(r.step(x, y), float)  # still usable


# -- 3. a stage that dies after READY, before PEERS ----------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("reaped", [True, False], ids=["exited", "socket-gone"])
def test_a_stage_dying_between_ready_and_peers_fails_start_naming_it(monkeypatch, reaped):
    import os
    import signal
    import time

    from pipeq.control import supervisor
    from pipeq.control.startup import StageProcesses

    peers = StageProcesses.peers

    def kill_then_peers(self, ready, joined):  # every stage is READY: stage 1 dies now
        p = self.procs[1]
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        time.sleep(0.3)  # its control socket is gone too
        if not reaped:  # as when the send finds the socket gone before the exit is seen
            monkeypatch.setattr(supervisor.Supervisor, "check_health", lambda self: None)
        return peers(self, ready, joined)

    monkeypatch.setattr(StageProcesses, "peers", kill_then_peers)
    r = runner()
    with pytest.raises(pipeq.PipelineError) as info:
        r.start()
    assert info.value.stage == 1
    assert ("killed by SIGKILL" if reaped else "control socket is gone") in info.value.message
    assert not backend_of(r).procs


# -- 2. the fork server killed mid-run -----------------------------------------------------------
def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: a stage orphaned by its fork server is reaped by init)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(90)
def test_killing_the_fork_server_mid_run_neither_fails_the_run_nor_orphans_its_stages():
    import os
    import signal
    import time

    x, y = xy()
    r = runner(heartbeat_interval=0.1, heartbeat_timeout=5.0)
    r.start()
    pids = [p.pid for p in backend_of(r).procs.values()]
    try:
        r.step(x, y)
        _kill_fork_server()
        time.sleep(0.3)
        assert all(_running(pid) for pid in pids)
        # the stages still run: so does the run (no "exited with code 255")
        for _ in range(3):
            assert isinstance(r.step(x, y), float)
        assert all(p.exitcode is None and p.is_alive() for p in backend_of(r).procs.values())
        r.close()
        end = time.monotonic() + 10
        while any(_running(pid) for pid in pids) and time.monotonic() < end:
            time.sleep(0.05)
        assert not [pid for pid in pids if _running(pid)], "stages outlived close()"
    finally:
        for pid in pids:  # they are no longer this process's descendants: the stray guard cannot see them
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        r.close()


def _kill_fork_server() -> None:
    """SIGKILL this process's fork server and wait until it is gone (multiprocessing reaps it and
    starts a new one when next asked)."""
    import os
    import signal
    import time
    from multiprocessing import forkserver

    server = forkserver._forkserver._forkserver_pid
    os.kill(server, signal.SIGKILL)
    while _running(server):
        time.sleep(0.01)


@pytest.mark.timeout(90)
def test_a_stage_killed_after_the_fork_server_is_named_and_the_others_stopped():
    import os
    import signal
    import time

    x, y = xy()
    r = runner()
    r.start()
    pids = [p.pid for p in backend_of(r).procs.values()]
    try:
        r.step(x, y)
        _kill_fork_server()
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(pipeq.PipelineError) as info:
            for _ in range(50):
                r.step(x, y)
                time.sleep(0.02)
        assert info.value.stage == 1
        end = time.monotonic() + 10
        while any(_running(pid) for pid in pids) and time.monotonic() < end:
            time.sleep(0.05)
        assert not [pid for pid in pids if _running(pid)], "stage 0 outlived the failure"
    finally:
        for pid in pids:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        r.close()


# -- 5. a driver killed by SIGKILL: its fork server's socket directory -------------------------------
KILLED_DRIVER = """
import os, signal, sys, time
import multiprocessing.process as process
from pipeq.control import forkserver
forkserver.start()
print(process.current_process()._config["tempdir"], flush=True)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _mp_dirs(temp: str) -> list[str]:
    """multiprocessing's temporary directories in ``temp`` (torch leaves its own there too)."""
    import os

    return [e for e in os.listdir(temp) if e.startswith(("pymp-", "pipeq-mp-"))]


@pytest.mark.timeout(120)
def test_a_driver_killed_by_sigkill_leaves_no_fork_server_directory_after_the_next_start():
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    from strays import wait_no_strays

    temp = tempfile.mkdtemp(prefix="pq-", dir="/tmp")  # short: a unix socket's path has 107 bytes at most
    env = {**os.environ, "TMPDIR": temp, "PYTHONPATH": os.pathsep.join(sys.path)}

    def driver(how: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", KILLED_DRIVER, how], env=env, capture_output=True,
                              text=True, timeout=60)

    try:
        killed = driver("kill")
        assert killed.returncode == -9, killed.stderr
        left = killed.stdout.strip()
        assert os.path.dirname(left) == temp and _mp_dirs(temp) == [os.path.basename(left)]  # what SIGKILL leaves
        clean = driver("exit")  # the next start removes it; its own goes at its exit
        assert clean.returncode == 0, clean.stderr
        assert _mp_dirs(temp) == []
        assert wait_no_strays(10.0) == []  # (the killed driver's fork server exits once its pipe closes)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
