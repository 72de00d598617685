"""Tied weights across stage processes: ``PipelineRunner(..., ties=[...])`` trains a tied embedding and LM head as one process does.

Stage 0's embedding is stage 2's LM head weight (tests/support/tie_cases.py): each holds a copy,
their gradients are summed over a tie link before every step (after the replicas' all-reduce),
so every copy in every replica stays bitwise equal; the numbers are one process's (and simulated
mode's), clipping counts the tie once, and a checkpoint continues the run exactly.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeq

from tie_cases import ADAM, TIE, TIE3, assert_close, every_copy, lm_batches, lm_stages, reference

pytestmark = pytest.mark.timeout(180)
FAST = dict(start_method="forkserver")


def runner(stages, ties, **kw):
    return pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), ADAM, microbatches=2, ties=ties, **{**FAST, **kw})


def assert_copies_equal(r, n: int) -> None:
    held = every_copy(r)
    assert len(held) == n and all(torch.equal(c, held[0]) for c in held)


def test_1f1b_equals_one_process_and_simulated_and_a_checkpoint_continues_exactly(tmp_path):
    data = lm_batches(6, seed=4)
    losses, states = reference(data, make_opt=ADAM)
    with runner(lm_stages(), [TIE], mode="simulated") as sim:
        sim_losses = [sim.step(x, y) for x, y in data]
    with runner(lm_stages(), [TIE]) as first:
        got = []
        for i, (x, y) in enumerate(data[:3]):
            got.append(first.step(x, y))
            assert_copies_equal(first, 2)
            assert_close(first.state_dict(), states[i])  # the tie once, under its key
        first.save(str(tmp_path / "ckpt"))
        got += list(first.stream(data[3:]))
        assert_copies_equal(first, 2)
        final = first.state_dict()
    assert got == pytest.approx(losses, abs=1e-5)
    assert got == sim_losses  # simulated mode adds in the same order: the same bits
    assert_close(final, states[-1])
    with runner(lm_stages(seed=9), [TIE]) as second:  # other initial weights: the checkpoint replaces them
        second.load(str(tmp_path / "ckpt"))
        assert list(second.stream(data[3:])) == got[3:]  # every copy's optimizer state restored
        assert_copies_equal(second, 2)
        assert_close(second.state_dict(), final, atol=0)


def test_two_replicas_fill_drain_clipped_over_authenticated_tcp_keep_every_copy_equal():
    """R = 2 (six processes), three copies (stage 1's unused: zeros), clip_grad_norm counting the
    tie once; the replicas' and the ties' links both over tcp with a MAC per message."""
    data = lm_batches(4, size=12, seed=6)
    losses, states = reference(data, make_opt=ADAM, spare=True, clip=0.05)
    with runner(lm_stages(spare=True), [TIE3], schedule="fill-drain", data_parallel=2, clip_grad_norm=0.05,
                transport="tcp", tcp_security="authenticate") as r:
        for i, (x, y) in enumerate(data):
            assert r.step(x, y) == pytest.approx(losses[i], abs=1e-5)
            assert_copies_equal(r, 6)
        assert_close(r.state_dict(), states[-1])
