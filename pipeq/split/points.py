"""Where a traced model may be cut, and where to cut it for N balanced stages."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from pipeq import balance as balancing
from pipeq.split.by_name import CONTAINERS

__all__ = ["candidates", "choose"]


def _is_candidate(model: nn.Module, name: str) -> bool:
    """A child of the model, or an entry of a container (``blocks.3``, ``transformer.h.0``)."""
    if not name:
        return False
    parent = name.rpartition(".")[0]
    return parent == "" or isinstance(model.get_submodule(parent), CONTAINERS)


def candidates(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[str], list[float]]:
    """The modules a stage may begin at, in the order the forward calls them, and each segment's
    parameter count (segment i: from candidate i to the next; the first one from the start)."""
    order: list[str] = []
    first_use: dict[int, int] = {}  # parameter id -> the segment that uses it first
    counts: list[float] = []
    hooks = []

    def seen(name: str, module: nn.Module) -> None:
        if _is_candidate(model, name) and name not in order:
            order.append(name)
            counts.append(0.0)
        segment = max(len(order) - 1, 0)
        if not counts:
            counts.append(0.0)
        for p in module.parameters(recurse=False):
            if id(p) not in first_use:
                first_use[id(p)] = segment
                counts[segment] += p.numel()

    for name, module in model.named_modules():
        hooks.append(module.register_forward_pre_hook(lambda m, a, n=name: seen(n, m)))
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return order, counts


def choose(order: Sequence[str], costs: Sequence[float], n_stages: int) -> list[str]:
    """The split points (modules the stages 1..N-1 begin at) that balance ``costs``."""
    if len(order) < n_stages:
        raise ValueError(f"the model has {len(order)} places to cut ({', '.join(order)}), too few for "
                         f"{n_stages} stages: use fewer stages")
    counts = balancing.partition(list(costs), n_stages)
    points, at = [], 0
    for c in counts[:-1]:
        at += c
        points.append(order[at])
    return points
