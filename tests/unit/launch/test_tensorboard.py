"""``pipeq launch``'s TensorBoard event files (pipeq.launch.tensorboard): metrics.jsonl's records as
scalars at the run's steps, read back with TensorBoard's own reader; the key off, the package missing."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from pipeq.launch.tensorboard import INSTALL, Board, stage_times, writer_class

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from launch_util import DIGITS_JOB  # noqa: E402


def _scalars(directory: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in ``directory``'s event files, as TensorBoard shows them: tag -> (step, value)."""
    acc = EventAccumulator(directory, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _line(step: int, **more: float) -> dict:
    """A step's metrics.jsonl line, as the launch loop writes it."""
    return {"step": step, "epoch": 0, "loss": 1.0 / step, "samples_per_s": 100.0 + step,
            "samples_per_s_avg": 50.0 + step, "lr": 0.1, **more}


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if "AsyncWriter" in type(t).__name__]


def _no_tensorboard(monkeypatch) -> None:
    """As if the tensorboard package were not installed: torch.utils.tensorboard cannot be imported."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)


def test_records_become_scalars_at_their_steps(tmp_path) -> None:
    directory = str(tmp_path / "tb")
    board = Board(directory, writer_class(None, print))
    board.start(0)
    assert board.active and _writer_threads()
    for step in range(1, 5):
        board.record(_line(step))
    board.record(_line(5, eval_loss=0.4, eval_accuracy=0.9, eval_top3=0.99))
    board.record({"step": 6, "epoch": 0, "eval_loss": 0.3})  # the data ran out: a last line without a loss
    board.close()
    board.close()  # again: nothing
    assert not board.active and not _writer_threads()  # the writer's thread has ended
    got = _scalars(directory)
    assert got["train/loss"] == [(s, pytest.approx(1.0 / s)) for s in range(1, 6)]
    assert got["train/lr"] == [(s, pytest.approx(0.1)) for s in range(1, 6)]
    # the moving average, as the progress line shows it (not the step's own samples_per_s)
    assert got["train/samples_per_s"] == [(s, pytest.approx(50.0 + s)) for s in range(1, 6)]
    assert got["eval/loss"] == [(5, pytest.approx(0.4)), (6, pytest.approx(0.3))]
    assert got["eval/accuracy"] == [(5, pytest.approx(0.9))]
    assert got["eval/top3"] == [(5, pytest.approx(0.99))]


def test_a_resumed_run_appends_and_hides_the_steps_it_trains_again(tmp_path) -> None:
    """The first attempt reached step 6 but its newest checkpoint is step 3: the next attempt
    (a restart, or --resume) writes a new event file from step 4 on, and TensorBoard shows
    steps 1-3 of the first and 4-7 of the second, with the restart at the step resumed from."""
    directory = str(tmp_path / "tb")
    first = Board(directory, writer_class(True, print))
    first.start(0)
    for step in range(1, 7):
        first.record(_line(step))
    first.close()
    second = Board(directory, writer_class(True, print))
    second.start(3)
    second.record({"restart": 1, "error": "stage 2 died", "stage": 2, "unfinished_step": 7, "step": 3,
                   "resumed_from": 3, "state_from": "disk", "seconds_lost": 2.5})
    for step in range(4, 8):
        second.record(_line(step, loss=10.0 + step))
    second.close()
    assert len(os.listdir(directory)) == 2
    got = _scalars(directory)
    assert got["train/loss"] == [(1, pytest.approx(1.0)), (2, pytest.approx(0.5)), (3, pytest.approx(1 / 3))] + [
        (s, pytest.approx(10.0 + s)) for s in range(4, 8)]
    assert got["run/restarts"] == [(3, 1.0)]
    assert got["run/seconds_lost"] == [(3, pytest.approx(2.5))]


def test_pending_scalars_are_written_out_at_an_evaluation_and_after_a_while(tmp_path, monkeypatch) -> None:
    """A step only queues its line; an evaluation's line writes them out (and flushes the file),
    as does a line once the oldest pending one is WRITE_EVERY_S old."""
    from pipeq.launch import tensorboard

    directory = str(tmp_path / "tb")
    board = Board(directory, writer_class(None, print))
    board.start(0)
    try:
        board.record(_line(1))
        board.record(_line(2))
        assert "train/loss" not in _scalars(directory)  # still pending
        board.record(_line(3, eval_loss=0.5))
        assert [s for s, _ in _scalars(directory)["train/loss"]] == [1, 2, 3]
        monkeypatch.setattr(tensorboard, "WRITE_EVERY_S", -1.0)
        board.record(_line(4))
        assert [s for s, _ in _scalars(directory)["train/loss"]] == [1, 2, 3, 4]
    finally:
        board.close()


def test_the_key_off_writes_nothing(tmp_path) -> None:
    assert writer_class(False, print) is None
    board = Board(str(tmp_path / "tb"), writer_class(False, print))
    board.start(0)
    board.record(_line(1, eval_loss=0.5))
    board.scalars([(1, "bubble/mean", 0.5)])
    board.close()
    assert not board.active and not os.path.exists(tmp_path / "tb")


def test_without_the_package_the_default_says_how_to_get_it_and_true_is_refused(tmp_path, monkeypatch) -> None:
    _no_tensorboard(monkeypatch)
    said: list[str] = []
    assert writer_class(None, said.append) is None  # the default: no event files, no error
    assert len(said) == 1 and INSTALL in said[0] and INSTALL == "pip install pipeq[tensorboard]"
    assert writer_class(False, said.append) is None and len(said) == 1  # off: not even a line
    with pytest.raises(ValueError, match=r"tensorboard = true, but the tensorboard package cannot be imported.*"
                                         r"pip install pipeq\[tensorboard\]"):
        writer_class(True, said.append)


def test_a_job_that_sets_tensorboard_true_without_the_package_is_refused_before_it_starts(tmp_path,
                                                                                          monkeypatch) -> None:
    """Exit code 2 and what to install, before any stage process starts (the run directory holds no run)."""
    import argparse
    import io

    from pipeq.launch.args import add_arguments, job_overrides
    from pipeq.launch.job import load_job
    from pipeq.launch.trainer import Trainer

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = str(tmp_path / "run")
    assert load_job(DIGITS_JOB).tensorboard is None  # not set: written when the package is there
    assert load_job(DIGITS_JOB, job_overrides(parser.parse_args([DIGITS_JOB, "--no-tensorboard"]))).tensorboard is False
    job = load_job(DIGITS_JOB, job_overrides(parser.parse_args([DIGITS_JOB, "--tensorboard", "--out", out])))
    assert job.tensorboard is True
    with pytest.raises(ValueError, match="tensorboard must be a boolean"):
        load_job(DIGITS_JOB, {"tensorboard": "yes"})
    _no_tensorboard(monkeypatch)
    stream = io.StringIO()
    assert Trainer(job, None, stream=stream).run() == 2
    assert "pip install pipeq[tensorboard]" in stream.getvalue()
    assert sorted(os.listdir(out)) == [".lock"]


def test_stage_times_from_a_trace_at_the_runs_steps(tmp_path) -> None:
    """A trace's training steps, numbered from the runner's start, land on the run's steps: its
    last one is the run's last step. Its busy time and bubble per stage, as pipeq report has them."""
    from pipeq.trace import load_trace, planned_trace, save_trace
    from pipeq.trace.report import analyze

    path = save_trace(planned_trace("1f1b", 3, 4), str(tmp_path / "trace.json"))
    rows = stage_times(path, 7)
    step = analyze(load_trace(path)).steps[0]
    expected = [(7, f"busy_ms/stage{s.stage}", s.compute_us / 1e3) for s in step.stages]
    expected += [(7, f"bubble/stage{s.stage}", s.bubble) for s in step.stages] + [(7, "bubble/mean", step.bubble)]
    assert sorted(rows) == sorted(expected)
    assert all(v > 0 for _, tag, v in rows if tag.startswith("busy_ms/")) and 0 < step.bubble < 1

    directory = str(tmp_path / "tb")
    board = Board(directory, writer_class(None, print))
    board.start(6)
    board.scalars(rows)
    board.close()
    got = _scalars(directory)
    assert sorted(got) == sorted(tag for _, tag, _ in rows)
    assert got["bubble/mean"] == [(7, pytest.approx(step.bubble))]
