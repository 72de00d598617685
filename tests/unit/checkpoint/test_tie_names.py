"""Names with tied weights and model-named stages (pipeq.checkpoint.names): a tie held once, under its key, from its owner; every copy loads it; a model-named stage's names are global unchanged."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from pipeq.checkpoint import (CheckpointError, global_state, layout_of, load, save, split,
                              split_state, stage_snapshot)
from pipeq.stage.info import Tie, set_info


def tied_stages(key: str = "0.weight") -> list[nn.Module]:
    """Embedding (stage 0, layer 0) tied to the head's weight (stage 2, layer 4): distinct tensors."""
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Embedding(5, 3)), nn.Sequential(nn.Linear(3, 3), nn.Tanh()),
              nn.Sequential(nn.LayerNorm(3), nn.Linear(3, 5, bias=False))]
    set_info(stages[0], ties=[Tie("0.weight", key, (0, 2))])
    set_info(stages[2], ties=[Tie("1.weight", key, (0, 2))])
    return stages


def per_stage(stages):
    return [(list(s.state_dict()), list(s.state_dict().values())) for s in stages]


def test_a_tie_is_held_once_under_its_key_from_its_owner_and_loads_into_every_copy():
    stages = tied_stages()
    layouts = [layout_of(s) for s in stages]
    assert layouts[2].ties == {"1.weight": "0.weight"} and layouts[2].tie_stages == {"0.weight": [0, 2]}
    state = global_state(per_stage(stages), layouts)
    assert list(state) == ["0.weight", "1.weight", "1.bias", "3.weight", "3.bias"]
    assert torch.equal(state["0.weight"], stages[0][0].weight)
    new = dict(state, **{"0.weight": torch.ones(5, 3)})
    parts = split_state(new, layouts)
    assert torch.equal(dict(zip(*parts[0]))["0.weight"], torch.ones(5, 3))
    assert torch.equal(dict(zip(*parts[2]))["1.weight"], torch.ones(5, 3))  # the copy gets the key's tensor
    # the copy's own name may be there (a state of the tied model itself): it is not read
    split_state(dict(new, **{"4.weight": torch.zeros(5, 3)}), layouts)
    with pytest.raises(ValueError, match=r"missing keys \['0.weight'\]"):
        split_state({k: v for k, v in new.items() if k != "0.weight"}, layouts)


def test_the_key_may_be_a_later_stages_name_and_the_owner_still_saves_it():
    stages = tied_stages(key="4.weight")
    with torch.no_grad():
        stages[2][1].weight.fill_(7.0)  # not what is saved: the owner's copy is
    state = global_state(per_stage(stages), [layout_of(s) for s in stages])
    assert "0.weight" not in state and torch.equal(state["4.weight"], stages[0][0].weight.detach())
    assert list(state)[0] == "4.weight"  # at the owner's place


def test_a_model_named_stage_contributes_its_names_unchanged():
    torch.manual_seed(0)
    a = set_info(nn.Sequential(nn.Linear(2, 2)), model_names=True)
    b = nn.Linear(2, 2)
    layouts = [layout_of(a), layout_of(b)]
    assert layouts[0].names_global and not layouts[1].names_global
    state = global_state(per_stage([a, b]), layouts)
    assert list(state) == ["0.weight", "0.bias", "1.weight", "1.bias"]  # b starts after a's one layer
    c = set_info(nn.Sequential(nn.Linear(2, 2)), model_names=True)
    c_named = nn.Module()
    c_named.embed = c
    set_info(c_named, model_names=True)
    assert list(global_state(per_stage([c_named, b]), [layout_of(c_named), layout_of(b)]))[:2] == \
        ["embed.0.weight", "embed.0.bias"]
    back = split_state(state, layouts)
    assert back[0][0] == ["0.weight", "0.bias"]


def test_a_tensor_named_twice_in_one_stage_loads_from_its_first_name():
    torch.manual_seed(0)
    emb, head = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    stage = nn.Sequential(emb, head)
    lay = layout_of(stage)
    assert lay.aliases == {"1.weight": "0.weight"}
    parts = split_state({"0.weight": torch.ones(5, 3)}, [lay])  # held once, as a tied run saves it
    assert parts[0][0] == ["0.weight", "1.weight"] and torch.equal(parts[0][1][1], torch.ones(5, 3))


def _sgd_step(module: nn.Module, grad: float) -> torch.optim.Optimizer:
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    for p in module.parameters():
        p.grad = torch.full_like(p, grad)
    opt.step()
    return opt


def test_a_checkpoint_holds_the_tie_once_and_every_copy_its_own_optimizer_state(tmp_path):
    stages = tied_stages()
    opts = [_sgd_step(s, k + 1.0) for k, s in enumerate(stages)]  # each copy's momentum its own
    with torch.no_grad():
        stages[2][1].weight.copy_(stages[0][0].weight)
    snaps = [stage_snapshot(s, o, rng=False) for s, o in zip(stages, opts)]
    save(str(tmp_path / "c"), snaps, {})
    ckpt = load(str(tmp_path / "c"))
    assert "4.weight" not in ckpt.model and "0.weight" in ckpt.model
    assert {"0.weight", "4.weight"} <= set(ckpt.optim)  # each copy's optimizer state, under its own name
    parts = split(ckpt, [layout_of(s) for s in tied_stages()])
    assert torch.equal(parts[2]["model"]["1.weight"], stages[0][0].weight.detach())
    assert torch.equal(parts[2]["optim"]["1.weight"]["state"]["momentum_buffer"], torch.full((5, 3), 3.0))
    assert torch.equal(parts[0]["optim"]["0.weight"]["state"]["momentum_buffer"], torch.full((5, 3), 1.0))
    # into one stage holding both names of one tensor: the tie loads through the first name
    torch.manual_seed(1)
    emb, lin, norm, head = nn.Embedding(5, 3), nn.Linear(3, 3), nn.LayerNorm(3), nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    one = split(ckpt, [layout_of(nn.Sequential(emb, lin, nn.Tanh(), norm, head))])
    assert torch.equal(one[0]["model"]["4.weight"], stages[0][0].weight.detach())
    assert "4.weight" not in one[0]["optim"] and "0.weight" in one[0]["optim"]
    # a stage that does not hold the tie at all misses it
    with pytest.raises(CheckpointError, match="missing 4.weight"):
        split(ckpt, [layout_of(s) for s in [stages[0], stages[1], nn.Sequential(nn.LayerNorm(3),
                                                                                nn.Linear(3, 5, bias=False))]])
    assert os.path.isdir(tmp_path / "c")
