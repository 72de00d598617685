"""A dict batch matched to stage 0's forward and the stages' declared inputs (pipeq.control.dict_batch), in the driver."""

from __future__ import annotations

from collections import UserDict

import pytest
import torch
from torch import nn

from pipeq.control.dict_batch import DictBatch
from pipeq.stage.info import set_info


class Takes(nn.Module):
    def forward(self, ids: torch.Tensor, extra=None, mask=None):
        return ids


class TakesADict(nn.Module):
    def forward(self, batch):
        return batch["a"]


def test_keys_go_to_stage_0s_positional_inputs_and_the_declared_stage_inputs():
    first, second = set_info(Takes(), inputs=["mask"]), set_info(Takes(), inputs=["mask"])
    dicts = DictBatch.of([first, second])
    ids, extra, mask = torch.zeros(4, 3), torch.ones(4, 3), torch.ones(4, 3)
    declared = [("mask",), ("mask",)]
    x, given = dicts.match(UserDict({"ids": ids, "mask": mask}), None, declared)  # any Mapping (a BatchEncoding)
    assert x is ids and given == {"mask": mask}
    x, given = dicts.match({"extra": extra, "ids": ids}, {"mask": mask}, declared)  # forward's order
    assert x == (ids, extra) and given == {"mask": mask}
    with pytest.raises(ValueError, match=r"gives 'extra', which stage 0's forward takes after 'ids'"):
        dicts.match({"extra": extra, "mask": mask}, None, declared)
    with pytest.raises(ValueError, match=r"gives 'labels', which no stage takes: stage 0 takes 'ids', 'extra'"):
        dicts.match({"ids": ids, "labels": ids}, None, declared)
    with pytest.raises(ValueError, match="given twice"):
        dicts.match({"ids": ids, "mask": mask}, {"mask": mask}, declared)
    with pytest.raises(ValueError, match="not by stage index"):
        dicts.match({"ids": ids, "mask": mask}, {1: {"mask": mask}}, declared)
    assert dicts.match(ids, {"mask": mask}, declared) == (ids, {"mask": mask})  # not a dict: as it was


def test_a_dict_that_names_no_input_stays_stage_0s_one_argument():
    dicts = DictBatch.of([TakesADict(), TakesADict()])
    batch = {"a": torch.zeros(2, 3)}
    assert dicts.match(batch, None, [(), ()]) == (batch, None)


def test_with_a_recipe_the_one_undeclared_key_is_x():
    dicts = DictBatch.of(None)  # the stages are built in their processes
    ids, mask = torch.zeros(4, 3), torch.ones(4, 3)
    assert dicts.match({"input_ids": ids, "mask": mask}, None, [("mask",), ()]) == (ids, {"mask": mask})
    with pytest.raises(ValueError, match="give x as a tuple"):
        dicts.match({"input_ids": ids, "pos": ids, "mask": mask}, None, [("mask",), ()])
    assert dicts.match({"input_ids": ids}, None, [("mask",), ()]) == ({"input_ids": ids}, None)  # no key known


def test_a_batch_given_as_microbatches_of_dicts_is_matched_microbatch_by_microbatch():
    from pipeq.stage.microbatch import Microbatches

    first, second = set_info(Takes(), inputs=["mask"]), set_info(Takes(), inputs=["mask"])
    dicts = DictBatch.of([first, second])
    declared = [("mask",), ("mask",)]
    ids = [torch.zeros(2, 5), torch.zeros(3, 7)]  # lengths and rows differ
    masks = [torch.ones(2, 5), torch.ones(3, 7)]
    x, given = dicts.match(Microbatches(UserDict({"ids": i, "mask": m}) for i, m in zip(ids, masks)), None, declared)
    assert isinstance(x, Microbatches) and [v is i for v, i in zip(x, ids)] == [True, True]
    assert isinstance(given, Microbatches) and [g["mask"] is m for g, m in zip(given, masks)] == [True, True]
    with pytest.raises(ValueError, match=r"x \(microbatch 1\) is a dict that gives 'labels', which no stage takes"):
        dicts.match(Microbatches([{"ids": ids[0]}, {"ids": ids[1], "labels": ids[1]}]), None, declared)
    plain = Microbatches(ids)
    assert dicts.match(plain, None, declared) == (plain, None)  # no dict in it: as it was
