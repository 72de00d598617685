"""Inputs, outputs and targets that are not one tensor: tuples, lists, dicts and constants.

Microbatches follow torch's chunking rules (tensors split on dim 0, other values replicated); a
tuple output is spread over the next stage's arguments, anything else is its one argument. Every
case trains exactly as the same modules chained in one process.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import pipeq
from inputs_cases import SGD, assert_states_close, batch, reference, stages, two_part_loss
from pipeq.stage import microbatch
from pipeq.errors import PipelineError
from pipeq.tree import MAX_DEPTH, TreeError
from models import flat_state


@pytest.mark.parametrize("schedule", ["fill-drain", "1f1b"])
def test_tuple_and_dict_inputs_outputs_and_targets_equal_single_process_training(schedule):
    data = [batch(10, s) for s in range(3)]  # 10 samples, 4 microbatches: uneven sizes
    model, want = reference(stages(), data)
    runner = pipeq.PipelineRunner(stages(), two_part_loss, SGD, schedule, 4, mode="simulated")
    with runner:
        got = [runner.step(x, t) for x, t in data]
        out = runner.predict(data[0][0])
        state = runner.state_dict()
    assert got == pytest.approx(want, rel=1e-5)
    assert_states_close(state, flat_state(model))
    with torch.no_grad():
        ref_out = model(data[0][0])
    assert set(out) == {"logits", "aux"}
    torch.testing.assert_close(out["logits"], ref_out["logits"])
    torch.testing.assert_close(out["aux"], ref_out["aux"])


def test_a_dict_input_is_the_first_stage_s_one_argument():
    class Pick(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, d):
            return self.lin(d["x"]) * d["w"]

    torch.manual_seed(0)
    first, last = Pick(), nn.Linear(2, 2)
    x = {"x": torch.randn(8, 4), "w": torch.rand(8, 1)}
    y = torch.randint(0, 2, (8,))
    model = copy.deepcopy(nn.ModuleList([first, last]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = nn.functional.cross_entropy(model[1](model[0](x)), y)
    loss.backward()
    opt.step()
    runner = pipeq.PipelineRunner([first, last], nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
                                  microbatches=3, mode="simulated")
    with runner:
        assert runner.step(x, y) == pytest.approx(loss.item(), rel=1e-6)
        state = runner.state_dict()
    torch.testing.assert_close(state["0.lin.weight"], model[0].lin.weight)


def test_chunking_rules_split_tensors_and_replicate_the_rest():
    x = (torch.arange(10).view(5, 2), {"m": torch.arange(5), "k": 3}, [None, "s"])
    parts = microbatch.split(x, [3, 2])
    assert parts[1][0].tolist() == [[6, 7], [8, 9]]
    assert parts[1][1]["m"].tolist() == [3, 4] and parts[1][1]["k"] == 3 and parts[1][2] == [None, "s"]
    joined = microbatch.cat(parts)
    assert torch.equal(joined[0], x[0]) and torch.equal(joined[1]["m"], x[1]["m"]) and joined[2] == [None, "s"]
    tensors, tree = microbatch.pack(x)
    back = microbatch.unpack(tree, tensors)
    assert isinstance(back, tuple) and isinstance(back[2], list) and torch.equal(back[1]["m"], x[1]["m"])


@pytest.mark.parametrize("tree, error", [
    (["T", 1], "tensor 1"),  # a tensor the message does not carry
    (["t", [["T", 0], ["T", 0]]], "twice"),  # the same tensor twice
    (["t", []], "uses 0 of the 1"),  # a tensor left over
    (["x", 0], "unknown tree node"),
    (["c", {"a": 1}], "constant"),
    (["d", [[1, ["T", 0]]]], "dict entry"),
    (["t", [["t", [["t", []]]]]] , "uses 0"),
])
def test_a_malformed_tree_from_a_peer_is_refused(tree, error):
    with pytest.raises(TreeError, match=error):
        microbatch.unpack(tree, [torch.zeros(2)])


def test_a_deeply_nested_tree_is_refused():
    tree: list = ["T", 0]
    for _ in range(MAX_DEPTH + 2):
        tree = ["t", [tree]]
    with pytest.raises(TreeError, match="deeper"):
        microbatch.unpack(tree, [torch.zeros(2)])


@pytest.mark.parametrize("x, error", [
    ((torch.zeros(4, 2), torch.zeros(3, 2)), r"x\[1\] has 3 samples .* but x\[0\] has 4"),
    ({"a": torch.zeros(4), 1: torch.zeros(4)}, "key 1"),
    ((torch.zeros(4), object()), r"x\[1\] is a object"),
    ((1, "a"), "at least one"),
    ({"a": torch.zeros(())}, r"x\['a'\] must have a non-empty batch dimension"),
])
def test_bad_inputs_are_refused_naming_the_part(x, error):
    runner = pipeq.PipelineRunner([nn.Linear(2, 2)], nn.MSELoss(), SGD, mode="simulated")
    with runner, pytest.raises(ValueError, match=error):
        runner.step(x, torch.zeros(4, 2))


def test_research_schedules_take_one_tensor():
    heads = [nn.Linear(4, 2)]
    runner = pipeq.PipelineRunner([nn.Linear(4, 4), nn.Linear(4, 2)], nn.CrossEntropyLoss(), SGD, "local",
                                  aux_heads=heads, mode="simulated")
    with runner, pytest.raises(ValueError, match="takes x as one tensor"):
        runner.step((torch.zeros(4, 4),), torch.zeros(4, dtype=torch.long))


def test_an_unsendable_stage_output_names_itself():
    class Bad(nn.Module):
        def forward(self, x):
            return x, object()

    runner = pipeq.PipelineRunner([Bad(), nn.Linear(2, 2)], nn.MSELoss(), SGD, mode="simulated")
    with runner, pytest.raises(PipelineError, match="stage 0.*is a object"):
        runner.step(torch.zeros(4, 2), torch.zeros(4, 2))
