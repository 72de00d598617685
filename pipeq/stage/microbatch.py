"""Batches of trees split into microbatches and joined again, and trees as a stage's inputs and outputs.

What ``step``, ``stream`` and ``predict`` take as ``x`` and ``target``, and what a stage may
return, is a tree (:mod:`pipeq.tree`): a tensor, a tuple / list / dict (string keys) of trees, or
a constant (None, bool, int, float, str). Splitting a batch follows torch's chunking rules, as
torch.distributed.pipelining does: every tensor splits on dim 0, every other value is
replicated into each microbatch::

    x = (tokens [8, 16], {"mask": [8, 16]}, 0.5)        two microbatches of 4:
      -> (tokens[0:4], {"mask": mask[0:4]}, 0.5),  (tokens[4:8], {"mask": mask[4:8]}, 0.5)

How a stage is called: a tuple is spread over the stage's arguments (``stage(*value)``,
:func:`pipeq.tree.as_args`), anything else is its one argument (a dict arrives as one dict).

A batch may also come already split (:class:`Microbatches`): each microbatch its own tree, so
microbatches of one step may differ in length (tokens per row) and in rows. Splitting it hands
its microbatches back as they are; a replica's shard is a run of whole microbatches.

Between processes a tree travels as its tensors plus its spec in the VALUE spelling
(:func:`pack` / :func:`unpack`), which the receiver checks like every other header field. A stage
output that is a tensor or a tuple of tensors needs no spec: the hot path stays a bare list of
tensors.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from pipeq.tree import TreeError, flatten, map_tensors, unflatten

__all__ = ["Microbatches", "rows", "Packed", "spec_of", "rewrap", "describe", "check", "to_device", "narrow", "shard",
           "split", "cat", "pack", "pack_output", "unpack", "unpack_input", "unpack_kwargs"]


class Microbatches(list):
    """A batch given as its microbatches, already split: ``Microbatches([x0, x1, x2])``, each
    item one microbatch's tree (what a whole batch may be: a tensor, a tuple / list / dict...).

    Its microbatches may differ in everything but their structure: lengths (a sequence dimension)
    and rows (dim 0). ``runner.step(Microbatches(xs), Microbatches(ys))`` takes x and the target
    so, item by item (``stage_inputs=Microbatches([{"mask": m0}, ...])`` likewise), or
    ``runner.step(Microbatches([(x0, y0), (x1, y1)]))`` as pairs or ``(x, target, stage_inputs)``
    triples, the target left out (``step`` takes a plain list of them too; ``stream`` and
    ``evaluate`` batches are either form). A step holds 1 to ``microbatches`` of them (with
    ``data_parallel=R``: R times that, replica r taking the r-th run of them), each run as it
    is given; each microbatch's loss is weighted by its tokens or rows, as ``loss_weighting``
    says. ``predict(Microbatches(xs))`` (1 to ``microbatches``: it runs on one replica) returns
    one output per microbatch, a Microbatches too.
    A plain list stays a tree (several inputs of one batch): only this type says "already split"."""

    def __repr__(self) -> str:
        return f"Microbatches({list.__repr__(self)})"


def rows(value: Any) -> int:
    """A checked tree's batch size: dim 0 of its first tensor."""
    return int(value.shape[0]) if isinstance(value, torch.Tensor) else int(flatten(value)[0][0].shape[0])


class Packed(tuple):
    """The tensors of a tree, depth-first, with its spec (``spec``; None: the tensors are the
    value itself, spread over the next stage's arguments)."""

    spec: Any = None

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], spec: Any) -> "Packed | tuple[torch.Tensor, ...]":
        if spec is None:
            return tuple(tensors)
        out = cls(tensors)
        out.spec = spec
        return out


def spec_of(tensors: Sequence[torch.Tensor]) -> Any:
    """The spec that travels with ``tensors`` (None for a bare tuple)."""
    return getattr(tensors, "spec", None)


def rewrap(like: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """``tensors`` with ``like``'s spec (after a copy or a move of its tensors)."""
    return Packed.of(tensors, spec_of(like))


def describe(tensors: Sequence[torch.Tensor]) -> str:
    """Shapes and dtypes of ``tensors`` for an error message: ``"(4, 8) float32, (4,) int64"``."""
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in tensors)


def check(name: str, value: Any) -> tuple[Any, int]:
    """``value`` as a tree of detached CPU tensors, and its batch size: every tensor has the
    same non-empty dim 0. A ValueError names the part at fault. Of a batch given as
    :class:`Microbatches`, each microbatch is checked so (and named), and the batch size is
    their rows together."""
    if isinstance(value, Microbatches):
        if not value:
            raise ValueError(f"{name} is an empty Microbatches: give at least one microbatch")
        checked = [check(f"{name} (microbatch {j})", v) for j, v in enumerate(value)]
        return Microbatches(v for v, _ in checked), sum(n for _, n in checked)
    tensors = flatten(value, name)[0]
    if not tensors:
        raise ValueError(f"{name} must be a torch.Tensor, or a tuple, list or dict holding at least one, "
                         f"got {type(value).__name__}")
    n = tensors[0].shape[0] if tensors[0].dim() else 0
    if n == 0 or any(t.dim() == 0 or t.shape[0] != n for t in tensors):
        _name_the_misfit(name, value)
    return map_tensors(value, lambda t: t.detach().cpu()), n


def _name_the_misfit(name: str, value: Any) -> None:
    """Raise the ValueError :func:`check` found, naming the tensor at fault."""
    paths: list[str] = []
    tensors = flatten(value, name, paths=paths)[0]
    for path, t in zip(paths, tensors):
        if t.dim() == 0 or t.shape[0] == 0:
            raise ValueError(f"{path} must have a non-empty batch dimension, got shape {tuple(t.shape)}")
        if t.shape[0] != tensors[0].shape[0]:
            raise ValueError(f"{path} has {t.shape[0]} samples (shape {tuple(t.shape)}) but {paths[0]} "
                             f"has {tensors[0].shape[0]}: every tensor of a batch splits on dim 0")


def to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):  # the common case, without a walk
        return value.to(device, non_blocking=True)
    if isinstance(value, Microbatches):
        return Microbatches(to_device(v, device) for v in value)
    return map_tensors(value, lambda t: t.to(device, non_blocking=True))


# -- splitting and joining ----------------------------------------------------------------------
def narrow(value: Any, start: int, length: int) -> Any:
    """Samples ``start .. start + length`` of every tensor (constants kept)."""
    if isinstance(value, Microbatches):
        raise TypeError("a batch given as Microbatches is cut by microbatch (shard()), not by sample")
    if isinstance(value, torch.Tensor):
        return value[start:start + length]
    return map_tensors(value, lambda t: t[start:start + length])


def shard(value: Any, start: int, length: int, first: int, count: int | None) -> Any:
    """A replica's part of a batch: samples ``start .. start + length``, or, of a batch given as
    :class:`Microbatches`, microbatches ``first .. first + count`` (None: to the last)."""
    if isinstance(value, Microbatches):
        return Microbatches(value[first:first + count if count is not None else None])
    return narrow(value, start, length)


def split(value: Any, sizes: Sequence[int]) -> list[Any]:
    """``value`` as microbatches of ``sizes`` samples (torch's chunking rules); a batch given as
    :class:`Microbatches` is its microbatches (one per size)."""
    if isinstance(value, Microbatches):
        if len(value) != len(sizes):
            raise ValueError(f"{len(value)} microbatches given for a step of {len(sizes)}")
        return list(value)
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


# -- the wire ---------------------------------------------------------------------------------------
def pack(value: Any) -> tuple[list[torch.Tensor], Any]:
    """``value`` as its tensors and its spec (None: a lone tensor)."""
    if isinstance(value, torch.Tensor):
        return [value], None
    return flatten(value)


def pack_output(out: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
    """A stage's output as (tensors, spec); a tensor or a tuple of tensors needs none."""
    if isinstance(out, torch.Tensor):
        return (out,), None
    if isinstance(out, tuple) and all(isinstance(t, torch.Tensor) for t in out):
        return out, None
    tensors, spec = flatten(out)
    return tuple(tensors), spec


def unpack(spec: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """The value :func:`pack` described; every tensor used exactly once (TreeError otherwise).
    ``spec`` None: the tensors themselves (a tuple)."""
    if spec is None:
        return tuple(tensors)
    return unflatten(spec, tensors)


def unpack_input(spec: Any, tensors: Sequence[torch.Tensor], split: bool = False) -> Any:
    """x or a target sent with :func:`pack`: a lone tensor when ``spec`` is None; ``split``: a
    batch given as :class:`Microbatches` (sent as a list of them)."""
    if spec is None:
        if len(tensors) != 1 or split:
            raise TreeError(f"{len(tensors)} tensors without a tree description")
        return tensors[0]
    value = unflatten(spec, tensors)
    if not split:
        return value
    if not isinstance(value, list):
        raise TreeError(f"a split batch must arrive as a list of microbatches, not a {type(value).__name__}")
    return Microbatches(value)


def unpack_kwargs(spec: Any, tensors: Sequence[torch.Tensor], split: bool = False) -> Any:
    """A stage's inputs sent with :func:`pack`: a dict of keyword arguments (TreeError otherwise);
    ``split``: a batch given as :class:`Microbatches`, one such dict per microbatch."""
    value = unflatten(spec, tensors)
    if not split:
        return _kwargs(value)
    if not isinstance(value, list):
        raise TreeError(f"a split batch's stage inputs must be a list of dicts, not a {type(value).__name__}")
    return Microbatches(_kwargs(v) for v in value)


def _kwargs(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TreeError(f"stage inputs must be a dict of keyword arguments, not a {type(value).__name__}")
    for name in value:
        if not name.isidentifier():
            raise TreeError(f"stage input names must be identifiers, got {name!r:.40}")
    return value
