"""``pipeq launch`` refuses bad input in one line that names it, without a traceback, and before
any process starts where it can be known then: a malformed ``PIPEQ_FAULT`` (before the fork
server), a fault naming a replica the run does not have, a stages function that raises, data
that yields no (x, target) pairs."""

from __future__ import annotations

import pytest

from job_files import MLP, launch_code, write

pytestmark = pytest.mark.timeout(120)


def lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.strip()]


def test_a_malformed_fault_is_refused_before_any_process_starts(tmp_path, monkeypatch, capsys) -> None:
    from pipeq.control import forkserver

    def start(*args, **kwargs):
        raise AssertionError("the fork server started")

    monkeypatch.setattr(forkserver, "start", start)
    monkeypatch.setenv("PIPEQ_FAULT", "stage:1,step:two,kind:kill")
    assert launch_code(write(tmp_path, MLP + f'steps = 2\nout = "{tmp_path / "out"}"\n')) == 2
    err = capsys.readouterr().err
    assert lines(err) == ["pipeq launch: PIPEQ_FAULT='stage:1,step:two,kind:kill': step must be a whole number >= 0, "
                          "got 'two'"], err
    assert not (tmp_path / "out").exists()


def test_a_fault_for_a_replica_the_run_does_not_have_is_refused(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("PIPEQ_FAULT", "stage:1,step:2,kind:kill,replica:5")
    assert launch_code(write(tmp_path, MLP + f'steps = 2\nout = "{tmp_path / "out"}"\n')) == 2
    err = capsys.readouterr().err
    assert "replica 5 does not exist (the run has no replicas (data_parallel = 1))" in err, err
    assert "starting" not in err and "Traceback" not in err, err


def test_a_stages_function_that_raises_is_named_in_one_line(tmp_path, capsys) -> None:
    job = write(tmp_path, MLP.replace("launch_jobs:mlp_stages", "launch_jobs:broken_stages")
                + f'steps = 2\nout = "{tmp_path / "out"}"\n')
    assert launch_code(job) == 2
    err = capsys.readouterr().err
    said = lines(err)
    assert len(said) == 1 and said[0].startswith(
        "pipeq launch: stages = 'launch_jobs:broken_stages' raised FileNotFoundError: weights/encoder.pt: no such "
        "file (at "), err
    assert "launch_jobs.py:" in said[0]


@pytest.mark.parametrize("data", ["unpaired_batches", "unpaired_stream"])
def test_data_that_yields_no_pairs_is_named_in_one_line(tmp_path, capsys, data) -> None:
    from strays import wait_no_strays

    job = write(tmp_path, MLP.replace("launch_jobs:train_batches", f"launch_jobs:{data}")
                + f'steps = 2\nout = "{tmp_path / "out"}"\n')
    code = launch_code(job)
    err = capsys.readouterr().err
    assert wait_no_strays() == []
    said = [ln for ln in lines(err) if "must yield" in ln]
    assert said == [f"pipeq launch: data = 'launch_jobs:{data}' must yield (x, target) pairs, got Tensor "
                    "(epoch 1, batch 0)"], err
    assert "Traceback" not in err, err
    if data == "unpaired_batches":  # a list: refused before any stage starts
        assert code == 2 and "starting" not in err, err
    else:  # a generator: its first batch, once the stages run
        assert code == 1, err


def test_a_refused_launch_leaves_no_fork_server_behind(tmp_path) -> None:
    """A launch refused at once (--out holds another run) ends its fork server and the resource
    tracker with it, not seconds later when the server's imports are done."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from launch_util import ROOT
    from strays import session_left

    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')  # another run's
    job = write(tmp_path, MLP + f'steps = 2\nout = "{out}"\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "support")])}
    with open(tmp_path / "err", "w") as err_file:  # (not a pipe: the fork server would hold it open)
        p = subprocess.Popen([sys.executable, "-m", "pipeq", "launch", job], cwd=ROOT, env=env,
                             start_new_session=True, stdout=subprocess.DEVNULL, stderr=err_file)
    try:
        assert p.wait(timeout=60) == 2
        ended = time.monotonic()
        err = (tmp_path / "err").read_text()
        assert f"{out} holds another run" in err, err
        while session_left(p.pid) and time.monotonic() < ended + 0.5:
            time.sleep(0.02)
        assert session_left(p.pid) == [], "the fork server (or its resource tracker) outlived the launch"
    finally:
        if session_left(p.pid):
            os.killpg(p.pid, signal.SIGKILL)
        if p.poll() is None:
            p.kill()
            p.wait()
