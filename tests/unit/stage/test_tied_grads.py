"""Tied weights' arithmetic (pipeq.stage.ties): the ordered sum, a stage's outgoing and summed gradients, and ties that do not match."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeq.stage.info import Tie, set_info
from pipeq.stage.tie_groups import tie_mismatch
from pipeq.stage.ties import TiedGrads
from pipeq.stage.transfer import ordered_sum


def test_the_ordered_sum_is_the_same_bits_on_every_member_and_never_writes_into_its_own_part():
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(1000, generator=g, dtype=torch.float32) * 10 ** e for e in (0, 3, -3, 5)]
    want = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    for mine in range(4):
        fresh = [p.clone() for p in parts]
        own = fresh[mine].clone()
        got = ordered_sum(fresh, mine)
        assert torch.equal(got, want), mine
        assert torch.equal(fresh[mine], own)  # the member's own part is left alone
    # another order of addition gives other bits: the order matters, and every member keeps it
    assert not torch.equal(((parts[3] + parts[2]) + parts[1]) + parts[0], want)
    with pytest.raises(ValueError, match="two or more"):
        ordered_sum(parts[:1], 0)


def _stage(index: int, stages: tuple[int, ...], value: float) -> tuple[nn.Module, TiedGrads]:
    module = nn.Sequential(nn.Linear(3, 2))
    set_info(module, ties=[Tie("0.weight", "0.weight", stages)])
    tied = TiedGrads.of(module, index)
    assert tied is not None
    module[0].weight.grad = None if value is None else torch.full((2, 3), value)
    return module, tied


def test_three_copies_sum_in_stage_order_and_an_unused_copy_adds_zeros():
    stages = (0, 2, 5)
    made = {k: _stage(k, stages, v) for k, v in ((0, 1.0), (2, None), (5, 3.0))}
    # sent: copies, taken before anyone adds (the gradients themselves change)
    outgoing = {k: {p: [t.clone() for t in ts] for p, ts in tied.outgoing().items()} for k, (_, tied) in made.items()}
    assert set(outgoing[0]) == {2, 5} and set(outgoing[2]) == {0, 5}
    assert torch.equal(outgoing[2][0][0], torch.zeros(2, 3))  # the unused copy: zeros
    for k, (module, tied) in made.items():
        received = {peer: [t.clone() for t in outgoing[peer][k]] for peer in tied.peers}
        tied.add(received)
    grads = [made[k][0][0].weight.grad for k in stages]
    assert all(torch.equal(g, torch.full((2, 3), 4.0)) for g in grads)
    assert made[0][1].not_owned() == set() and made[5][1].not_owned() == {id(made[5][0][0].weight)}
    assert made[0][1].rounds == 1


def test_a_peer_sending_the_wrong_gradients_is_named():
    (_, a), (_, b) = _stage(0, (0, 1), 1.0), _stage(1, (0, 1), 1.0)
    a.outgoing()
    with pytest.raises(RuntimeError, match="stage 1 sent 0 tied gradient"):
        a.add({1: []})
    with pytest.raises(RuntimeError, match=r"stage 1 sent tie '0.weight'.s gradient as \[3\]"):
        a.add({1: [torch.zeros(3)]})


def test_a_tie_naming_no_parameter_of_the_stage_is_refused():
    module = nn.Linear(3, 2)
    set_info(module, ties=[Tie("weigth", "0.weight", (0, 1))])
    with pytest.raises(ValueError, match="names 'weigth', which is not a parameter .*did you mean 'weight'"):
        TiedGrads.of(module, 0)
    assert TiedGrads.of(nn.Linear(3, 2), 0) is None


def test_ties_that_the_stages_do_not_name_alike_are_found():
    agree = [{"e": [0, 2]}, {}, {"e": [0, 2]}]
    assert tie_mismatch(agree) is None
    assert tie_mismatch([{"e": [0, 2]}, {}, {}]) == (0, "stage 0 ties 'e' with stages [0, 2], but stage 2 does not hold it")
    assert "ties it with stages [0, 1, 2]" in tie_mismatch([{"e": [0, 2]}, {"e": [0, 1, 2]}, {"e": [0, 1, 2]}])[1]
    assert "without stage 1" in tie_mismatch([{}, {"e": [0, 2]}, {}])[1]
