"""pipeq.split's stages in stage processes: a tied GPT (also two stages per process under zbv, dualpipev and interleaved-1f1b), its split by names, a skip net and Hugging Face GPT-2 train as one process does; exports load into the unsplit model.

Each run is held against plain one-process training of the same model (losses and the whole
model's state under its own names, within 1e-5), and the tied embedding's copies (stage 0's
``tok_emb.weight``, the last stage's ``lm_head.weight``) against each other, bit for bit,
after every step, in every replica.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import pipeq
from split_models import (TinyGPT, assert_state_close, gpt_batch, gpt_runs, lm_loss, pipeline_losses,
                          reference_losses, skip_case, tied_copies, trains_like_one_process)

pytestmark = pytest.mark.timeout(240)
SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
FAST = dict(start_method="forkserver", threads_per_stage=1)


def hf_loss(out, target):
    """A Hugging Face model's output is its ModelOutput (the last stage rebuilds it)."""
    return lm_loss(out.logits, target)


def _train_gpt(stages, model, schedule="1f1b", **kw):
    runner = pipeq.PipelineRunner(stages, lm_loss, SGD, schedule, 2, **{**FAST, **kw})
    return runner, trains_like_one_process(runner, stages, model, gpt_runs(), copies=2 * kw.get("data_parallel", 1))


@pytest.fixture(scope="module")
def gpt4():
    """TinyGPT (seed 0) and its traced split into 4 stages, made once for this module's tests
    (tracing takes seconds; a runner sends the stages to its processes, never changes them)."""
    torch.manual_seed(0)
    model = TinyGPT()
    idx, mask, pos, _ = gpt_batch(2)
    return model, pipeq.split(model, (idx,), {"mask": mask, "pos": pos}, n_stages=4)


def test_traced_gpt_in_4_stages_and_its_exports(gpt4, tmp_path):
    model, stages = gpt4
    runner, ref = _train_gpt(stages, model)
    # the checkpoint it saved on the way out is exported in three formats
    with pipeq.PipelineRunner(stages, lm_loss, SGD, "1f1b", 2, mode="simulated") as sim:
        sim.load_state_dict(ref.state_dict())
        sim.save(str(tmp_path / "ckpt"))
    from pipeq.checkpoint.export import export
    import safetensors.torch
    import torch.distributed.checkpoint as dcp

    export(str(tmp_path / "ckpt"), "dcp", str(tmp_path / "dcp"))
    export(str(tmp_path / "ckpt"), "safetensors", str(tmp_path / "m.safetensors"))
    export(str(tmp_path / "ckpt"), "pt", str(tmp_path / "m.pt"))
    for load in ("dcp", "safetensors", "pt"):
        plain = TinyGPT()
        if load == "dcp":
            sd = plain.state_dict()
            dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
            plain.load_state_dict(sd)
        elif load == "safetensors":
            plain.load_state_dict(safetensors.torch.load_file(str(tmp_path / "m.safetensors")))
        else:
            plain.load_state_dict(torch.load(str(tmp_path / "m.pt"), weights_only=True))
        for name, t in ref.state_dict().items():
            assert torch.equal(plain.state_dict()[name], t), (load, name)


@pytest.mark.parametrize("replicas", [1, 2])
def test_traced_gpt_in_4_stages_two_per_process_under_zbv_dualpipev_and_interleaved(gpt4, replicas):
    """Two stages per process (4 microbatches: dualpipev needs m >= 2N). V placement (zbv,
    dualpipev) puts the tie's copies, stages 0 and 3, in one process: summed in its memory, no tie
    link; loop placement (interleaved-1f1b: stages 0 and 2, 1 and 3) in two: over tie links."""
    model, stages = gpt4
    for schedule, held in {"zbv": [[0, 3], [1, 2]], "dualpipev": [[0, 3], [1, 2]],
                           "interleaved-1f1b": [[0, 2], [1, 3]]}.items():
        def placed(runner, held=held):
            for r in range(replicas):
                info = {w["stage"]: w for w in runner.stage_processes if w["replica"] == r}
                pids = {w["pid"] for w in info.values()}
                assert sorted(sorted(k for k in info if info[k]["pid"] == pid) for pid in pids) == held
                across = [0, 3] not in held
                assert all((info[k].get("tie_link") is not None) == across for k in (0, 3)), (schedule, info)
                assert info[1].get("tie_link") is None and info[2].get("tie_link") is None

        runner = pipeq.PipelineRunner(stages, lm_loss, SGD, schedule, 4, stages_per_process=2, data_parallel=replicas,
                                      **FAST)
        trains_like_one_process(runner, stages, model, gpt_runs(batch=8), copies=2 * replicas, while_running=placed)


def test_traced_gpt_in_2_stages_with_2_replicas():
    torch.manual_seed(0)
    model = TinyGPT()
    idx, mask, pos, _ = gpt_batch(2)
    stages = pipeq.split(model, (idx,), {"mask": mask, "pos": pos}, n_stages=2)
    _train_gpt(stages, model, "fill-drain", data_parallel=2)


def test_gpt_split_by_module_names():
    torch.manual_seed(0)
    model = TinyGPT()
    stages = pipeq.split(model, modules=[["tok_emb", "pos_emb", "blocks.0", "blocks.1"],
                                         ["blocks.2", "blocks.3", "norm", "lm_head"]],
                         example_kwargs={"mask": None, "pos": None})
    _train_gpt(stages, model)


def test_a_skip_connection_across_two_split_points():
    model, batches, stages = skip_case()
    ref = copy.deepcopy(model)
    want = reference_losses(ref, batches, 0.1, named=False)
    with pipeq.PipelineRunner(stages, torch.nn.functional.cross_entropy, SGD, "1f1b", 3, **FAST) as runner:
        assert pipeline_losses(runner, batches, named=False) == pytest.approx(want, abs=1e-5)
        assert_state_close(runner.state_dict(), ref)


def test_hugging_face_gpt2_splits_and_trains_like_one_process():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=4, n_head=2, use_cache=False,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randint(0, 64, (4, 12), generator=g), torch.randint(0, 64, (4, 12), generator=g))
               for _ in range(3)]
    stages = pipeq.split(model, (batches[0][0][:2],), n_stages=2)
    assert model.lm_head.weight is model.transformer.wte.weight
    ref = copy.deepcopy(model)
    want = reference_losses(ref, batches, 0.1, named=False, loss_fn=hf_loss)  # SGD lr 0.1, momentum 0.9, as SGD
    with pipeq.PipelineRunner(stages, hf_loss, SGD, "1f1b", 2, **FAST) as runner:
        got = [runner.step(x, y) for x, y in batches]
        full = runner.model_state_dict()
        assert tied_copies(runner, stages)[0].equal(tied_copies(runner, stages)[1])
        out = runner.predict({"input_ids": batches[0][0]})  # a dict batch, matched to forward's input_ids
    assert got == pytest.approx(want, abs=1e-5)
    plain = transformers.GPT2LMHeadModel(config)
    plain.load_state_dict(full, strict=True)  # the model's own names, the tied head included
    for name, t in ref.state_dict().items():
        assert torch.allclose(plain.state_dict()[name], t, atol=1e-5), name
    assert type(out) is transformers.modeling_outputs.CausalLMOutputWithCrossAttentions  # what the model returns
    with torch.no_grad():
        assert torch.allclose(out.logits, plain(batches[0][0]).logits, atol=1e-6)
        assert torch.allclose(out.logits, ref(batches[0][0]).logits, atol=1e-5)
