"""Hugging Face Llama split by module names trains in stage processes on lengths that change, fed dict batches, as one process does; its state strict-loads into the model."""

from __future__ import annotations

import copy
import functools
import time

import pytest
import torch

import pipeq
from hf_models import LLAMA_BY_NAMES, hf_loss, llama_batches, reference_run, tiny_llama

pytestmark = pytest.mark.timeout(240)
transformers = pytest.importorskip("transformers")
SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


@pytest.fixture(scope="module")
def llama_run():
    """Tiny Llama, its split by module names into 2 stages, batches of lengths 16, 12, 20, and
    the one-process reference: its losses and its trained model."""
    model = tiny_llama()
    batches = llama_batches(lengths=(16, 12, 20))
    x, _ = batches[0]
    stages = pipeq.split(model, (x["input_ids"][:2],), {"attention_mask": x["attention_mask"][:2]},
                         modules=LLAMA_BY_NAMES)
    ref = copy.deepcopy(model)
    return stages, batches, reference_run(ref, batches), ref


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_llama_split_by_names_trains_on_changing_lengths_like_one_process(llama_run, schedule):
    stages, batches, want, ref = llama_run
    with pipeq.PipelineRunner(stages, hf_loss, SGD, schedule, 2, start_method="forkserver",
                              threads_per_stage=1) as runner:
        got = [runner.step(transformers.BatchEncoding(x), y) for x, y in batches]
        began = time.monotonic()
        with pytest.raises(ValueError, match="gives 'ids', which no stage takes: stage 0 takes 'input_ids'"):
            runner.step({"ids": batches[0][0]["input_ids"]}, batches[0][1])
        assert time.monotonic() - began < 5  # refused in the driver, no stage asked
        full = runner.model_state_dict()
        out = runner.predict(batches[2][0])
    assert got == pytest.approx(want, abs=1e-5)
    plain = tiny_llama(seed=1)
    plain.load_state_dict(full, strict=True)  # no rotary inv_freq in it; the tied head under both names
    for name, t in ref.state_dict().items():
        assert torch.allclose(plain.state_dict()[name], t, atol=1e-5), name
    assert type(out) is transformers.modeling_outputs.CausalLMOutputWithPast
    with torch.no_grad():
        assert torch.allclose(out.logits, plain(**batches[2][0]).logits, atol=1e-6)
