"""pipeq.split: traced and by-name splits compute the whole model's forward and gradients, under its names."""

from __future__ import annotations

import pickle

import pytest
import torch

import pipeq
from pipeq.split import UntraceableModel
from pipeq.stage.info import info_of
from split_models import SkipNet, TinyGPT, Untraceable, gpt_batch, lm_loss


def _chain(stages, x, named):
    value = (x,)
    for s in stages:
        value = s(*value, **{n: named[n] for n in info_of(s).inputs})
        if not isinstance(value, tuple):
            value = (value,)
    return value[0]


def _check_equal(model, stages, batch, named):
    """Outputs, and every parameter's gradient (tied copies summed), equal the model's."""
    x, target = batch
    ref = lm_loss(model(x, **named), target) if named else torch.nn.functional.cross_entropy(model(x), target)
    ref.backward()
    out = _chain(stages, x, named)
    loss = lm_loss(out, target) if named else torch.nn.functional.cross_entropy(out, target)
    loss.backward()
    assert torch.allclose(loss, ref, atol=1e-6)
    grads: dict[str, torch.Tensor] = {}
    for s in stages:
        ties = {t.name: t.key for t in info_of(s).ties}
        for name, p in s.named_parameters():
            key = ties.get(name, name)
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            grads[key] = grads[key] + g if key in grads else g
    for name, p in model.named_parameters():  # each tensor once, under its first name
        assert torch.allclose(grads[name], p.grad, atol=1e-6), name


@pytest.mark.parametrize("how", [{"n_stages": 2}, {"n_stages": 4}, {"split_points": ["blocks.1", "blocks.3"]}])
def test_traced_gpt_split_equals_the_model(how):
    torch.manual_seed(0)
    model = TinyGPT()
    idx, mask, pos, target = gpt_batch(2)
    stages = pipeq.split(model, (idx,), {"mask": mask, "pos": pos}, **how)
    assert len(stages) == how.get("n_stages", 3)
    idx, mask, pos, target = gpt_batch(5, seed=1)  # another microbatch size than the example's
    _check_equal(model, stages, (idx, target), {"mask": mask, "pos": pos})


def test_traced_stages_keep_the_model_names_and_tie_the_embedding():
    model = TinyGPT()
    idx, mask, pos, _ = gpt_batch(2)
    stages = pipeq.split(model, (idx,), {"mask": mask, "pos": pos}, split_points=["blocks.2"])
    names = set(model.state_dict())
    for s in stages:
        assert info_of(s).model_names and set(s.state_dict()) <= names
    first, last = info_of(stages[0]), info_of(stages[1])
    assert [(t.key, t.stages) for t in first.ties] == [("tok_emb.weight", (0, 1))]
    assert [(t.name, t.key) for t in last.ties] == [("lm_head.weight", "tok_emb.weight")]
    assert set(last.inputs) == {"mask"} and set(first.inputs) == {"mask", "pos"}
    assert torch.equal(stages[0].get_parameter("tok_emb.weight"), stages[1].get_parameter("lm_head.weight"))
    assert stages[0].get_parameter("tok_emb.weight") is not model.tok_emb.weight  # copies: the model is left alone


def test_traced_stages_pickle_and_run_after():
    model = TinyGPT()
    idx, mask, pos, target = gpt_batch(2)
    stages = pickle.loads(pickle.dumps(pipeq.split(model, (idx,), {"mask": mask, "pos": pos}, n_stages=3)))
    with torch.no_grad():
        assert torch.allclose(_chain(stages, idx, {"mask": mask, "pos": pos}), model(idx, mask, pos), atol=1e-6)


def test_a_skip_connection_rides_through_the_stage_between():
    torch.manual_seed(0)
    model = SkipNet()
    x, target = torch.randn(4, 8), torch.randint(0, 3, (4,))
    stages = pipeq.split(model, (x[:2],), split_points=["b", "c"])
    assert len(stages[1].flow.sends) == 2  # c's input and the skip, passed on
    _check_equal(model, stages, (x, target), {})


def test_by_name_split_equals_the_model():
    torch.manual_seed(0)
    model = TinyGPT()
    stages = pipeq.split(model, modules=[["tok_emb", "pos_emb", "blocks.0", "blocks.1"],
                                         ["blocks.2", "blocks.3", "norm", "lm_head"]],
                         example_kwargs={"mask": None, "pos": None})
    assert [sorted(info_of(s).inputs) for s in stages] == [["mask", "pos"], ["mask", "pos"]]
    assert "blocks.2.attn.qkv.weight" in stages[1].state_dict() and "blocks.0.ln1.weight" not in stages[1].state_dict()
    idx, mask, pos, target = gpt_batch(3)
    _check_equal(model, stages, (idx, target), {"mask": mask, "pos": pos})


@pytest.mark.parametrize("modules, message", [
    ([["tok_emb", "blocks.9"]], "has no module 'blocks.9'"),
    ([["tok_emb", "pos_emb", "blocks"], ["blocks.1", "norm", "lm_head"]], "overlaps"),
    ([["tok_emb", "pos_emb", "blocks"], ["norm"]], "no stage holds"),
])
def test_by_name_split_refuses_bad_module_lists(modules, message):
    with pytest.raises(ValueError, match=message):
        pipeq.split(TinyGPT(), modules=modules)


def test_an_untraceable_model_is_refused_with_the_fallback_named():
    with pytest.raises(UntraceableModel, match=r"modules=\[\[") as info:
        pipeq.split(Untraceable(), (torch.randn(2, 4),), n_stages=2)
    assert "Untraceable.forward" in str(info.value)


def test_balance_measures_the_candidate_pieces():
    """balance="time" profiles every candidate piece with pipeq.balance ("memory" takes the same path)."""
    model = TinyGPT(layers=4)
    idx, mask, pos, _ = gpt_batch(2)
    stages = pipeq.split(model, (idx,), {"mask": mask, "pos": pos}, n_stages=3, balance="time")
    assert len(stages) == 3 and len(stages.split_points) == 2
    assert all(p.startswith(("blocks.", "norm", "lm_head", "pos_emb")) for p in stages.split_points)


def test_bad_arguments_say_what_to_pass():
    model = TinyGPT()
    idx, mask, pos, _ = gpt_batch(2)
    with pytest.raises(ValueError, match="batch size 1"):
        pipeq.split(model, (idx[:1],), {"mask": mask[:1], "pos": pos[:1]}, n_stages=2)
    with pytest.raises(ValueError, match="too few for 40 stages"):
        pipeq.split(model, (idx,), {"mask": mask, "pos": pos}, n_stages=40)
    with pytest.raises(ValueError, match="pass n_stages"):
        pipeq.split(model, (idx,), {"mask": mask, "pos": pos})
    with pytest.raises(ValueError, match="did you mean 'lm_head.weight'"):
        pipeq.split(model, (idx,), {"mask": mask, "pos": pos}, n_stages=2, ties=[["tok_emb.weight", "lm_head.weigh"]])


def test_eval_mode_runs_the_graph_traced_in_eval_mode():
    """export fixes dropout's mode into the graph: eval() stages use the eval trace, on the same weights."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    stages = pickle.loads(pickle.dumps(pipeq.split(model, (x,), split_points=["2"])))
    with torch.no_grad():
        for s in stages:
            s.eval()
        model.eval()
        assert torch.equal(_chain(stages, x, {}), model(x))
        with torch.no_grad():
            stages[0].get_parameter("0.weight").mul_(2)  # one set of weights for both graphs
        assert not torch.equal(_chain(stages, x, {}), model(x))
        stages[0].train()
        torch.manual_seed(0)
        dropped = stages[0](x)[0]
        assert (dropped == 0).any()  # training mode drops


class _Positions(torch.nn.Module):
    """Position ids made inside the forward from constants alone (torch.arange)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(5, 4)
        self.pos = torch.nn.Embedding(8, 4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, idx):
        return self.head(self.emb(idx) + self.pos(torch.arange(idx.shape[1])))


def test_a_constant_made_in_the_forward_survives_pickling_and_stays_out_of_the_state():
    model = _Positions()
    idx = torch.randint(0, 5, (2, 6))
    stages = pickle.loads(pickle.dumps(pipeq.split(model, (idx,), split_points=["head"])))
    with torch.no_grad():
        assert torch.allclose(_chain(stages, idx, {}), model(idx), atol=1e-6)
    assert set(stages[0].state_dict()) | set(stages[1].state_dict()) == set(model.state_dict())
