"""Values that are not one tensor: tuples, lists and dicts of tensors and constants.

What ``step``, ``stream`` and ``predict`` take as ``x`` and ``target``, and what a stage may
return, is a *tree*: a tensor, a tuple / list / dict (string keys) of trees, or a constant
(None, bool, int, float, str). Splitting a batch follows torch's chunking rules, as
torch.distributed.pipelining does: every tensor splits on dim 0, every other value is
replicated into each microbatch::

    x = (tokens [8, 16], {"mask": [8, 16]}, 0.5)        two microbatches of 4:
      -> (tokens[0:4], {"mask": mask[0:4]}, 0.5),  (tokens[4:8], {"mask": mask[4:8]}, 0.5)

How a stage is called: a tuple is spread over the stage's arguments (``stage(*value)``),
anything else is its one argument (a dict arrives as one dict).

Between processes a tree travels as its tensors (one frame each, depth-first in order) plus a
plain-data description (:func:`pack` / :func:`unpack`), which the receiver checks like every
other header field. A stage output that is a tensor or a tuple of tensors needs no description:
the hot path stays a bare list of tensors.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from pipeq.wire.messages import TreeError

CONSTANTS = (type(None), bool, int, float, str)
MAX_DEPTH = 32
MAX_NODES = 1 << 14


class Packed(tuple):
    """The tensors of a tree, depth-first, with its description (``tree``; None: the tensors
    are the value itself, spread over the next stage's arguments)."""

    tree: Any = None

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], tree: Any) -> "Packed | tuple[torch.Tensor, ...]":
        if tree is None:
            return tuple(tensors)
        out = cls(tensors)
        out.tree = tree
        return out


def tree_of(tensors: Sequence[torch.Tensor]) -> Any:
    """The description that travels with ``tensors`` (None for a bare tuple)."""
    return getattr(tensors, "tree", None)


def rewrap(like: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """``tensors`` with ``like``'s description (after a copy or a move of its tensors)."""
    return Packed.of(tensors, tree_of(like))


# -- checking and walking ---------------------------------------------------------------------
def _walk(value: Any, path: str, on_tensor: Callable[[str, torch.Tensor], None], depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        raise ValueError(f"{path} is nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, torch.Tensor):
        on_tensor(path, value)
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            _walk(v, f"{path}[{i}]", on_tensor, depth + 1)
    elif isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{path} has the key {k!r}: pipeq passes dicts with string keys only")
            _walk(v, f"{path}[{k!r}]", on_tensor, depth + 1)
    elif not isinstance(value, CONSTANTS):
        raise ValueError(
            f"{path} is a {type(value).__name__}: pipeq passes tensors, tuples, lists and dicts of them, "
            "and constants (None, bool, int, float, str)")


def check(name: str, value: Any) -> tuple[Any, int]:
    """``value`` as a tree of detached CPU tensors, and its batch size: every tensor has the
    same non-empty dim 0. A ValueError names the part at fault."""
    seen: list[tuple[str, int]] = []

    def on_tensor(path: str, t: torch.Tensor) -> None:
        if t.dim() == 0 or t.shape[0] == 0:
            raise ValueError(f"{path} must have a non-empty batch dimension, got shape {tuple(t.shape)}")
        if seen and t.shape[0] != seen[0][1]:
            raise ValueError(f"{path} has {t.shape[0]} samples (shape {tuple(t.shape)}) but {seen[0][0]} "
                             f"has {seen[0][1]}: every tensor of a batch splits on dim 0")
        seen.append((path, t.shape[0]))

    _walk(value, name, on_tensor)
    if not seen:
        raise ValueError(f"{name} must be a torch.Tensor, or a tuple, list or dict holding at least one, "
                         f"got {type(value).__name__}")
    return map_tensors(value, lambda t: t.detach().cpu()), seen[0][1]


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


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors of ``value``, depth-first (dicts in their order)."""
    out: list[torch.Tensor] = []
    _walk(value, "value", lambda _, t: out.append(t))
    return out


def to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):  # the common case, without a walk
        return value.to(device, non_blocking=True)
    return map_tensors(value, lambda t: t.to(device, non_blocking=True))


# -- splitting and joining ----------------------------------------------------------------------
def narrow(value: Any, start: int, length: int) -> Any:
    """Samples ``start .. start + length`` of every tensor (constants kept)."""
    if isinstance(value, torch.Tensor):
        return value[start:start + length]
    return map_tensors(value, lambda t: t[start:start + length])


def split(value: Any, sizes: Sequence[int]) -> list[Any]:
    """``value`` as microbatches of ``sizes`` samples (torch's chunking rules)."""
    if isinstance(value, torch.Tensor):
        return list(value.split(list(sizes)))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [narrow(value, s, n) for s, n in zip(starts, sizes)]


def cat(values: Sequence[Any]) -> Any:
    """Microbatch results joined again: tensors concatenated on dim 0, constants from the first."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(values))
    if isinstance(first, (tuple, list)):
        out = [cat([v[i] for v in values]) for i in range(len(first))]
        return tuple(out) if isinstance(first, tuple) else out
    if isinstance(first, dict):
        return {k: cat([v[k] for v in values]) for k in first}
    return first


def as_args(value: Any) -> tuple[Any, ...]:
    """A stage's arguments: a tuple is spread, anything else is the one argument."""
    return value if isinstance(value, tuple) else (value,)


# -- the wire description -------------------------------------------------------------------------
# ["T", i] tensor i   ["t", [...]] tuple   ["l", [...]] list   ["d", [[key, node], ...]] dict   ["c", v] constant
def pack(value: Any) -> tuple[list[torch.Tensor], Any]:
    """``value`` as its tensors and a plain-data description (None: a lone tensor)."""
    if isinstance(value, torch.Tensor):
        return [value], None
    tensors: list[torch.Tensor] = []

    def node(v: Any, path: str, depth: int) -> Any:  # one walk: described and checked at once
        if depth > MAX_DEPTH:
            raise ValueError(f"{path} is nested more than {MAX_DEPTH} levels deep")
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return ["T", len(tensors) - 1]
        if isinstance(v, (tuple, list)):
            return ["t" if isinstance(v, tuple) else "l",
                    [node(e, f"{path}[{i}]", depth + 1) for i, e in enumerate(v)]]
        if isinstance(v, dict):
            for k in v:
                if not isinstance(k, str):
                    raise ValueError(f"{path} has the key {k!r}: pipeq passes dicts with string keys only")
            return ["d", [[k, node(e, f"{path}[{k!r}]", depth + 1)] for k, e in v.items()]]
        if not isinstance(v, CONSTANTS):
            raise ValueError(
                f"{path} is a {type(v).__name__}: pipeq passes tensors, tuples, lists and dicts of them, "
                "and constants (None, bool, int, float, str)")
        return ["c", v]

    return tensors, node(value, "value", 0)


def pack_output(out: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
    """A stage's output as (tensors, description); a tensor or a tuple of tensors needs none."""
    if isinstance(out, torch.Tensor):
        return (out,), None
    if isinstance(out, tuple) and all(isinstance(t, torch.Tensor) for t in out):
        return out, None
    tensors, tree = pack(out)
    return tuple(tensors), tree


def unpack(tree: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """The value :func:`pack` described; every tensor used exactly once (TreeError otherwise).
    ``tree`` None: the tensors themselves (a tuple)."""
    if tree is None:
        return tuple(tensors)
    used = [False] * len(tensors)
    count = [0]

    def build(n: Any, depth: int) -> Any:
        count[0] += 1
        if depth > MAX_DEPTH or count[0] > MAX_NODES:
            raise TreeError(f"tree description deeper than {MAX_DEPTH} or larger than {MAX_NODES} nodes")
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
        if tag in ("t", "l") and type(body) is list:
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

    value = build(tree, 0)
    if not all(used):
        raise TreeError(f"tree uses {sum(used)} of the {len(tensors)} tensors that came with it")
    return value


def unpack_input(tree: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """x or a target sent with :func:`pack`: a lone tensor when ``tree`` is None."""
    if tree is None:
        if len(tensors) != 1:
            raise TreeError(f"{len(tensors)} tensors without a tree description")
        return tensors[0]
    return unpack(tree, tensors)
