"""A split model trains like the whole model in one process (simulated mode: every stage in this process)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import pipeq
from split_models import (TinyGPT, assert_state_close, gpt_batch, gpt_runs, lm_loss, pipeline_losses,
                          reference_losses, skip_case, tied_copies)

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
BY_NAME = [["tok_emb", "pos_emb", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "norm", "lm_head"]]


def _gpt_split(model, how):
    if how == "names":
        return pipeq.split(model, modules=BY_NAME, example_kwargs={"mask": None, "pos": None})
    idx, mask, pos, _ = gpt_batch(2)
    return pipeq.split(model, (idx,), {"mask": mask, "pos": pos}, n_stages=how)


@pytest.mark.parametrize("schedule", ["1f1b", "fill-drain"])
@pytest.mark.parametrize("how", [2, 4, "names"])
def test_split_gpt_trains_like_one_process(how, schedule):
    torch.manual_seed(0)
    model = TinyGPT()
    stages = _gpt_split(model, how)
    batches = gpt_runs()
    ref = copy.deepcopy(model)
    want = reference_losses(ref, batches, 0.1, named=True)
    runner = pipeq.PipelineRunner(stages, lm_loss, SGD, schedule, 2, mode="simulated")
    seen = []
    with runner:
        got = pipeline_losses(runner, batches, named=True,
                              each_step=lambda r: seen.append(tied_copies(r, stages)))
        state = runner.state_dict()
    assert got == pytest.approx(want, abs=1e-5)
    assert_state_close(state, ref)
    assert "lm_head.weight" not in state and "tok_emb.weight" in state  # the tie once, under its first name
    for copies in seen:  # tok_emb.weight on stage 0, lm_head.weight on the last: the same bits after every step
        assert len(copies) == 2 and torch.equal(copies[0], copies[1])


def test_a_skip_connection_across_split_points_trains_like_one_process():
    model, batches, stages = skip_case()
    ref = copy.deepcopy(model)
    want = reference_losses(ref, batches, 0.1, named=False)
    with pipeq.PipelineRunner(stages, torch.nn.functional.cross_entropy, SGD, "1f1b", 3, mode="simulated") as runner:
        got = pipeline_losses(runner, batches, named=False)
        assert_state_close(runner.state_dict(), ref)
    assert got == pytest.approx(want, abs=1e-5)


def test_the_model_state_dict_loads_back_with_its_tied_names():
    """runner.load_state_dict takes the whole model's own state_dict (tied names included)."""
    torch.manual_seed(0)
    model = TinyGPT()
    stages = _gpt_split(model, 2)
    other = TinyGPT()
    with pipeq.PipelineRunner(stages, lm_loss, SGD, "1f1b", 2, mode="simulated") as runner:
        runner.load_state_dict(other.state_dict())
        assert_state_close(runner.state_dict(), other, atol=0)


def test_model_state_dict_loads_into_the_unsplit_model_strictly(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    stages = _gpt_split(model, 4)
    with pipeq.PipelineRunner(stages, lm_loss, SGD, "1f1b", 2, mode="simulated") as runner:
        pipeline_losses(runner, gpt_runs(1), named=True)
        full = runner.model_state_dict()
        runner.save(str(tmp_path / "ckpt"))
    plain = TinyGPT()
    plain.load_state_dict(full)  # strict: lm_head.weight is there, the same tensor as tok_emb.weight
    assert full["lm_head.weight"] is full["tok_emb.weight"]
    from pipeq.checkpoint.export import model_state
    on_disk = model_state(str(tmp_path / "ckpt"))
    assert sorted(on_disk) == sorted(full) and all(torch.equal(on_disk[k], full[k]) for k in full)
