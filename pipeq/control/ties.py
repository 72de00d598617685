"""Tensors shared between stages: the runner's ``ties=`` declared on the stages, checked, and any other sharing refused.

``PipelineRunner(stages, ..., ties=[["0.weight", "5.weight"], ...])`` ties parameters that
several stages use (a tied embedding and LM head): each group lists two or more names of
``runner.state_dict()`` (the flat model's names, see :mod:`pipeq.checkpoint.names`; a stage whose
:class:`~pipeq.stage.info.StageInfo` says ``model_names`` uses its own), each a parameter. The
first name is the tie's key: ``state_dict()`` and checkpoints hold the tensor once, under it.
Every stage holding one of the names gets a :class:`~pipeq.stage.info.Tie` on its module
(:func:`pipeq.stage.info.set_info`) and keeps a copy; the stages sum the copies' gradients before
every step (:mod:`pipeq.stage.ties`). Stages that already carry ties (made by ``pipeq.split``)
need no ``ties=``.

The copies start equal: a stage whose copy is the very tensor object of an earlier stage's
trains a deep copy of its module (your module keeps sharing it), and copies that are different
tensors all take the *first name's value* (copied into the others, in place). Any other tensor
shared between stages is refused: each stage process would train its own.
"""

from __future__ import annotations

import copy
import difflib
from typing import Any, Sequence

import torch
from torch import nn

from pipeq.checkpoint.names import StageNames, is_sequential, layers_of
from pipeq.schedules import SchedulePolicy
from pipeq.stage.info import Tie, info_of, set_info
from pipeq.stage.ties import tie_mismatch

__all__ = ["apply_ties", "refuse_ties", "has_ties", "check_untied"]

_Where = tuple[int, str]  # (stage, local name)


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


def refuse_ties(schedule: SchedulePolicy, *, tensor_parallel: int = 1) -> None:
    """Tied weights train with plain backprop's schedules, without tensor parallelism (ValueError)."""
    if not schedule.plain_backprop:
        raise ValueError(f"tied weights (ties=) train with fill-drain, 1f1b and your own schedules of F, B and "
                         f"STEP, not with schedule {schedule.name!r}: pick one of those, or untie the weights")
    if tensor_parallel != 1:
        raise ValueError(f"tied weights (ties=) do not work with tensor_parallel={tensor_parallel} yet: use "
                         "tensor_parallel=1")


def apply_ties(stages: Sequence[nn.Module], ties: Any) -> list[nn.Module]:
    """The stage list to train: ``ties`` declared on the stages, every stage's ties checked, the
    copies made distinct tensors of equal value, and any other sharing refused (see the module)."""
    stages = list(stages)
    if ties is not None:
        _declare(stages, ties)
    if has_ties(stages):
        _check_declared(stages)
    check_untied(stages)
    if has_ties(stages):
        stages = _separate(stages)
        _equalize(stages)
    return stages


# -- ties= -------------------------------------------------------------------------------------------
def _groups(ties: Any) -> list[list[str]]:
    if not isinstance(ties, (list, tuple)) or not all(
            isinstance(g, (list, tuple)) and len(g) >= 2 and all(type(n) is str for n in g) for g in ties):
        raise ValueError(f"ties must be a list of lists of two or more names of runner.state_dict(), e.g. "
                         f"ties=[['0.weight', '5.weight']], got {ties!r}")
    seen: set[str] = set()
    for g in ties:
        for name in g:
            if name in seen:
                raise ValueError(f"ties: {name!r} is named twice; each tied parameter belongs to one group")
            seen.add(name)
    return [list(g) for g in ties]


def _declare(stages: list[nn.Module], ties: Any) -> None:
    """``ties=`` as each stage's :class:`Tie` (added to what its StageInfo holds: idempotent)."""
    where = {g: (k, local) for k, names in enumerate(_names(stages)) for local, g in names.items()}
    new: dict[int, list[Tie]] = {}
    for group in _groups(ties):
        members: dict[int, list[tuple[str, nn.Parameter]]] = {}
        first: tuple[str, torch.Tensor] | None = None
        for name in group:
            p = _parameter(stages, where, name)
            if first is None:
                first = (name, p)
            elif p.shape != first[1].shape or p.dtype != first[1].dtype:
                raise ValueError(f"ties: {first[0]!r} is {tuple(first[1].shape)} {first[1].dtype} but {name!r} is "
                                 f"{tuple(p.shape)} {p.dtype}: tied parameters must have one shape and dtype")
            members.setdefault(where[name][0], []).append((name, p))
        for k, named in members.items():
            if any(p is not named[0][1] for _, p in named):
                other = next(n for n, p in named if p is not named[0][1])
                raise ValueError(f"ties: {named[0][0]!r} and {other!r} are both stage {k}'s, but different "
                                 "tensors: share one nn.Parameter in the stage module (then both names tie)")
        if len(members) < 2:
            continue  # the names of one tensor of one stage: nothing to sum
        stage_list = tuple(sorted(members))
        for k in stage_list:
            local = _param_name(stages[k], members[k][0][1])
            new.setdefault(k, []).append(Tie(local, group[0], stage_list))
    for k, added in new.items():
        held = info_of(stages[k]).ties
        set_info(stages[k], ties=held + tuple(t for t in added if t not in held))


def _parameter(stages: Sequence[nn.Module], where: dict[str, _Where], name: str) -> nn.Parameter:
    """The parameter runner.state_dict() names ``name`` (ValueError naming it, with close matches)."""
    if name not in where:
        close = difflib.get_close_matches(name, list(where), n=4)
        raise ValueError(f"ties: {name!r} is not a name of runner.state_dict()"
                         + (f"; close matches: {', '.join(repr(c) for c in close)}" if close else ""))
    k, local = where[name]
    t = stages[k].state_dict(keep_vars=True)[local]
    if not isinstance(t, nn.Parameter):
        raise ValueError(f"ties: {name!r} (stage {k}'s {local!r}) is a buffer, not a parameter: only parameters "
                         "are tied")
    return t


def _param_name(module: nn.Module, p: torch.Tensor) -> str:
    """``p``'s name in ``module.named_parameters()`` (the first of its names)."""
    return next(n for n, q in module.named_parameters() if q is p)


# -- every stage's ties --------------------------------------------------------------------------------
def _tied_params(stages: Sequence[nn.Module]) -> dict[str, dict[int, nn.Parameter]]:
    """Per tie key, each holding stage's copy."""
    out: dict[str, dict[int, nn.Parameter]] = {}
    for k, s in enumerate(stages):
        params = dict(s.named_parameters())
        for tie in info_of(s).ties:
            if tie.name not in params:
                close = difflib.get_close_matches(tie.name, list(params), n=3)
                raise ValueError(f"stage {k}'s tie {tie.key!r} names {tie.name!r}, which is not one of its "
                                 "parameters" + (f" (close: {', '.join(close)})" if close else ""))
            out.setdefault(tie.key, {})[k] = params[tie.name]
    return out


def _check_declared(stages: Sequence[nn.Module]) -> None:
    """Every stage holding a tie names it alike, and the copies have one shape and dtype."""
    wrong = tie_mismatch([{t.key: list(t.stages) for t in info_of(s).ties} for s in stages])
    if wrong is not None:
        raise ValueError(f"the stages' tied weights do not match: {wrong[1]}")
    for key, copies in _tied_params(stages).items():
        kinds = {(tuple(p.shape), p.dtype) for p in copies.values()}
        if len(kinds) > 1:
            desc = ", ".join(f"stage {k}: {tuple(p.shape)} {p.dtype}" for k, p in copies.items())
            raise ValueError(f"tie {key!r}: the copies differ ({desc}); tied parameters must have one shape and dtype")


def _separate(stages: list[nn.Module]) -> list[nn.Module]:
    """A stage whose copy is an earlier stage's very tensor trains a deep copy of its module."""
    out = list(stages)
    for copies in _tied_params(stages).values():
        seen: set[int] = set()
        for k in sorted(copies):
            if id(copies[k]) in seen:
                out[k] = copy.deepcopy(stages[k])  # its own tensors (the StageInfo comes along)
            seen.add(id(copies[k]))
    return out


def _equalize(stages: list[nn.Module]) -> None:
    """Copies of a tie that differ take the value of the stage whose name for it is the key
    (the first name of ``ties=``; else the owner's)."""
    names = _names(stages)
    for key, copies in _tied_params(stages).items():
        source = next((k for k in sorted(copies) if key in names[k].values()), min(copies))
        with torch.no_grad():
            for k, p in copies.items():
                if k != source and not torch.equal(p, copies[source]):
                    p.copy_(copies[source])


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
