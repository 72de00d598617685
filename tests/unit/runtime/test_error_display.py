"""A stage error leads with the answer: the first line of the formatted exception is the
PipelineError naming the stage and the microbatch; the stage's traceback follows, once, as one
traceback (pipeq.errors.format_remote), with no chained duplicate."""

from __future__ import annotations

import os
import sys
import traceback

import pytest
import torch
from torch import nn

import pipeq
from pipeq.errors import format_remote

from models import Raises


def wrapped() -> BaseException:
    def inner():
        raise ValueError("boom deep down")

    try:
        try:
            inner()
        except ValueError as exc:
            raise RuntimeError(f"forward of microbatch 0 (step 1) failed on input of shape (4, 8): {exc}") from exc
    except RuntimeError as exc:
        return exc


def test_a_wrapper_and_its_cause_are_one_traceback_ending_with_the_cause():
    text = format_remote(wrapped())
    assert text.count("Traceback (most recent call last)") == 1 and "direct cause" not in text
    assert "in inner" in text and text.rstrip().endswith("ValueError: boom deep down")
    assert text.count("forward of microbatch 0") == 0  # that line is the driver's first line, not repeated


def test_other_chains_are_formatted_as_python_does():
    try:
        try:
            raise KeyError("a")
        except KeyError as exc:
            raise ValueError("something else") from exc
    except ValueError as exc:
        assert format_remote(exc) == "".join(traceback.format_exception(exc))


def test_a_stage_error_reads_first_line_first():
    runner = pipeq.PipelineRunner([nn.Linear(8, 8), Raises(8), nn.Linear(8, 3)], nn.CrossEntropyLoss(),
                                  lambda p: torch.optim.SGD(p, lr=0.1), microbatches=4, mode="simulated")
    with runner, pytest.raises(pipeq.PipelineError) as info:
        runner.step(torch.randn(16, 8), torch.randint(0, 3, (16,)))
    shown = "".join(traceback.format_exception(info.value))
    first = traceback.format_exception_only(info.value)[0]
    assert first.startswith("pipeq.errors.PipelineError: stage 1: ") and "forward of microbatch 0" in first
    assert shown.count("Traceback (most recent call last)") == 2  # the caller's line, then the stage's
    assert shown.count("forward of microbatch 0") == 1  # the answer, once
    assert first.splitlines()[0].endswith("float32: ValueError: boom from the stage")  # the cause's own type
    assert shown.count("ValueError: boom from the stage") == 2  # the answer, and the stage traceback's last line
    assert "direct cause" not in shown and "During handling" not in shown
    assert "pipeq/runtime" not in shown.split("--- traceback in stage 1 ---")[0]  # no driver plumbing


def test_an_uncaught_stage_error_is_shown_first_line_first(capsys):
    runner = pipeq.PipelineRunner([nn.Linear(8, 8), Raises(8), nn.Linear(8, 3)], nn.CrossEntropyLoss(),
                                  lambda p: torch.optim.SGD(p, lr=0.1), microbatches=4, mode="simulated")
    with runner, pytest.raises(pipeq.PipelineError) as info:
        runner.step(torch.randn(16, 8), torch.randint(0, 3, (16,)))
    pipeq.errors.excepthook(type(info.value), info.value, info.value.__traceback__)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("pipeq.errors.PipelineError: stage 1: ") and "forward of microbatch 0" in lines[0]
    assert lines[2] == "--- traceback in stage 1 ---" and "ValueError: boom from the stage" in lines
    called = lines[lines.index("--- called from ---"):]
    assert any("test_error_display.py" in line for line in called)  # the caller's own frames...
    assert not any(f"pipeq{os.sep}control" in line for line in called)  # ...not pipeq's plumbing
    assert lines[-1] == lines[0]  # and the answer again where one looks last


def test_other_errors_and_other_hooks_are_left_alone(monkeypatch, capsys):
    seen = []
    pipeq.errors.excepthook(ValueError, ValueError("x"), None, then=lambda *a: seen.append(a[1]))
    wrapped = pipeq.PipelineError("died", stage=0)  # no stage traceback: Python's own display
    pipeq.errors.excepthook(pipeq.PipelineError, wrapped, None, then=lambda *a: seen.append(a[1]))
    assert [type(e) for e in seen] == [ValueError, pipeq.PipelineError] and capsys.readouterr().err == ""
    mine = lambda *a: None  # noqa: E731  (a notebook's or rich's hook)
    monkeypatch.setattr(sys, "excepthook", mine)
    assert pipeq.errors.install_excepthook() is False and sys.excepthook is mine
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    assert pipeq.errors.install_excepthook() is True and sys.excepthook is pipeq.errors.excepthook


def test_a_runner_start_installs_the_hook_and_importing_pipeq_does_not(monkeypatch):
    """``import pipeq`` leaves ``sys.excepthook`` alone (tests/launch/test_console_script.py checks it
    in a fresh interpreter); the first start of a runner installs pipeq's, where Python's is still there."""
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    runner = pipeq.PipelineRunner([nn.Linear(8, 8), nn.Linear(8, 3)], nn.CrossEntropyLoss(),
                                  lambda p: torch.optim.SGD(p, lr=0.1), microbatches=2, mode="simulated")
    assert sys.excepthook is sys.__excepthook__  # building a runner changes nothing
    with runner:
        assert sys.excepthook is pipeq.errors.excepthook
    mine = lambda *a: None  # noqa: E731  (a notebook's hook: left alone)
    monkeypatch.setattr(sys, "excepthook", mine)
    with pipeq.PipelineRunner([nn.Linear(8, 3)], nn.CrossEntropyLoss(), lambda p: torch.optim.SGD(p, lr=0.1),
                              microbatches=2, mode="simulated"):
        assert sys.excepthook is mine
