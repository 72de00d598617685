"""Routing ``stage_inputs`` to the stages (pipeq.control.stage_inputs): by name, by stage, and every refusal."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeq import schedules
from pipeq.control.stage_inputs import batch_item, check_declared, route
from pipeq.stage.info import set_info

ONEF1B = schedules.resolve("1f1b")
DECLARED = [(), ("mask", "pos"), ("mask",)]


def mask(n=4):
    return torch.ones(n, 5)


def test_names_go_to_every_stage_that_declares_them():
    m, p = mask(), torch.zeros(4, 5, dtype=torch.long)
    got = route({"mask": m, "pos": p}, DECLARED, 4, ONEF1B)
    assert got[0] is None and set(got[1]) == {"mask", "pos"} and set(got[2]) == {"mask"}
    assert torch.equal(got[1]["mask"], m) and torch.equal(got[2]["mask"], m) and torch.equal(got[1]["pos"], p)


def test_stage_indices_give_each_stage_its_own():
    got = route({1: {"mask": mask(), "pos": mask()}, 2: {"mask": mask()}}, DECLARED, 4, ONEF1B)
    assert got[0] is None and set(got[1]) == {"mask", "pos"}
    # a stage that declares nothing takes whatever it is given by index (its forward decides)
    got = route({0: {"anything": mask(), "flag": True}}, [(), ()], 4, ONEF1B)
    assert set(got[0]) == {"anything", "flag"} and got[1] is None


def test_nothing_given_and_nothing_declared_sends_nothing():
    assert route(None, [(), ()], 4, ONEF1B) is None
    assert route({}, [(), ()], 4, ONEF1B) is None
    assert route({1: {}}, [(), ()], 4, ONEF1B) is None


def test_trees_and_constants_are_checked_and_kept():
    value = {"a": (mask(), [torch.arange(4)]), "b": None, "c": 0.5, "d": "text"}
    got = route({0: {"tree": value, "k": 3}}, [()], 4, ONEF1B)[0]
    assert got["k"] == 3 and got["tree"]["c"] == 0.5 and got["tree"]["d"] == "text" and got["tree"]["b"] is None
    assert torch.equal(got["tree"]["a"][1][0], torch.arange(4))
    leaf = torch.ones(4, 2, requires_grad=True)
    assert not route({0: {"w": leaf}}, [()], 4, ONEF1B)[0]["w"].requires_grad  # detached, like x


def test_a_declared_input_that_is_not_given_is_named():
    with pytest.raises(ValueError, match=r"stage 1 takes the input 'pos' \(its pipeq_stage.inputs\), but it is not given"):
        route({"mask": mask()}, DECLARED, 4, ONEF1B)
    with pytest.raises(ValueError, match=r"stage 1 takes the inputs 'mask', 'pos'"):
        route(None, DECLARED, 4, ONEF1B)
    with pytest.raises(ValueError, match=r"stage 2 takes the input 'mask'"):
        route({1: {"mask": mask(), "pos": mask()}}, DECLARED, 4, ONEF1B)


def test_a_name_no_stage_declares_lists_who_takes_what():
    with pytest.raises(ValueError, match=r"gives 'maks', which no stage declares \(stage 1 takes 'mask', 'pos'; "
                                         r"stage 2 takes 'mask'\)"):
        route({"maks": mask(), "mask": mask(), "pos": mask()}, DECLARED, 4, ONEF1B)
    with pytest.raises(ValueError, match="no stage declares any input.*stage_inputs=\\{k: \\{name: value\\}\\}"):
        route({"mask": mask()}, [(), ()], 4, ONEF1B)


def test_an_unknown_stage_index_is_refused():
    with pytest.raises(ValueError, match=r"stage_inputs names stage 3, but the pipeline has 3 stages \(0 to 2\)"):
        route({3: {"mask": mask()}}, DECLARED, 4, ONEF1B)
    with pytest.raises(ValueError, match="names stage -1"):
        route({-1: {"mask": mask()}}, DECLARED, 4, ONEF1B)


def test_a_name_a_declaring_stage_does_not_take_is_refused():
    with pytest.raises(ValueError, match=r"stage_inputs\[2\] gives 'pos', but stage 2 declares the inputs 'mask' only"):
        route({1: {"mask": mask(), "pos": mask()}, 2: {"mask": mask(), "pos": mask()}}, DECLARED, 4, ONEF1B)


@pytest.mark.parametrize(("given", "match"), [
    ([mask()], "stage_inputs must be a dict"),
    ({"mask": mask(), 1: {}}, "all input names \\(str\\) or all stage indices \\(int\\)"),
    ({True: {"mask": mask()}}, "all input names"),  # a bool is no stage index
    ({1: mask()}, r"stage_inputs\[1\] must be a dict of stage 1's keyword arguments"),
    ({0: {"not a name": mask()}}, r"stage_inputs\[0\] must be a dict"),
])
def test_malformed_stage_inputs_are_refused(given, match):
    with pytest.raises(ValueError, match=match):
        route(given, [(), ()], 4, ONEF1B)


def test_a_wrong_batch_size_names_the_stage_the_input_and_the_shapes():
    with pytest.raises(ValueError, match=r"stage 1's input mask has shape \(3, 5\), but the batch has 4 samples"):
        route({"mask": mask(3), "pos": mask()}, DECLARED, 4, ONEF1B)
    with pytest.raises(ValueError, match=r"stage 0's input tree\['a'\]\[1\] has shape \(\), but the batch has 4"):
        route({0: {"tree": {"a": [mask(), torch.tensor(1.0)]}}}, [()], 4, ONEF1B)
    with pytest.raises(ValueError, match=r"stage 0's input 'w': w is a object"):
        route({0: {"w": object()}}, [()], 4, ONEF1B)


def test_a_schedule_without_one_forward_per_stage_refuses_them():
    al = schedules.resolve("al")
    with pytest.raises(ValueError, match="schedule 'al' takes no stage_inputs"):
        route({0: {"mask": mask()}}, [(), ()], 4, al)
    assert route(None, [(), ()], 4, al) is None


class Takes(nn.Module):
    def forward(self, h, mask=None):
        return h


class TakesAnything(nn.Module):
    def forward(self, h, **kwargs):
        return h


def test_declared_inputs_must_be_keyword_arguments_of_forward():
    check_declared([set_info(Takes(), inputs=["mask"]), set_info(TakesAnything(), inputs=["pos"])], ONEF1B)
    with pytest.raises(ValueError, match=r"stage 1 \(Takes\) declares the input 'pos' .*takes no keyword argument 'pos'"):
        check_declared([Takes(), set_info(Takes(), inputs=["mask", "pos"])], ONEF1B)
    with pytest.raises(ValueError, match=r"stage 0 declares inputs mask .*schedule 'al' takes no stage_inputs"):
        check_declared([set_info(Takes(), inputs=["mask"])], schedules.resolve("al"))


def test_batches_are_pairs_or_triples():
    x, y = torch.ones(2), torch.ones(2)
    assert batch_item((x, y), "stream") == (x, y, None)
    assert batch_item([x, y, {"m": 1}], "stream")[2] == {"m": 1}
    with pytest.raises(ValueError, match=r"stream: a batch is an \(x, target\) pair or an \(x, target, stage_inputs\) "
                                         r"triple, got a tuple of 4"):
        batch_item((x, y, {}, 1), "stream")
    with pytest.raises(ValueError, match="got a Tensor"):
        batch_item(x, "stream")


def test_pipeq_launch_says_it_takes_no_stage_inputs():
    from types import SimpleNamespace

    from pipeq.launch.data import job_batches

    job = SimpleNamespace(epochs=1, data="jobs:triples", batches=lambda e: [(mask(), mask(), {"mask": mask()})])
    with pytest.raises(ValueError, match=r"must yield \(x, target\) pairs, got tuple \(pipeq launch takes no "
                                         r"stage_inputs: train with runner.stream"):
        list(job_batches(job, 0, 0))
