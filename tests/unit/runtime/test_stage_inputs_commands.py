"""Stage inputs on the wire: the driver's TRAIN / PREDICT carry each stage's inputs as tensors and a tree,
the worker rebuilds them (pipeq.runtime.batch_command), and a malformed command is refused cleanly."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeq.control.driver import _batch_part, _packed
from pipeq.errors import CodecError
from pipeq.runtime.batch_command import batch_parts
from pipeq.stage import microbatch
from pipeq.tree import TreeError
from pipeq.wire import codec, control
from pipeq.wire.control import ControlError, Predict, Train
from pipeq.wire.messages import Kind, Message

pytestmark = pytest.mark.timeout(30)


def _over_the_wire(msg: Message) -> Message:
    frames = codec.encode(msg.kind, msg.step, msg.microbatch, msg.tensors, msg.extra or None)
    return codec.decode([bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f for f in frames])


def _inputs(n: int = 4) -> dict[str, Any]:
    return {"mask": torch.ones(n, 3), "pos": (torch.arange(n), {"scale": 0.5, "ids": torch.arange(n) * 2}), "k": 7}


def _train(k: int, x: Any, target: Any, inputs: dict[str, Any] | None, *, first: bool, last: bool) -> Message:
    xs, x_tree = microbatch.pack(x)
    ts, t_tree = microbatch.pack(target)
    mine = _packed([inputs], 0, 4)
    part = _batch_part(xs if first else None, x_tree, ts if last else None, t_tree, mine[0] if mine else None)
    train = Train(sizes=[2, 2], weights=[0.5, 0.5], x=part.x, nx=part.nx, inputs=part.inputs,
                  ninputs=part.ninputs, target=part.target)
    return _over_the_wire(control.message(train, 1, 0, part.tensors))


def _equal(a: Any, b: Any) -> None:
    assert microbatch.pack(a)[1] == microbatch.pack(b)[1]
    for s, t in zip(microbatch.pack(a)[0], microbatch.pack(b)[0]):
        assert torch.equal(s, t)


@pytest.mark.parametrize("x", [torch.randn(4, 3), (torch.randn(4, 3), {"m": torch.randn(4)})])
@pytest.mark.parametrize("target", [torch.arange(4), (torch.arange(4), torch.randn(4, 2))])
def test_every_stage_gets_its_inputs_beside_x_and_the_target(x, target):
    for k, (first, last) in enumerate([(True, False), (False, False), (False, True), (True, True)]):
        inputs = _inputs() if k != 1 else None
        msg = _train(k, x, target, inputs, first=first, last=last)
        got = batch_parts(control.read(msg, Train), msg.tensors, k, first, last)
        assert (got.x is None) == (not first) and (got.target is None) == (not last)
        if first:
            _equal(got.x, x)
        if last:
            _equal(got.target, target)
        if inputs is None:
            assert got.inputs is None
        else:
            _equal(got.inputs, inputs)


def test_a_predict_carries_them_too_and_a_replica_gets_its_shard():
    shard = _packed([None, _inputs(6)], 2, 4)
    assert shard[0] is None
    tensors, tree = shard[1]
    assert torch.equal(tensors[1], torch.arange(2, 6))  # samples 2..5 of every tensor, constants kept
    part = _batch_part(None, None, None, None, shard[1])
    msg = _over_the_wire(control.message(Predict(sizes=[4], inputs=part.inputs, ninputs=part.ninputs), 3, 0,
                                         part.tensors))
    got = batch_parts(control.read(msg, Predict), msg.tensors, 1, False, False)
    assert got.inputs["k"] == 7 and got.inputs["pos"][1]["scale"] == 0.5
    assert torch.equal(got.inputs["pos"][1]["ids"], torch.arange(2, 6) * 2)


def _raw(kind: Kind, extra: dict[str, Any], n_tensors: int) -> Message:
    return _over_the_wire(Message(kind, 0, 0, [torch.zeros(2)] * n_tensors, extra))


TRAIN = {"sizes": [1, 1], "weights": [0.5, 0.5]}


def _nested(depth: int) -> list:
    """A constant in ``depth`` nested tuples."""
    tree: list = ["c", 1]
    for _ in range(depth):
        tree = ["t", [tree]]
    return tree


@pytest.mark.parametrize(("extra", "n", "field", "problem"), [
    ({**TRAIN, "inputs": ["d", []]}, 0, "ninputs", "must come with 'inputs' and 'ninputs' both"),
    ({**TRAIN, "ninputs": 1}, 1, "inputs", "must come with 'inputs' and 'ninputs' both"),
    ({**TRAIN, "inputs": ["d", []], "ninputs": 3}, 2, "ninputs", "counts 3 tensors after x's, but the message carries 2"),
    ({**TRAIN, "nx": 1, "inputs": ["d", []], "ninputs": 2}, 2, "ninputs", "counts 2 tensors after x's"),
    ({**TRAIN, "inputs": ["d", []], "ninputs": -1}, 0, "ninputs", ">= 0"),
    ({"sizes": [2], "inputs": ["d", []], "ninputs": 1.5}, 1, "ninputs", "an integer >= 0"),
])
def test_counts_that_do_not_fit_are_refused_on_decode(extra, n, field, problem):
    kind = Kind.TRAIN if "weights" in extra else Kind.PREDICT
    with pytest.raises(ControlError, match=problem) as caught:
        control.decode(_raw(kind, extra, n))
    assert caught.value.field == field


@pytest.mark.parametrize(("tree", "n", "problem"), [
    (["l", [["T", 0]]], 1, "must be a dict of keyword arguments, not a list"),
    (["T", 0], 1, "not a Tensor"),
    (["d", [["not a name", ["T", 0]]]], 1, "identifiers, got 'not a name'"),
    (["d", [["mask", ["T", 5]]]], 1, "refers to tensor 5 of 1"),
    (["d", [["mask", ["T", 0]]]], 2, "uses 1 of the 2 tensors"),
    (["d", [["mask", ["T", 0]], ["pos", ["T", 0]]]], 1, "or twice"),
    (["d", [[1, ["T", 0]]]], 1, "malformed dict entry"),
    (["d", "mask"], 0, "unknown tree node"),
    (["x", []], 0, "unknown tree node 'x'"),
    (["c", {"a": 1}], 0, "tree constant of type dict"),
    (["d", [["a", _nested(40)]]], 0, "deeper than"),
])
def test_a_hostile_inputs_tree_raises_a_clean_error(tree, n, problem):
    msg = _raw(Kind.TRAIN, {**TRAIN, "inputs": tree, "ninputs": n}, n)
    cmd = control.read(msg, Train)
    with pytest.raises(TreeError, match=problem) as caught:
        batch_parts(cmd, msg.tensors, 1, False, False)
    assert isinstance(caught.value, CodecError)


def test_a_stage_tells_the_driver_which_inputs_it_declares():
    ready = control.Ready(forward="f", backward="b", pid=7, device="cpu", replica=0, stage=1, shard=0, threads=1,
                          host="h", cores=[], inputs=["mask", "pos"], layout={})
    got = control.read(_over_the_wire(control.message(ready)), control.Ready)
    assert got.inputs == ["mask", "pos"]
    with pytest.raises(ControlError, match="'inputs' must be a list of strings"):
        control.decode(_raw(Kind.READY, {**control.encode(ready), "inputs": ["mask", 3]}, 0))
