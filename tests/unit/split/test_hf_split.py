"""Hugging Face models under pipeq.split: Llama split by module names on any length, what such a split refuses, a traced split's state without non-persistent buffers, dict batches and ModelOutputs in a runner, exports that strict-load."""

from __future__ import annotations

import functools
import pickle

import pytest
import torch

import pipeq
from hf_models import LLAMA_BY_NAMES, hf_loss, llama_batches, tiny_llama
from pipeq.split.by_name import Elsewhere
from pipeq.stage.info import info_of

transformers = pytest.importorskip("transformers")
SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.fixture(scope="module")
def by_names(llama):
    x, _ = llama_batches(batch=2)[0]
    return pipeq.split(llama, (x["input_ids"],), {"attention_mask": x["attention_mask"]}, modules=LLAMA_BY_NAMES)


@pytest.fixture(scope="module")
def traced(llama):
    x, _ = llama_batches(batch=2)[0]
    return pipeq.split(llama, (x["input_ids"],), {"attention_mask": x["attention_mask"]}, n_stages=2)


def test_llama_split_by_module_names_computes_the_model_on_any_length(llama, by_names):
    first, last = by_names
    assert isinstance(first.lm_head, Elsewhere) and isinstance(first.model.norm, Elsewhere)
    assert isinstance(last.model.embed_tokens, Elsewhere) and len(last.model.layers) == 4  # each at its index
    assert [isinstance(layer, Elsewhere) for layer in last.model.layers] == [True, True, False, False]
    assert all(type(s.model.rotary_emb).__name__ == "LlamaRotaryEmbedding" for s in by_names)  # kept on every stage
    assert info_of(last).returns is transformers.modeling_outputs.CausalLMOutputWithPast
    names = set(first.state_dict()) | set(last.state_dict())
    assert names == set(llama.state_dict()) and not any("inv_freq" in n for n in names)
    for x, target in llama_batches(lengths=(16, 12, 20), batch=3):
        llama.zero_grad()
        for s in by_names:
            s.zero_grad()
        want = llama(**x)
        hf_loss(want, target).backward()
        hidden = first(x["input_ids"], attention_mask=x["attention_mask"])
        assert isinstance(hidden, torch.Tensor) and hidden.shape == (3, x["input_ids"].shape[1], 32)
        got = last(hidden, attention_mask=x["attention_mask"])
        hf_loss(got, target).backward()
        assert torch.allclose(got.logits, want.logits, atol=1e-6)
        tied = first.model.embed_tokens.weight.grad + last.lm_head.weight.grad
        assert torch.allclose(tied, llama.model.embed_tokens.weight.grad, atol=1e-6)
        for name, p in last.named_parameters():
            if name != "lm_head.weight":
                assert torch.allclose(p.grad, llama.get_parameter(name).grad, atol=1e-6), name


def test_split_by_names_refuses_what_it_cannot_run():
    """At split time, naming the module: a position embedding added after stage 0 (GPT-2), a
    dropout no stage lists, no example, logits soft-capped after the head (Gemma 2: caught by
    the check on the example, as stage 0 caps the hidden state it sends)."""
    ids = torch.randint(0, 64, (2, 8))
    gpt2 = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, use_cache=False,
                                   bos_token_id=0, eos_token_id=0)
    gpt2_names = [["transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0"],
                  ["transformer.h.1", "transformer.ln_f", "lm_head"]]
    with pytest.raises(ValueError, match=r"stage 1 runs GPT2LMHeadModel.forward, which calls 'transformer.wte'"):
        pipeq.split(transformers.GPT2LMHeadModel(gpt2), (ids,), modules=gpt2_names)
    with pytest.raises(ValueError, match=r"no stage lists 'transformer.drop' \(Dropout\(p=0.1"):
        pipeq.split(transformers.GPT2LMHeadModel(gpt2), (ids,),
                    modules=[[m for m in n if m != "transformer.drop"] for n in gpt2_names])
    with pytest.raises(ValueError, match="pass an example input"):
        pipeq.split(tiny_llama(layers=4), modules=LLAMA_BY_NAMES)
    gemma = transformers.Gemma2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=16, intermediate_size=64, use_cache=False,
                                      final_logit_softcapping=3.0)
    with pytest.raises(ValueError, match="do not compute Gemma2ForCausalLM.forward on the example"):
        pipeq.split(transformers.Gemma2ForCausalLM(gemma), (ids,), modules=[
            ["model.embed_tokens", "model.layers.0"], ["model.layers.1", "model.norm", "lm_head"]])


def test_traced_llama_keeps_its_non_persistent_buffers_out_of_its_state(llama, traced):
    """RoPE's inv_freq runs with the stage but is no state of it, also once pickled to a stage process."""
    for stages in (traced, [pickle.loads(pickle.dumps(s)) for s in traced]):
        names = set().union(*(s.state_dict() for s in stages))
        assert names <= set(llama.state_dict()) and not any("inv_freq" in n for n in names)
        assert "model.rotary_emb.inv_freq" in dict(stages[0].named_buffers())


@pytest.mark.parametrize("how", ["traced", "by_names"])
def test_dict_batches_and_model_outputs_in_a_runner(llama, how, request, tmp_path):
    """A dict batch (a BatchEncoding too) is matched to stage 0's input and the stage inputs in the
    driver, or refused there naming the keys; predict returns the model's CausalLMOutputWithPast;
    the exports of a trained run strict-load into a fresh LlamaForCausalLM, with the same logits."""
    stages = request.getfixturevalue(how)
    (x, y), (x2, y2) = llama_batches(lengths=(16, 16), batch=4)
    with pipeq.PipelineRunner(stages, hf_loss, SGD, "1f1b", 2, mode="simulated") as runner:
        out = runner.predict(transformers.BatchEncoding(x))
        assert type(out) is transformers.modeling_outputs.CausalLMOutputWithPast
        with torch.no_grad():
            assert torch.allclose(out.logits, llama(**x).logits, atol=1e-6)
            loss = hf_loss(llama(**x), y).item()
        assert runner.evaluate((transformers.BatchEncoding(x), y)) == {"loss": pytest.approx(loss, abs=1e-6)}
        assert runner.step(transformers.BatchEncoding(x), y) == pytest.approx(loss, abs=1e-6)
        for bad, given, match in [
            ({**x, "labels": y}, None, "gives 'labels'"),
            ({"ids": x["input_ids"], "attention_mask": x["attention_mask"]}, None,
             r"gives 'ids', which no stage takes: stage 0 takes 'input_ids'"),
            ({"input_ids": x["input_ids"]}, None, r"takes the input 'attention_mask'"),
            (x, {"attention_mask": x["attention_mask"]}, "given twice"),
        ]:
            with pytest.raises(ValueError, match=match):
                runner.step(bad, y, stage_inputs=given)
        runner.step(x2["input_ids"], y2, stage_inputs={"attention_mask": x2["attention_mask"]})
        runner.save(str(tmp_path / "ckpt"))
        logits = runner.predict(x).logits
        full = runner.model_state_dict()
    from pipeq.checkpoint.export import export

    export(str(tmp_path / "ckpt"), "pt", str(tmp_path / "model.pt"))
    for state in (full, torch.load(str(tmp_path / "model.pt"), weights_only=True)):
        plain = tiny_llama(seed=1)
        plain.load_state_dict(state, strict=True)
        with torch.no_grad():
            assert torch.equal(plain(**x).logits, logits)


def test_split_by_names_keeps_each_layers_index_for_its_mask():
    """Qwen2 with sliding-window layers: the forward picks layer i's mask by ``config.layer_types[i]``,
    so stage 1's layers 2 and 3 (sliding) must not run as layers 0 and 1 (full). The example (length
    4, the window) cannot tell the masks apart; length 12 can."""
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                                      num_key_value_heads=2, intermediate_size=64, use_sliding_window=True,
                                      sliding_window=4, max_window_layers=2, tie_word_embeddings=True,
                                      use_cache=False)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    assert model.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    first, last = pipeq.split(model, (torch.randint(0, 64, (2, 4)),), modules=LLAMA_BY_NAMES)
    x = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        assert torch.allclose(last.eval()(first.eval()(x)).logits, model(x).logits, atol=1e-5)
