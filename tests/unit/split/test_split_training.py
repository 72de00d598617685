"""A split model trains like the whole model in one process (simulated mode: every stage in this process)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import pipeq
from split_models import (TinyGPT, assert_state_close, gpt_batch, gpt_runs, lm_loss, pipeline_losses,
                          reference_losses, skip_case, trains_like_one_process)

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
BY_NAME = [["tok_emb", "pos_emb", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "norm", "lm_head"]]
#: the stages each of the two processes holds: V placement puts the tie's copies (stages 0 and 3)
#: in one process, summed in its memory; loop placement puts them in two, summed over a tie link
TWO_PER_PROCESS = {"zbv": [[0, 3], [1, 2]], "dualpipev": [[0, 3], [1, 2]], "interleaved-1f1b": [[0, 2], [1, 3]]}


def _gpt_split(model, how):
    if how == "names":
        return pipeq.split(model, modules=BY_NAME, example_kwargs={"mask": None, "pos": None})
    idx, mask, pos, _ = gpt_batch(2)
    return pipeq.split(model, (idx,), {"mask": mask, "pos": pos}, n_stages=how)


@pytest.fixture(scope="module")
def gpt_split():
    """``how`` -> TinyGPT (seed 0) and its split so, each made once in this module (tracing one
    takes seconds; a runner trains copies of the stages, never the stages themselves)."""
    made = {}

    def get(how):
        if how not in made:
            torch.manual_seed(0)
            model = TinyGPT()
            made[how] = model, _gpt_split(model, how)
        return made[how]
    return get


@pytest.mark.parametrize("schedule", ["1f1b", "fill-drain"])
@pytest.mark.parametrize("how", [2, 4, "names"])
def test_split_gpt_trains_like_one_process(gpt_split, how, schedule):
    """The tie's copies (tok_emb.weight on stage 0, lm_head.weight on the last) the same bits after
    every step; the state holds the tie once, under its first name."""
    model, stages = gpt_split(how)
    runner = pipeq.PipelineRunner(stages, lm_loss, SGD, schedule, 2, mode="simulated")
    trains_like_one_process(runner, stages, model, gpt_runs(), copies=2)


@pytest.mark.parametrize("schedule", list(TWO_PER_PROCESS))
def test_split_gpt_in_4_stages_two_per_process_trains_like_one_process(gpt_split, schedule):
    """The tied GPT in 4 stages under a schedule of two stages per process (4 microbatches:
    dualpipev needs m >= 2N); the copies bitwise equal after every step."""
    assert pipeq.schedules.process_stages(schedule, 4) == TWO_PER_PROCESS[schedule]
    model, stages = gpt_split(4)
    runner = pipeq.PipelineRunner(stages, lm_loss, SGD, schedule, 4, stages_per_process=2, mode="simulated")
    trains_like_one_process(runner, stages, model, gpt_runs(batch=8), copies=2)


def test_a_skip_connection_across_split_points_trains_like_one_process():
    model, batches, stages = skip_case()
    ref = copy.deepcopy(model)
    want = reference_losses(ref, batches, 0.1, named=False)
    with pipeq.PipelineRunner(stages, torch.nn.functional.cross_entropy, SGD, "1f1b", 3, mode="simulated") as runner:
        got = pipeline_losses(runner, batches, named=False)
        assert_state_close(runner.state_dict(), ref)
    assert got == pytest.approx(want, abs=1e-5)


def test_the_model_state_dict_loads_back_with_its_tied_names(gpt_split):
    """runner.load_state_dict takes the whole model's own state_dict (tied names included)."""
    _, stages = gpt_split(2)
    torch.manual_seed(1)
    other = TinyGPT()
    with pipeq.PipelineRunner(stages, lm_loss, SGD, "1f1b", 2, mode="simulated") as runner:
        runner.load_state_dict(other.state_dict())
        assert_state_close(runner.state_dict(), other, atol=0)


def test_model_state_dict_loads_into_the_unsplit_model_strictly(gpt_split, tmp_path):
    _, stages = gpt_split(4)
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
