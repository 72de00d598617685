"""Tensor parallelism inside a stage, on torch's own DTensor (``tensor_parallel=T``).

Each stage runs on T processes, its *shards*, on one host. Its plan says which submodules are
split and how, in torch's words (``torch.distributed.tensor.parallel``):

    "colwise"   ColwiseParallel: a Linear's output features (an Embedding's dimension) split
                over the shards; the input is whole on every shard, the output is a shard of it
                (for the "rowwise" entry that directly follows it; else gathered whole)
    "rowwise"   RowwiseParallel: a Linear's input features (an Embedding's rows) split; each
                shard's partial result is all-reduced, so the output is whole on every shard
                (its input: the shard a "colwise" entry just before it made, else whole)

The tensor-parallel MLP of examples/tp_mlp.py, layer 1 by output rows, layer 2 by input columns::

    x (whole, every shard)          shard 0                         shard 1
    Linear(16, 8)  "colwise"        h[:, 0:4] = x W1[0:4].T + b1    h[:, 4:8] = x W1[4:8].T + b1
    ReLU                            relu(h[:, 0:4])                 relu(h[:, 4:8])
    Linear(8, 1)   "rowwise"        p0 = h[:, 0:4] W2[:, 0:4].T     p1 = h[:, 4:8] W2[:, 4:8].T
                                    y = p0 + p1 + b2  (all-reduce: whole on both shards)

:func:`styles` turns a plan's strings into those objects (a "colwise" entry not directly followed
by a "rowwise" one gathers its output, so that a stage always hands its neighbour whole tensors);
``ParallelStyle`` objects are taken as they are, and a callable ``(stage_module, mesh) -> module``
does anything else. :func:`check_plans` refuses, before any process starts, a plan that names a
submodule a stage lacks, a style pipeq does not know, or a size that does not divide by T.

Inside a stage process, the shards of a stage are the ``"tp"`` dimension of its mesh
(:mod:`pipeq.parallel.mesh`: with FSDP too, ``shard x tp``); :func:`parallelize` splits the
stage's module over it and the stage's parallel layers (:mod:`pipeq.parallel.layers`) hand its
neighbours whole tensors (:func:`whole`). Every state it hands out is whole too
(:mod:`pipeq.stage.state`, with :func:`whole` and :func:`like`): ``state_dict``, snapshots and
checkpoints hold full tensors under the usual names, so they load at any T (and without tensor
parallelism).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


__all__ = ["STYLES", "check_plans", "check_stage", "styles", "parallelize", "whole", "like"]

STYLES = ("colwise", "rowwise")


def _divides(module: nn.Module, style: str, t: int) -> tuple[str, int] | None:
    """(what is split, its size) for a string style on ``module``; None when it divides by ``t``."""
    if isinstance(module, nn.Linear):
        what, size = ("out_features", module.out_features) if style == "colwise" else ("in_features",
                                                                                        module.in_features)
    elif isinstance(module, nn.Embedding):
        what, size = ("embedding_dim", module.embedding_dim) if style == "colwise" else ("num_embeddings",
                                                                                          module.num_embeddings)
    else:
        raise ValueError(f"is a {type(module).__name__}: \"{style}\" splits an nn.Linear or nn.Embedding; "
                         "pass a ParallelStyle object (or a callable plan) for anything else")
    return None if size % t == 0 else (what, size)


# A plan's names are ``stage.get_submodule(name)``'s; "" is the stage module itself.


def check_plans(stages: Sequence[nn.Module] | None, plans: Any, t: int, n_stages: int) -> list[Any]:
    """``tp_plan`` checked against the stages (None: built in the stage processes, which check
    their own); returns one plan per stage. Every refusal names the stage, submodule and setting."""
    if type(t) is not int or t < 1:
        raise ValueError(f"tensor_parallel must be a positive integer, got {t!r}")
    if plans is None:
        raise ValueError(f"tensor_parallel={t} needs tp_plan: one dict per stage mapping submodule names "
                         "to 'colwise' or 'rowwise', e.g. [{'0': 'colwise', '2': 'rowwise'}, ...]")
    if isinstance(plans, Mapping) or callable(plans) or not isinstance(plans, (list, tuple)):
        raise ValueError("tp_plan must be a list with one plan per stage (a dict, or a callable "
                         "(stage_module, mesh) -> module); use {} for a stage left whole")
    if len(plans) != n_stages:
        raise ValueError(f"tp_plan has {len(plans)} plans for {n_stages} stages: give one per stage ({{}} "
                         "for a stage left whole)")
    for k, plan in enumerate(plans):
        check_stage(k, stages[k] if stages is not None else None, plan, t)
    return [plan if callable(plan) and not isinstance(plan, Mapping) else dict(plan) for plan in plans]


def check_stage(k: int, module: nn.Module | None, plan: Any, t: int) -> None:
    """Stage ``k``'s plan, against its module when given."""
    from torch.distributed.tensor.parallel import ParallelStyle

    if callable(plan) and not isinstance(plan, Mapping):
        return
    if not isinstance(plan, Mapping):
        raise ValueError(f"tp_plan[{k}] (stage {k}) is a {type(plan).__name__}: give a dict of "
                         "submodule name -> 'colwise' / 'rowwise', or a callable (stage_module, mesh) -> module")
    for name, style in plan.items():
        if type(name) is not str:
            raise ValueError(f"stage {k}'s plan: submodule names are strings, got {name!r}")
        if isinstance(style, str) and style not in STYLES:
            raise ValueError(f"stage {k}'s plan: unknown style {style!r} for {name!r}; use one of "
                             f"{list(STYLES)} or a torch ParallelStyle object")
        if not isinstance(style, (str, ParallelStyle)):
            raise ValueError(f"stage {k}'s plan: {name!r} -> {type(style).__name__}; use one of "
                             f"{list(STYLES)} or a torch ParallelStyle object")
        if module is None:
            continue
        try:
            sub = module.get_submodule(name)
        except AttributeError:
            children = [n for n, _ in module.named_modules() if n]
            raise ValueError(f"stage {k}'s plan names submodule {name!r}, which stage {k} "
                             f"({type(module).__name__}) does not have; its submodules: "
                             f"{children[:12]}{' ...' if len(children) > 12 else ''}") from None
        if isinstance(style, str):
            try:
                bad = _divides(sub, style, t)
            except ValueError as exc:
                raise ValueError(f"stage {k}'s plan: submodule {name!r} {exc}") from None
            if bad is not None:
                raise ValueError(f"stage {k}'s plan: submodule {name!r} ({sub}) is \"{style}\", which "
                                 f"splits its {bad[0]}={bad[1]} over tensor_parallel={t} shards: "
                                 f"{bad[1]} does not divide by {t}; pick a T that divides it")


def styles(plan: Mapping[str, Any]) -> dict[str, Any]:
    """A plan's torch ParallelStyle objects. Entries pair up in the plan's order: a "colwise"
    entry directly followed by a "rowwise" one hands it its shard (an MLP's two layers, attention's
    projections); a "colwise" entry that no "rowwise" entry directly follows gathers its output
    (whole again: a stage's output always is); a "rowwise" entry that does not directly follow a
    "colwise" one gets whole input (the stage's, or a gathered one) and cuts its own share of it."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    names = list(plan)
    out: dict[str, Any] = {}
    for i, name in enumerate(names):
        style = plan[name]
        if style == "rowwise":  # its input is a "colwise" entry's shard, else whole (cut here)
            out[name] = RowwiseParallel() if i > 0 and plan[names[i - 1]] == "colwise" else \
                RowwiseParallel(input_layouts=Replicate())
        elif style == "colwise":
            closed = i + 1 < len(names) and plan[names[i + 1]] == "rowwise"
            out[name] = ColwiseParallel() if closed else ColwiseParallel(output_layouts=Replicate())
        else:
            out[name] = style
    return out


def parallelize(module: nn.Module, plan: Any, mesh: Any) -> nn.Module:
    """``module`` (on its device) split over ``mesh`` as ``plan`` says."""
    if callable(plan) and not isinstance(plan, Mapping):
        out = plan(module, mesh)
        if not isinstance(out, nn.Module):
            raise TypeError(f"the callable tp_plan returned a {type(out).__name__}, not an nn.Module")
        return out
    if not plan:
        return module
    from torch.distributed.tensor.parallel import parallelize_module

    plan = styles(plan)
    itself = plan.pop("", None)  # "": the stage module itself (a lone Linear)
    if itself is not None:
        module = parallelize_module(module, mesh, itself)
    return parallelize_module(module, mesh, plan) if plan else module


# ------------------------------------------------------------------------- whole <-> sharded

def whole(value: Any) -> Any:
    """``value`` (a tensor, or dicts / lists / tuples of them) with every DTensor gathered whole
    (differentiably). A collective: every shard calls it on the same structure, in the same order."""
    if isinstance(value, torch.Tensor):
        return value.full_tensor() if isinstance(value, DTensor) else value
    if isinstance(value, dict):
        return {k: whole(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [whole(v) for v in value]
        return type(value)(items) if type(value) in (list, tuple) else type(value)(*items)  # namedtuple
    return value


def like(full: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """``full`` laid out as ``current`` is: this shard's piece of it when ``current`` is a
    DTensor (cut locally: every shard holds the whole), else ``full`` itself."""
    if not isinstance(current, DTensor) or isinstance(full, DTensor):
        return full
    return distribute_tensor(full.to(current.device_mesh.device_type), current.device_mesh, current.placements,
                             src_data_rank=None)
