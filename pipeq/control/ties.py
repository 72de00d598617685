"""Tensors shared between stages: the runner's ``ties=`` declared on the stages, checked, and any other sharing refused.

``PipelineRunner(stages, ..., ties=[["0.weight", "5.weight"], ...])`` ties parameters that
several stages use (a tied embedding and LM head): each group lists two or more names of
``runner.state_dict()`` (the flat model's names, see :mod:`pipeq.checkpoint.names`; a stage whose
:class:`~pipeq.stage.info.StageInfo` says ``model_names`` uses its own), each a parameter. The
first name is the tie's key: ``state_dict()`` and checkpoints hold the tensor once, under it.
Every stage holding one of the names gets a :class:`~pipeq.stage.info.Tie` on its module
(:func:`pipeq.stage.info.set_info`) and keeps a copy; the stages sum the copies' gradients before
every step (:mod:`pipeq.stage.ties`). Stages that already carry ties (made by ``pipeq.split``)
need no ``ties=``. The names are parsed, checked and made ties by :mod:`pipeq.stage.tie_groups`,
as ``pipeq.split``'s are; what this module adds is the runner's: the flat model's names, the
copies made distinct tensors, and sharing that is not declared refused.

The copies start equal: a stage whose copy is the very tensor object of an earlier stage's
trains a deep copy of its module (your module keeps sharing it), and copies that are different
tensors all take the *first name's value* (copied into the others, in place). Any other tensor
shared between stages is refused: each stage process would train its own.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

from torch import nn

from pipeq.checkpoint.names import StageNames, is_sequential, layers_of
from pipeq.stage import tie_groups
from pipeq.stage.info import info_of

__all__ = ["apply_ties", "has_ties", "check_untied"]

#: What ``ties=`` names.
SPACE = "runner.state_dict()"


def _names(stages: Sequence[nn.Module]) -> list[dict[str, str]]:
    """Each stage's state_dict names, local -> global (its own global name, as untied)."""
    out, offset = [], 0
    for k, s in enumerate(stages):
        names = StageNames(k, offset, is_sequential(s), info_of(s).model_names)
        out.append({local: names.own(local) for local in s.state_dict()})
        offset += layers_of(s)
    return out


def has_ties(stages: Sequence[nn.Module]) -> bool:
    """Whether any stage module holds tied weights."""
    return any(info_of(s).ties for s in stages)


def apply_ties(stages: Sequence[nn.Module], ties: Any) -> list[nn.Module]:
    """The stage list to train: ``ties`` declared on the stages, every stage's ties checked, the
    copies made distinct tensors of equal value, and any other sharing refused (see the module)."""
    stages = list(stages)
    where = [{g: local for local, g in names.items()} for names in _names(stages)]  # global -> local
    if ties is not None:
        groups = tie_groups.parse_groups(ties, SPACE)
        tie_groups.check_groups(groups, stages, where, SPACE)
        tie_groups.declare(stages, groups, where)
    if has_ties(stages):
        tie_groups.check_stage_ties(stages)
    check_untied(stages)
    if has_ties(stages):
        stages = _separate(stages)
        tie_groups.equalize(stages, where)
    return stages


def _separate(stages: list[nn.Module]) -> list[nn.Module]:
    """A stage whose copy is an earlier stage's very tensor trains a deep copy of its module."""
    out = list(stages)
    for copies in tie_groups.tied_copies(stages).values():
        seen: set[int] = set()
        for k in sorted(copies):
            if id(copies[k]) in seen:
                out[k] = copy.deepcopy(stages[k])  # its own tensors (the StageInfo comes along)
            seen.add(id(copies[k]))
    return out


def check_untied(stages: Sequence[nn.Module]) -> None:
    """Each stage process owns its tensors: one shared by two stages, and not declared tied (the
    same tie on both), would be trained apart; refused, naming the fix."""
    names = _names(stages)
    keys = [{id(p): t.key for t in info_of(s).ties for n, p in s.named_parameters() if n == t.name}
            for s in stages]
    owner: dict[int, tuple[int, str]] = {}
    for k, s in enumerate(stages):
        params = dict(s.named_parameters())
        for name, t in list(params.items()) + list(s.named_buffers()):
            first = owner.setdefault(id(t), (k, name))
            tied = keys[k].get(id(t))
            if first[0] == k or (tied is not None and tied == keys[first[0]].get(id(t))):
                continue
            if name not in params:
                raise ValueError(
                    f"stage {k}'s buffer {name!r} is the same tensor as stage {first[0]}'s {first[1]!r}; a buffer "
                    "shared between stages would be kept apart, one copy per stage process: keep it in one stage")
            a, b = names[first[0]].get(first[1], first[1]), names[k].get(name, name)
            raise ValueError(
                f"stage {k}'s {name!r} is the same tensor as stage {first[0]}'s {first[1]!r}: each stage "
                f"process holds its own tensors, so they would be trained apart. To train them as one (tied "
                f"weights: each stage holds a copy, their gradients are summed before every step), pass "
                f"ties=[[{a!r}, {b!r}]] (their names in runner.state_dict()); or keep them in one stage")
