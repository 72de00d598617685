"""A disk that fills while ``pipeq launch`` appends to metrics.jsonl or TensorBoard's event files
(issue 40, found by bench/bench_chaos.py): said in one line, never a traceback; TensorBoard's
failure does not end the run."""

from __future__ import annotations

import errno
import threading
import types

import pytest

from pipeq.checkpoint import NoSpaceError
from pipeq.launch.metrics import MetricsLog
from pipeq.launch.tensorboard import Board, _quiet_writer_threads


def _full(*_a, **_k):
    raise OSError(errno.ENOSPC, "No space left on device")


class _FullFile:
    write = flush = close = staticmethod(_full)


def test_a_metrics_line_on_a_full_disk_raises_a_no_space_error_naming_the_file(tmp_path):
    log = MetricsLog(str(tmp_path / "metrics.jsonl"))
    with pytest.raises(NoSpaceError) as got:  # (and the close on the way out, failing too, hides it not)
        with log:
            log.write({"step": 1, "loss": 1.0})
            log._file.close()
            log._file = _FullFile()
            log.write({"step": 2, "loss": 0.5})
    text = str(got.value)
    assert "metrics.jsonl" in text and "step 2's metrics" in text and "the lines written before are intact" in text
    assert got.value.path == str(tmp_path / "metrics.jsonl")


class _FullWriter:
    """A SummaryWriter whose event file is on a full disk."""

    closed = False

    def __init__(self, **_kw):
        pass

    add_scalar = flush = staticmethod(_full)

    def close(self):
        type(self).closed = True


def test_tensorboard_on_a_full_disk_says_so_once_and_stops_without_ending_the_run(tmp_path):
    said: list[str] = []
    board = Board(str(tmp_path / "tb"), _FullWriter, said.append)
    board.start(0)
    board.record({"step": 1, "epoch": 0, "loss": 1.0})
    board.record({"step": 2, "epoch": 0, "loss": 1.0, "eval_loss": 0.9})  # written out: fails, not raised
    board.record({"step": 3, "epoch": 0, "loss": 1.0, "restart": 1})
    board.scalars([(3, "stage/0/busy_s", 1.0)])
    board.close()
    assert not board.active and _FullWriter.closed
    assert len(said) == 1 and "No space left on device" in said[0] and "metrics.jsonl has every step" in said[0]


def test_a_failed_event_writer_threads_exception_is_not_printed_and_other_threads_still_are(monkeypatch):
    seen = []
    monkeypatch.setattr(threading, "excepthook", seen.append)  # (what prints a thread's traceback)
    _quiet_writer_threads()
    _quiet_writer_threads()  # (installed once)

    class _AsyncWriterThread(threading.Thread):  # tensorboard's event writer thread's class name
        pass

    for thread in (_AsyncWriterThread(), threading.Thread(name="other")):
        threading.excepthook(types.SimpleNamespace(thread=thread, exc_type=OSError))
    assert [args.thread.name for args in seen] == ["other"]
