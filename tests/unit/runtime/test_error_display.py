"""A stage error leads with the answer: the first line of the formatted exception is the
PipelineError naming the stage and the microbatch; the stage's traceback follows, once, as one
traceback (pipeq.errors.format_remote), with no chained duplicate."""

from __future__ import annotations

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
    assert shown.count("ValueError: boom from the stage") == 1  # the stage's own last line, once
    assert "direct cause" not in shown and "During handling" not in shown
    assert "pipeq/runtime" not in shown.split("--- traceback in stage 1 ---")[0]  # no driver plumbing
