"""Tied weights of a split model: the parameters that several stages hold a copy of.

The model's own sharing (one parameter under several names) and the groups the caller declares
(``pipeq.split(..., ties=...)``, names of the model's ``state_dict()``) are parsed, checked and
made each stage's ties by :mod:`pipeq.stage.tie_groups`, as the runner's ``ties=`` are; what this
module adds is the split's: the model's sharing found, and the names of a group that one stage
holds made one tensor.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from pipeq.stage import tie_groups

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
    space = f"{type(model).__name__}.state_dict()"
    declared = tie_groups.parse_groups(ties, space)
    tie_groups.check_groups(declared, [model], [{n: n for n in model.state_dict()}], space)
    for group in declared:
        merged = [g for g in groups if set(g) & set(group)]
        for g in merged:
            groups.remove(g)
        groups.append(list(dict.fromkeys([*group, *(n for g in merged for n in g)])))
    return groups


def _set(module: nn.Module, name: str, value: nn.Parameter) -> None:
    prefix, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(prefix) if prefix else module, leaf, value)


def tie_stages(stages: Sequence[nn.Module], groups: Sequence[Sequence[str]]) -> None:
    """Mark on each stage (``pipeq_stage.ties``) the parameters of ``groups`` it shares with other
    stages; names of one group inside one stage become one tensor, and every copy starts as the
    group's first name's value."""
    for stage in stages:
        params = dict(stage.named_parameters(remove_duplicate=False))
        for group in groups:
            mine = [n for n in group if n in params]
            for other in mine[1:]:  # one tensor within a stage
                _set(stage, other, params[mine[0]])
    where = [{n: n for n in stage.state_dict()} for stage in stages]
    tie_groups.declare(stages, groups, where)
    tie_groups.equalize(stages, where)
