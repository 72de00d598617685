"""Tied weights of a split model: the parameters that several stages hold a copy of."""

from __future__ import annotations

import difflib
from typing import Sequence

import torch
from torch import nn

from pipeq.stage.info import Tie, set_info

__all__ = ["alias_groups", "declared_groups", "tie_stages"]


def alias_groups(model: nn.Module) -> list[list[str]]:
    """Groups of names under which ``model`` holds one parameter (``tok_emb.weight`` and
    ``lm_head.weight`` when the head is tied to the embedding), each in the model's order."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def declared_groups(model: nn.Module, ties: Sequence[Sequence[str]] | None) -> list[list[str]]:
    """The model's own alias groups merged with the ``ties`` the caller declares (names of
    parameters that must train as one; the first name of a group is kept)."""
    groups = alias_groups(model)
    if ties is None:
        return groups
    params = dict(model.named_parameters(remove_duplicate=False))
    if not isinstance(ties, (list, tuple)) or not all(isinstance(g, (list, tuple)) and len(g) >= 2 for g in ties):
        raise ValueError(f"ties must be a list of groups of two or more parameter names, got {ties!r}")
    for group in ties:
        for name in group:
            if name not in params:
                close = difflib.get_close_matches(str(name), list(params), n=3)
                raise ValueError(f"ties names {name!r}, which is not a parameter of {type(model).__name__}"
                                 + (f"; did you mean {', '.join(map(repr, close))}?" if close else ""))
        shapes = {tuple(params[n].shape) for n in group}
        if len(shapes) != 1:
            raise ValueError(f"ties {list(group)}: the parameters have different shapes "
                             f"{[tuple(params[n].shape) for n in group]}; tied parameters must match")
        merged = [g for g in groups if set(g) & set(group)]
        for g in merged:
            groups.remove(g)
        union = list(dict.fromkeys([*group, *(n for g in merged for n in g)]))
        groups.append(union)
    return groups


def _set(module: nn.Module, name: str, value: nn.Parameter) -> None:
    prefix, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(prefix) if prefix else module, leaf, value)


def tie_stages(stages: Sequence[nn.Module], groups: Sequence[Sequence[str]]) -> None:
    """Mark on each stage (``pipeq_stage.ties``) the parameters of ``groups`` it shares with other
    stages; names of one group inside one stage become one tensor, and every copy starts as the
    group's first name's value."""
    holders: list[dict[int, str]] = []  # per group: stage -> its local name of the parameter
    for group in groups:
        held: dict[int, str] = {}
        for k, stage in enumerate(stages):
            params = dict(stage.named_parameters(remove_duplicate=False))
            mine = [n for n in group if n in params]
            if not mine:
                continue
            for other in mine[1:]:  # one tensor within a stage
                _set(stage, other, params[mine[0]])
            held[k] = next(n for n, p in stage.named_parameters() if p is params[mine[0]])
        holders.append(held)
    ties: list[list[Tie]] = [[] for _ in stages]
    for group, held in zip(groups, holders):
        if len(held) < 2:
            continue
        order = tuple(sorted(held))
        first = stages[order[0]].get_parameter(held[order[0]])
        for k in order:
            with torch.no_grad():
                p = stages[k].get_parameter(held[k])
                if p is not first:
                    p.copy_(first)
            ties[k].append(Tie(name=held[k], key=group[0], stages=order))
    for k, stage in enumerate(stages):
        if ties[k]:
            set_info(stage, ties=ties[k])
