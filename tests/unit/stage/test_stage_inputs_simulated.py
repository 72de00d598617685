"""Stage inputs in simulated mode: the mask and position ids reach the stages that take them, per microbatch,
and training equals one process's; every schedule that can take them does, and the refusals say what to do."""

from __future__ import annotations

import pytest
import torch

import pipeq
from pipeq.stage.info import set_info
from stage_inputs_cases import (SGD, Block, Embed, assert_states_close, batch, flat, forward, reference,
                                ride_through, ride_x, stages, token_loss)

pytestmark = pytest.mark.timeout(120)
DATA = [batch(10, s) for s in range(3)]


def runner(model=None, schedule="1f1b", microbatches=3, **kw):
    return pipeq.PipelineRunner(model if model is not None else stages(), token_loss, SGD, schedule, microbatches,
                                mode="simulated", **kw)


def by_stage(inputs):
    return {1: inputs, 2: dict(inputs)}


@pytest.mark.parametrize("schedule", ["1f1b", "fill-drain"])
@pytest.mark.parametrize("routing", ["names", "stages"])
def test_training_with_stage_inputs_equals_one_process(schedule, routing):
    model, want = reference(stages(), DATA)
    route = (lambda i: i) if routing == "names" else by_stage
    with runner(schedule=schedule) as r:
        got = [r.step(x, y, stage_inputs=route(i)) for x, y, i in DATA]
        state = r.state_dict()
        out = r.predict(DATA[0][0], stage_inputs=route(DATA[0][2]))
    assert got == pytest.approx(want, rel=1e-9)
    assert_states_close(state, flat(model))
    with torch.no_grad():
        torch.testing.assert_close(out, forward(model, DATA[0][0], DATA[0][2]))


def test_recompute_reruns_the_forward_with_the_same_inputs():
    model, want = reference(stages(), DATA)
    with runner(recompute=True) as r:
        got = [r.step(x, y, stage_inputs=i) for x, y, i in DATA]
        assert all(s["recompute"] for s in r.stats())
        state = r.state_dict()
    assert got == pytest.approx(want, rel=1e-9)
    assert_states_close(state, flat(model))


def test_stream_and_evaluate_take_triples():
    model, want = reference(stages(), DATA)
    with runner() as r:
        got = list(r.stream(DATA))
        metrics = r.evaluate(DATA[:2])
        one = r.evaluate(DATA[0])  # one (x, target, stage_inputs) triple is one batch
    assert got == pytest.approx(want, rel=1e-9)
    with torch.no_grad():
        losses = [token_loss(forward(model, x, i), y).item() for x, y, i in DATA[:2]]
    assert metrics["loss"] == pytest.approx(sum(losses) / 2, rel=1e-9)
    assert one["loss"] == pytest.approx(losses[0], rel=1e-9)


def test_stages_that_declare_nothing_take_inputs_by_index_constants_too():
    model, want = reference(stages(declare=False), DATA, scale=0.5)
    with runner(stages(declare=False)) as r:
        got = [r.step(x, y, stage_inputs={k: {**i, "scale": 0.5} for k in (1, 2)}) for x, y, i in DATA]
        state = r.state_dict()
    assert got == pytest.approx(want, rel=1e-9)
    assert_states_close(state, flat(model))


def test_interlock_global_with_stage_inputs_equals_one_process():
    model, want = reference(stages(), DATA)
    with runner(schedule=pipeq.schedules.Interlock("global")) as r:
        got = [r.step(x, y, stage_inputs=i) for x, y, i in DATA]
        state = r.state_dict()
    assert got == pytest.approx(want, rel=1e-9)
    assert_states_close(state, flat(model))


@pytest.mark.parametrize("weight_stashing", [True, False])
def test_async_1f1b_streams_keep_each_batch_inputs_with_it(weight_stashing):
    """Asynchronous 1F1B streams microbatches across batches (the stage does not drain between
    them): with stage inputs it trains as its twin that carries mask and position ids in x."""
    schedule = pipeq.schedules.AsyncOneFOneB(weight_stashing=weight_stashing)
    data = [batch(6, s) for s in range(4)]
    base = stages()
    twin = pipeq.PipelineRunner(ride_through(base), token_loss, SGD, schedule, 3, mode="simulated")
    with twin:
        want = list(twin.stream([(ride_x(x, i), y) for x, y, i in data]))
        want_state = list(twin.state_dict().values())
    with runner(base, schedule=schedule) as r:
        got = list(r.stream(data))
        state = list(r.state_dict().values())
        out = r.predict(data[0][0], stage_inputs=data[0][2])
    assert got == pytest.approx(want, rel=1e-9)
    for a, b in zip(state, want_state, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    assert out.shape == (6, 5, 11)


def test_refusals_name_the_stage_and_the_input_and_the_runner_goes_on():
    x, y, inputs = DATA[0]
    with runner() as r:
        with pytest.raises(ValueError, match=r"stage 1 takes the inputs 'mask', 'pos' \(its pipeq_stage.inputs\), "
                                             "but it is not given"):
            r.step(x, y)
        with pytest.raises(ValueError, match="stage 1 takes the input 'pos'"):
            r.predict(x, stage_inputs={"mask": inputs["mask"]})
        with pytest.raises(ValueError, match=r"stage 1's input mask has shape \(9, 5\), but the batch has 10"):
            r.step(x, y, stage_inputs={**inputs, "mask": inputs["mask"][:9]})
        with pytest.raises(ValueError, match=r"names stage 3, but the pipeline has 3 stages"):
            r.step(x, y, stage_inputs={**by_stage(inputs), 3: inputs})
        with pytest.raises(ValueError, match=r"gives 'position', which no stage declares \(stage 1 takes 'mask', "
                                             r"'pos'; stage 2 takes 'mask', 'pos'\)"):
            r.step(x, y, stage_inputs={**inputs, "position": inputs["pos"]})
        with pytest.raises(ValueError, match=r"stream: a batch is an \(x, target\) pair"):
            list(r.stream([(x, y, inputs, None)]))
        assert r.step(x, y, stage_inputs=inputs) == pytest.approx(reference(stages(), DATA[:1])[1][0], rel=1e-9)


def test_a_stage_declaring_what_its_forward_does_not_take_is_refused_at_once():
    bad = [Embed(), set_info(Block(), inputs=["mask", "pos", "attention_mask"]), Block(head=True)]
    with pytest.raises(ValueError, match=r"stage 1 \(Block\) declares the input 'attention_mask'"):
        runner(bad)


def test_a_forward_that_fails_on_its_inputs_names_them():
    x, y, inputs = DATA[0]
    with runner(stages(declare=False)) as r:
        with pytest.raises(pipeq.PipelineError, match=r"failed on input of shape \(4, 5, 8\) float64, "
                                                      r"mask=\(4, 5\) float64, bogus='text'.*unexpected keyword"):
            r.step(x, y, stage_inputs={1: {"mask": inputs["mask"], "bogus": "text"}})
