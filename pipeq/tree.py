"""Nested values of tensors and constants (trees): one format, flattened to (tensors, spec) and rebuilt.

A *tree* is a tensor, a constant (None, bool, int, float, str), or a tuple, list or dict (string
keys) of trees. What ``step``, ``stream`` and ``predict`` take as ``x`` and ``target``, what a stage
returns, and the states and snapshots the driver collects are trees. A tree travels as its tensors
(depth-first, dicts in their order, one frame each) plus a *spec*, plain data describing the rest.
The spec has two spellings, written and read by the same two walkers (:func:`flatten`,
:func:`unflatten`):

- :data:`VALUE`, between stages (x, targets, a stage's output): tagged nodes, tuples and lists apart::

      ["T", i] tensor i   ["t", [...]] tuple   ["l", [...]] list   ["d", [[key, node], ...]] dict   ["c", v] constant

- :data:`STATE`, states and snapshots in messages: the tree itself, tuples as lists, and
  ``{"__tensor__": i}`` in place of tensor i (so no dict of a state may use that key).

A spec from a peer is checked as it is rebuilt (every tensor used exactly once, every node well
formed, and in the VALUE spelling at most :data:`MAX_DEPTH` levels and :data:`MAX_NODES` nodes):
a :class:`TreeError` says what is wrong. A tree that cannot be sent raises a ``ValueError`` naming
the part at fault. Python state that is no tree (an optimizer's int keys, a Counter of
milestones) becomes one with :func:`to_plain` and comes back with :func:`from_plain`.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, NamedTuple, Sequence

import torch

from pipeq.errors import CodecError

__all__ = ["CONSTANTS", "MAX_DEPTH", "MAX_NODES", "KEYED", "TreeError", "Spelling", "VALUE", "STATE", "flatten",
           "unflatten", "tensors_of", "map_tensors", "as_args", "to_plain", "from_plain"]

CONSTANTS = (type(None), bool, int, float, str)
MAX_DEPTH = 32
MAX_NODES = 1 << 14
#: How :func:`to_plain` spells a dict whose keys are not all strings: ``{KEYED: [[key, value], ...]}``.
KEYED = "pipeq_keyed_items"
_TENSOR = "__tensor__"


class TreeError(CodecError):
    """A tree's spec from a peer is malformed, or does not match the tensors that came with it."""


#: Where a walker is in a tree: the root's name, or (parent path, index or key), as text on error only.
_Path = Any


def _text(path: _Path) -> str:
    """``path`` as text: ``x[1]['mask']``."""
    keys = []
    while isinstance(path, tuple):
        path, key = path
        keys.append(f"[{key!r}]" if isinstance(key, str) else f"[{key}]")
    return path + "".join(reversed(keys))


class Spelling(NamedTuple):
    """How a spec spells a tree's nodes. The walkers read and write :data:`VALUE`'s tagged nodes;
    another spelling gives ``write`` (a tagged node, its children already written, as this
    spelling's node) and ``read`` (this spelling's node as a tagged one, children as they are),
    a dict key it keeps for itself, and the limits a spec is held to."""

    write: Callable[[list], Any] | None = None
    read: Callable[[Any], list] | None = None
    reserved: str | None = None
    max_depth: int = sys.maxsize
    max_nodes: int = sys.maxsize


def _write_state(node: list) -> Any:
    tag, body = node
    if tag == "T":
        return {_TENSOR: body}
    return dict(body) if tag == "d" else body  # a tuple's or a list's items, or a constant


def _read_state(node: Any) -> list:
    if isinstance(node, dict):
        if len(node) == 1 and _TENSOR in node:
            return ["T", node[_TENSOR]]
        return ["d", [[k, v] for k, v in node.items()]]
    return ["l", node] if isinstance(node, list) else ["c", node]


VALUE = Spelling(max_depth=MAX_DEPTH, max_nodes=MAX_NODES)
#: States hold an entry per parameter and whatever an lr scheduler keeps: no size limits.
STATE = Spelling(write=_write_state, read=_read_state, reserved=_TENSOR)


def flatten(value: Any, name: str = "value", spelling: Spelling = VALUE,
            paths: list[str] | None = None) -> tuple[list[torch.Tensor], Any]:
    """``value``'s tensors (depth-first) and its spec; ``name`` names it in errors ("x"), and
    ``paths``, when given, receives where each tensor is (``x[1]['mask']``)."""
    tensors: list[torch.Tensor] = []
    write, reserved, max_depth = spelling.write, spelling.reserved, spelling.max_depth

    def node(v: Any, path: _Path, depth: int) -> Any:
        if depth > max_depth:
            raise ValueError(f"{_text(path)} is nested more than {max_depth} levels deep")
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            if paths is not None:
                paths.append(_text(path))
            out = ["T", len(tensors) - 1]
        elif isinstance(v, (tuple, list)):
            out = ["t" if isinstance(v, tuple) else "l", [node(e, (path, i), depth + 1) for i, e in enumerate(v)]]
        elif isinstance(v, dict):
            for k in v:
                if not isinstance(k, str):
                    raise ValueError(f"{_text(path)} has the key {k!r}: pipeq passes dicts with string keys only")
                if k == reserved:
                    raise ValueError(f"{_text(path)} has the key {k!r}, which pipeq keeps for tensors: rename it")
            out = ["d", [[k, node(e, (path, k), depth + 1)] for k, e in v.items()]]
        elif isinstance(v, CONSTANTS):
            out = ["c", v]
        else:
            raise ValueError(
                f"{_text(path)} is a {type(v).__name__}: pipeq passes tensors, tuples, lists and dicts of them, "
                "and constants (None, bool, int, float, str)")
        return out if write is None else write(out)

    return tensors, node(value, name, 0)


def unflatten(spec: Any, tensors: Sequence[torch.Tensor], spelling: Spelling = VALUE) -> Any:
    """The tree :func:`flatten` described, checked (a :class:`TreeError` otherwise): every tensor
    is used exactly once, every node is well formed."""
    used = [False] * len(tensors)
    count = 0
    read, max_depth, max_nodes = spelling.read, spelling.max_depth, spelling.max_nodes

    def build(n: Any, depth: int) -> Any:
        nonlocal count
        count += 1
        if depth > max_depth or count > max_nodes:
            raise TreeError(f"tree description deeper than {max_depth} or larger than {max_nodes} nodes")
        if read is not None:
            n = read(n)
        if type(n) is not list or len(n) != 2 or not isinstance(n[0], str):
            raise TreeError(f"malformed tree node {n!r:.80}")
        tag, body = n
        if tag == "T":
            if type(body) is not int or not 0 <= body < len(tensors) or used[body]:
                raise TreeError(f"tree refers to tensor {body!r} of {len(tensors)} (or twice)")
            used[body] = True
            return tensors[body]
        if tag == "c":
            if not isinstance(body, CONSTANTS):
                raise TreeError(f"tree constant of type {type(body).__name__}")
            return body
        if (tag == "t" or tag == "l") and type(body) is list:
            items = [build(e, depth + 1) for e in body]
            return tuple(items) if tag == "t" else items
        if tag == "d" and type(body) is list:
            out = {}
            for item in body:
                if type(item) is not list or len(item) != 2 or not isinstance(item[0], str):
                    raise TreeError(f"malformed dict entry {item!r:.80}")
                out[item[0]] = build(item[1], depth + 1)
            return out
        raise TreeError(f"unknown tree node {tag!r}")

    value = build(spec, 0)
    if not all(used):
        raise TreeError(f"tree uses {sum(used)} of the {len(tensors)} tensors that came with it")
    return value


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors of ``value``, depth-first (dicts in their order); a ValueError if it is no tree."""
    return flatten(value)[0]


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to each tensor (the same containers, constants kept)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(map_tensors(v, fn) for v in value)
    if isinstance(value, list):
        return [map_tensors(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    return value


def as_args(value: Any) -> tuple[Any, ...]:
    """A tree as a stage's arguments: a tuple is spread, anything else is the one argument."""
    return value if isinstance(value, tuple) else (value,)


def to_plain(value: Any) -> Any:
    """Python state as a tree of plain data: detached CPU copies of tensors, tuples as lists, a dict
    whose keys are not all strings (MultiStepLR's milestones, a Counter of ints) as
    ``{KEYED: [[key, value], ...]}``, everything else as is (:func:`from_plain` undoes it)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, (tuple, list)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: to_plain(v) for k, v in value.items()}
        return {KEYED: [[to_plain(k), to_plain(v)] for k, v in value.items()]}
    return value


def from_plain(value: Any) -> Any:
    """:func:`to_plain`'s keyed items back as a dict (list keys as tuples, to be hashable)."""
    if isinstance(value, list):
        return [from_plain(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {KEYED} and isinstance(value[KEYED], list):
            return {tuple(k) if isinstance(k, list) else k: from_plain(v) for k, v in value[KEYED]}
        return {k: from_plain(v) for k, v in value.items()}
    return value
