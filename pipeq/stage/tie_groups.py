"""Tied weights declared: groups of names checked, made each stage's ties; the runs that cannot train them.

The runner's ``ties=`` (:mod:`pipeq.control.ties`, names of ``runner.state_dict()``) and
:func:`pipeq.split`'s (:mod:`pipeq.split.ties`, the model's own names) both come here, with each
stage's names in their namespace (``where[k]``: such a name -> stage k's own ``state_dict``
name): :func:`parse_groups` reads them, :func:`check_groups` finds every name (close ones on a
typo) and checks the shapes and dtypes, :func:`declare` builds the stages'
:class:`~pipeq.stage.info.Tie` records, :func:`equalize` makes the copies equal, and
:func:`check_stage_ties` checks the ties stages carry. :func:`refuse_ties` is the one rule of
what cannot train tied weights, checked by the runner before anything starts and by
:func:`pipeq.runtime.executors.make_executor` in the stage processes (a recipe's stages are built there).
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from pipeq.stage.info import Tie, info_of, set_info

if TYPE_CHECKING:
    from pipeq.schedules import SchedulePolicy

__all__ = ["parse_groups", "check_groups", "declare", "check_stage_ties", "tie_mismatch", "tied_parameters",
           "tied_copies", "equalize", "refuse_ties"]

#: Per stage, its names in the groups' namespace -> its own state_dict names.
Where = Sequence[Mapping[str, str]]


def _did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the names of ``known`` close to ``name``, else ``""``."""
    close = difflib.get_close_matches(name, list(dict.fromkeys(known)), n=3)
    return f"; did you mean {', '.join(map(repr, close))}?" if close else ""


# -- ties= ---------------------------------------------------------------------------------------------
def parse_groups(ties: Any, space: str) -> list[list[str]]:
    """``ties``: a list of groups of two or more names of ``space`` (``"runner.state_dict()"``),
    none named twice (ValueError otherwise)."""
    if not isinstance(ties, (list, tuple)) or not all(
            isinstance(g, (list, tuple)) and len(g) >= 2 and all(type(n) is str for n in g) for g in ties):
        raise ValueError(f"ties must be a list of lists of two or more names of {space}, e.g. "
                         f"ties=[['0.weight', '5.weight']], got {ties!r}")
    seen: set[str] = set()
    for g in ties:
        for name in g:
            if name in seen:
                raise ValueError(f"ties: {name!r} is named twice; each tied parameter belongs to one group")
            seen.add(name)
    return [list(g) for g in ties]


def _held(modules: Sequence[nn.Module], where: Where) -> list[dict[str, tuple[str, torch.Tensor]]]:
    """Per module, each of its names in the namespace -> (its own name, the tensor)."""
    out = []
    for m, names in zip(modules, where):
        state = m.state_dict(keep_vars=True)
        out.append({name: (local, state[local]) for name, local in names.items() if local in state})
    return out


def check_groups(groups: Sequence[Sequence[str]], modules: Sequence[nn.Module], where: Where, space: str) -> None:
    """Every name of ``groups`` is a parameter of ``modules`` (the stages, or the whole model), and
    a group's parameters have one shape and dtype: ValueError naming the name, its stage and the
    shapes (close names on a typo)."""
    held = _held(modules, where)
    for group in groups:
        first: tuple[str, torch.Tensor] | None = None
        for name in group:
            found = [(k, *h[name]) for k, h in enumerate(held) if name in h]
            if not found:
                known = (n for h in held for n in h)
                raise ValueError(f"ties: {name!r} is not a name of {space}" + _did_you_mean(name, known))
            for k, local, t in found:
                if not isinstance(t, nn.Parameter):
                    at = f" (stage {k}'s {local!r})" if len(held) > 1 or local != name else ""
                    raise ValueError(f"ties: {name!r}{at} is a buffer, not a parameter: only parameters are tied")
                if first is None:
                    first = (name, t)
                elif t.shape != first[1].shape or t.dtype != first[1].dtype:
                    raise ValueError(f"ties: {first[0]!r} is {tuple(first[1].shape)} {first[1].dtype} but {name!r} is "
                                     f"{tuple(t.shape)} {t.dtype}: tied parameters must have one shape and dtype")


def declare(stages: Sequence[nn.Module], groups: Sequence[Sequence[str]], where: Where) -> None:
    """Each group as a :class:`Tie` on every stage holding one of its names, added to the stage's
    own (declaring twice changes nothing): its key is the group's first name, its stages every
    holder. A group held by one stage ties nothing; names no stage holds are left out (checked
    by :func:`check_groups` where they must exist); two different tensors of one stage are refused."""
    held = _held(stages, where)
    new: dict[int, list[Tie]] = {}
    for group in groups:
        members: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for name in group:
            for k, h in enumerate(held):
                if name in h:
                    members.setdefault(k, []).append((name, h[name][1]))
        for k, named in members.items():
            other = next((n for n, p in named if p is not named[0][1]), None)
            if other is not None:
                raise ValueError(f"ties: {named[0][0]!r} and {other!r} are both stage {k}'s, but different "
                                 "tensors: share one nn.Parameter in the stage module (then both names tie)")
        if len(members) < 2:
            continue  # the names of one tensor of one stage: nothing to sum
        order = tuple(sorted(members))
        for k in order:
            p = members[k][0][1]
            name = next(n for n, q in stages[k].named_parameters() if q is p)  # its first name
            new.setdefault(k, []).append(Tie(name, group[0], order))
    for k, added in new.items():
        had = info_of(stages[k]).ties
        set_info(stages[k], ties=had + tuple(t for t in added if t not in had))


# -- the ties stages carry ----------------------------------------------------------------------------
def tied_parameters(module: nn.Module, index: int, ties: Sequence[Tie] | None = None) -> dict[str, nn.Parameter]:
    """Stage ``index``'s copy of each of its ties (``ties``, else its StageInfo's), by key:
    ValueError for a tie naming no parameter of ``module`` (with close names) or not listing the stage."""
    params = dict(module.named_parameters())
    out = {}
    for tie in info_of(module).ties if ties is None else ties:
        if tie.name not in params:
            raise ValueError(f"stage {index}'s tie {tie.key!r} names {tie.name!r}, which is not a parameter of the "
                             "stage module" + _did_you_mean(tie.name, params))
        if index not in tie.stages:
            raise ValueError(f"stage {index} holds tie {tie.key!r}, whose stages {list(tie.stages)} do not include it")
        out[tie.key] = params[tie.name]
    return out


def tied_copies(stages: Sequence[nn.Module]) -> dict[str, dict[int, nn.Parameter]]:
    """Per tie key, each holding stage's copy."""
    out: dict[str, dict[int, nn.Parameter]] = {}
    for k, s in enumerate(stages):
        for key, p in tied_parameters(s, k).items():
            out.setdefault(key, {})[k] = p
    return out


def tie_mismatch(tie_stages: Sequence[Mapping[str, Sequence[int]]]) -> tuple[int, str] | None:
    """The first stage whose ties the others do not match, and what is wrong; None if nothing.
    ``tie_stages[k]`` maps each tie key of stage k to the stages holding a copy (its layout's);
    each of those stages must name the same key with the same stages."""
    for k, mine in enumerate(tie_stages):
        for key, stages in mine.items():
            if k not in stages:
                return k, f"stage {k}'s tie {key!r} lists stages {list(stages)}, without stage {k}"
            for s in stages:
                theirs = tie_stages[s].get(key) if 0 <= s < len(tie_stages) else None
                if theirs is None or list(theirs) != list(stages):
                    return k, (f"stage {k} ties {key!r} with stages {list(stages)}, but stage {s} "
                               + ("does not hold it" if theirs is None else f"ties it with stages {list(theirs)}"))
    return None


def check_stage_ties(stages: Sequence[nn.Module]) -> None:
    """Every stage holding a tie names it alike, each tie names a parameter of its stage, and the
    copies have one shape and dtype (ValueError naming the stages, the tie and the shapes)."""
    wrong = tie_mismatch([{t.key: list(t.stages) for t in info_of(s).ties} for s in stages])
    if wrong is not None:
        raise ValueError(f"the stages' tied weights do not match: {wrong[1]}")
    for key, copies in tied_copies(stages).items():
        kinds = {(tuple(p.shape), p.dtype) for p in copies.values()}
        if len(kinds) > 1:
            desc = ", ".join(f"stage {k}: {tuple(p.shape)} {p.dtype}" for k, p in copies.items())
            raise ValueError(f"tie {key!r}: the copies differ ({desc}); tied parameters must have one shape and dtype")


def equalize(stages: Sequence[nn.Module], where: Where) -> None:
    """Copies of a tie that differ take the value of the stage holding the key's name (the first
    name of its group; else the first stage's), copied in place."""
    for key, copies in tied_copies(stages).items():
        source = next((k for k in sorted(copies) if key in where[k]), min(copies))
        with torch.no_grad():
            for k, p in copies.items():
                if k != source and not torch.equal(p, copies[source]):
                    p.copy_(copies[source])


# -- the rule ------------------------------------------------------------------------------------------
def refuse_ties(schedule: "SchedulePolicy", stages: Sequence[nn.Module], *, first: int = 0) -> None:
    """What cannot train tied weights, for ``stages`` (stage ``first``, ``first + 1``...): a schedule
    other than plain backprop's. ValueError naming the first stage holding ties, the ties and what to do."""
    for k, module in enumerate(stages, first):
        ties = info_of(module).ties
        if not ties:
            continue
        held = f"stage {k} holds tied weights ({', '.join(t.key for t in ties)})"
        if not schedule.plain_backprop:
            from pipeq.compat import refusal

            raise ValueError(f"{held}, and schedule {schedule.name!r} computes its own way: "
                             + refusal("own-way-ties").message())
