"""Lengths that change: a traced split trains on batches of other sequence lengths than its example's, in one runner.

A GPT-style model (tests/support/split_models.py's TinyGPT, learned positions of context 48, an
embedding tied to the LM head, a mask and position ids routed to the stages that use them) is
split by ``pipeq.split`` from an example of length 32 and trains on batches of length 32, 24, 40
and 17 in turn, in one runner (the same stage processes), under 1F1B and ZB-H1, in process and
simulated mode, and on one step's microbatches of different lengths; then Hugging Face's ``LlamaForCausalLM`` (tiny, random weights, tied
embeddings, rotary positions) split traced, on lengths 32, 24, 40 and 17, with its padding mask,
then predicts on length 21.
Each run is held against plain one-process training (losses, the state and the whole model's
state, within 1e-5).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import pipeq
from models import reference_train
from split_models import TinyGPT, gpt_batch, lm_loss, trains_like_one_process

pytestmark = pytest.mark.timeout(240)
SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
FAST = dict(start_method="forkserver", threads_per_stage=1)
LENGTHS = (32, 24, 40, 17)


@pytest.fixture(scope="module")
def gpt3():
    """TinyGPT (seed 0, context 48) and its traced split into 3 stages from an example of length
    32, made once for the module (a runner sends copies of the stages, never changes them)."""
    torch.manual_seed(0)
    model = TinyGPT(context=48)
    idx, mask, pos, _ = gpt_batch(2, T=32)
    stages = pipeq.split(model, (idx,), {"mask": mask, "pos": pos}, n_stages=3)
    assert stages.dynamic == {name: {0: (2, None), 1: (2, None)} for name in ("idx", "mask", "pos")}
    assert stages.static == {}
    return model, stages


@pytest.mark.parametrize("mode", ["process", "simulated"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_traced_gpt_trains_on_changing_lengths_like_one_process(gpt3, schedule, mode):
    model, stages = gpt3
    batches = [gpt_batch(4, T=T, seed=20 + i) for i, T in enumerate(LENGTHS)]
    runner = pipeq.PipelineRunner(stages, lm_loss, SGD, schedule, 2, mode=mode, **(FAST if mode == "process" else {}))
    trains_like_one_process(runner, stages, model, batches, copies=2)


@pytest.mark.parametrize("schedule, mode", [("1f1b", "simulated"), ("zb-h1", "process")])
def test_a_traced_gpt_trains_on_microbatches_of_different_lengths_like_one_process(gpt3, schedule, mode):
    """One step's microbatches of lengths 24, 17 and 40 (and 2, 3, 2 rows), given as
    pipeq.Microbatches, twice: as one process computing the mean over the batch's tokens."""
    from torch.nn import functional as F

    model, stages = gpt3
    steps = [[gpt_batch(rows, T=T, seed=10 * s + j) for j, (rows, T) in enumerate([(2, 24), (3, 17), (2, 40)])]
             for s in range(2)]
    def loss_of(net, parts):
        logits = torch.cat([net(i, mask=m, pos=p).flatten(0, 1) for i, m, p, _ in parts])
        return F.cross_entropy(logits, torch.cat([t.flatten() for *_, t in parts]))

    ref = copy.deepcopy(model)
    _, want = reference_train([], None, SGD, steps, model=ref, loss_of=loss_of)
    runner = pipeq.PipelineRunner(stages, lm_loss, SGD, schedule, 3, mode=mode, **(FAST if mode == "process" else {}))
    with runner:
        got = [runner.step(pipeq.Microbatches([(i, t, {"mask": m, "pos": p}) for i, m, p, t in parts]))
               for parts in steps]
        full = runner.model_state_dict()
    assert got == pytest.approx(want, abs=1e-5)
    assert full.keys() == ref.state_dict().keys()
    for name, t in ref.state_dict().items():
        assert torch.allclose(full[name], t, atol=1e-5, rtol=0), (name, (full[name] - t).abs().max())


def _llama_loss(out, target):
    return lm_loss(out.logits, target)


def test_hugging_face_llama_split_traced_trains_on_changing_lengths_like_one_process():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                                      tie_word_embeddings=True, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(5)

    def batch(T):  # right padding: the last rows' ends are masked out
        mask = torch.ones(4, T, dtype=torch.long)
        mask[2:, T - 3:] = 0
        return torch.randint(0, 64, (4, T), generator=g), mask, torch.randint(0, 64, (4, T), generator=g)

    ids, mask, _ = batch(32)
    stages = pipeq.split(model, (ids[:2],), {"attention_mask": mask[:2]}, n_stages=2)
    assert stages.dynamic["input_ids"].keys() == {0, 1} and stages.dynamic["attention_mask"].keys() == {0, 1}
    batches = [batch(T) for T in LENGTHS]
    ref = copy.deepcopy(model)
    _, want = reference_train([], None, functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9), batches,
                              model=ref, loss_of=lambda m, b: _llama_loss(m(b[0], attention_mask=b[1]), b[2]))
    with pipeq.PipelineRunner(stages, _llama_loss, SGD, "zb-h1", 2, **FAST) as runner:
        got = [runner.step(x, y, stage_inputs={"attention_mask": m}) for x, m, y in batches]
        full = runner.model_state_dict()
        x, m, _ = batch(21)  # and a length not trained on, in eval mode (its graph traced apart: dropout)
        logits = runner.predict(x, stage_inputs={"attention_mask": m})["logits"]
    with torch.no_grad():
        want_logits = ref.eval()(x, attention_mask=m).logits
    assert torch.allclose(logits, want_logits, atol=1e-5), (logits - want_logits).abs().max()
    assert got == pytest.approx(want, abs=1e-5)
    assert full.keys() == ref.state_dict().keys()  # no rotary inv_freq: it strict-loads into the model
    for name, t in ref.state_dict().items():
        assert torch.allclose(full[name], t, atol=1e-5, rtol=0), (name, (full[name] - t).abs().max())
