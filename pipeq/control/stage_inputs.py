"""Stage inputs: values the driver hands straight to the stages that take them, beside x.

A value that a later stage needs and the stages before it never touch (an attention mask,
position ids) need not ride through every stage: ``stage_inputs`` sends it from the driver to
the stages that use it, split into microbatches like x, and stage k's forward is called as
``module(*what_the_previous_stage_sent, **its_inputs)`` (stage 0: ``module(*x, **its_inputs)``)::

    runner.step(x, y, stage_inputs={"mask": m, "pos": p})   # by name: every stage declaring it
    runner.step(x, y, stage_inputs={2: {"mask": m}})        # by stage: stage 2's keyword arguments

Names are routed to the stages whose module declares them (``pipeq_stage``, a
:class:`pipeq.StageInfo`: :func:`pipeq.set_info` ``(module, inputs=["mask"])``;
``pipeq.split`` sets it). A stage that declares an input must be given it, by name or by its
index. Every tensor of a value (a tensor, or a tuple / list / dict of them) splits on dim 0 as x
does, so it has x's batch size; a constant (None, bool, int, float, str) reaches every microbatch
as it is. Every refusal is a ValueError naming the stage, the input and the shapes.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping, Sequence

from torch import nn

from pipeq.control.batching import given_batch
from pipeq.runtime.backend import StageInputs  # one batch's inputs, per stage (what a backend is sent)
from pipeq.stage.microbatch import Microbatches
from pipeq.stage.info import info_of
from pipeq.tree import flatten, map_tensors

__all__ = ["StageInputs", "check_declared", "route", "route_each", "batch_item"]


def check_declared(stages: Sequence[nn.Module], schedule: Any) -> None:
    """Each stage's declared inputs are keyword arguments its ``forward`` takes, and the schedule
    (its ``takes_stage_inputs``) can hand them over; a ValueError names the stage otherwise."""
    for k, module in enumerate(stages):
        names = info_of(module).inputs
        if not names:
            continue
        if not getattr(schedule, "takes_stage_inputs", True):
            raise ValueError(f"stage {k} declares inputs {', '.join(names)} (pipeq_stage.inputs), but schedule "
                             f"{schedule.name!r} takes no stage_inputs: use fill-drain, 1f1b or another schedule")
        try:
            params = inspect.signature(module.forward).parameters
        except (TypeError, ValueError):  # no signature to read: the first forward tells
            continue
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            continue
        for name in names:
            p = params.get(name)
            if p is None or p.kind is inspect.Parameter.POSITIONAL_ONLY:
                raise ValueError(f"stage {k} ({type(module).__name__}) declares the input {name!r} "
                                 f"(pipeq_stage.inputs), but its forward takes no keyword argument {name!r}: "
                                 f"add it to forward's arguments or drop it from the stage's inputs")


def route(given: Any, declared: Sequence[Sequence[str]], batch: int, schedule: Any) -> StageInputs | None:
    """``given`` (``runner.step``'s ``stage_inputs``: names to values, or stage indices to dicts of
    them) as each stage's keyword arguments, checked against what the stages ``declared`` and
    against the batch's ``batch`` samples; tensors as detached CPU tensors. None: no stage takes
    any (nothing rides along)."""
    n = len(declared)
    if given is None or (isinstance(given, Mapping) and not given):
        _require_all(declared, [None] * n)
        return None
    if not isinstance(given, Mapping):
        raise ValueError(f"stage_inputs must be a dict: input names to values ({{'mask': m}}), or stage indices "
                         f"to dicts of them ({{2: {{'mask': m}}}}), got a {type(given).__name__}")
    if not getattr(schedule, "takes_stage_inputs", True):
        raise ValueError(f"schedule {schedule.name!r} takes no stage_inputs: use fill-drain, 1f1b or another "
                         "schedule whose stages run one forward each")
    keys = list(given)
    if all(type(key) is int for key in keys):
        per = _by_stage(given, declared)
    elif all(type(key) is str for key in keys):
        per = _by_name(given, declared)
    else:
        raise ValueError(f"stage_inputs' keys must be all input names (str) or all stage indices (int), got "
                         f"{keys!r:.120}")
    _require_all(declared, per)
    out: StageInputs = [_checked(k, mine, batch) if mine else None for k, mine in enumerate(per)]
    return out if any(mine is not None for mine in out) else None


def route_each(given: Any, declared: Sequence[Sequence[str]], rows: Sequence[int], schedule: Any) -> StageInputs | None:
    """:func:`route` for a batch given as its microbatches (of ``rows`` samples each): ``given`` is
    a :class:`~pipeq.stage.microbatch.Microbatches` of one ``stage_inputs`` per microbatch (or None),
    each routed on its own; each stage's inputs come out as a ``Microbatches`` of its keyword
    arguments, one dict per microbatch."""
    if given is not None and not (isinstance(given, Microbatches) and len(given) == len(rows)):
        raise ValueError(f"the batch is given as {len(rows)} microbatches, so stage_inputs must be too: one per "
                         "microbatch, pipeq.Microbatches([{'mask': m0}, {'mask': m1}, ...]), got a "
                         f"{type(given).__name__}" + (f" of {len(given)}" if isinstance(given, Microbatches) else ""))
    each = []
    for j, n in enumerate(rows):
        try:
            each.append(route(given[j] if given is not None else None, declared, n, schedule))
        except ValueError as exc:
            raise ValueError(f"microbatch {j}: {exc}") from None
    out: StageInputs = []
    for k in range(len(declared)):
        mine = [r[k] if r is not None else None for r in each]
        if any(m is None for m in mine) and any(m is not None for m in mine):
            raise ValueError(f"stage {k} is given stage_inputs in some microbatches and not in others: give every "
                             "microbatch the same inputs, by the same names")
        out.append(Microbatches(mine) if mine[0] is not None else None)
    return out if any(m is not None for m in out) else None


def _by_stage(given: Mapping[int, Any], declared: Sequence[Sequence[str]]) -> list[dict[str, Any] | None]:
    n = len(declared)
    per: list[dict[str, Any] | None] = [None] * n
    for k, mine in given.items():
        if not 0 <= k < n:
            raise ValueError(f"stage_inputs names stage {k}, but the pipeline has {n} stages (0 to {n - 1})")
        if not isinstance(mine, Mapping) or not all(type(name) is str and name.isidentifier() for name in mine):
            raise ValueError(f"stage_inputs[{k}] must be a dict of stage {k}'s keyword arguments by name "
                             f"({{'mask': m}}), got {type(mine).__name__} {list(mine) if isinstance(mine, Mapping) else ''}")
        unknown = [name for name in mine if declared[k] and name not in declared[k]]
        if unknown:
            raise ValueError(f"stage_inputs[{k}] gives {', '.join(map(repr, unknown))}, but stage {k} declares the "
                             f"inputs {', '.join(map(repr, declared[k]))} only (pipeq_stage.inputs)")
        per[k] = dict(mine)
    return per


def _by_name(given: Mapping[str, Any], declared: Sequence[Sequence[str]]) -> list[dict[str, Any] | None]:
    unknown = [name for name in given if not any(name in names for names in declared)]
    if unknown:
        takes = "; ".join(f"stage {k} takes {', '.join(map(repr, names))}" for k, names in enumerate(declared) if names)
        raise ValueError(f"stage_inputs gives {', '.join(map(repr, unknown))}, which no stage declares ("
                         + (takes or "no stage declares any input") + "): declare it in the stage's "
                         "pipeq_stage (pipeq.set_info(module, inputs=[...])), or give it to a stage "
                         "by index, stage_inputs={k: {name: value}}")
    return [{name: given[name] for name in names if name in given} or None for names in declared]


def _require_all(declared: Sequence[Sequence[str]], per: Sequence[Mapping[str, Any] | None]) -> None:
    """Every input a stage declares is given to it."""
    for k, names in enumerate(declared):
        missing = [name for name in names if name not in (per[k] or {})]
        if missing:
            raise ValueError(f"stage {k} takes the input{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(map(repr, missing))} (its pipeq_stage.inputs), but it is not given: pass "
                             f"stage_inputs={{{missing[0]!r}: value, ...}} with every batch")


def _checked(k: int, mine: dict[str, Any], batch: int) -> dict[str, Any]:
    """Stage ``k``'s inputs with every tensor's dim 0 the batch's ``batch`` samples, as detached CPU
    tensors (ValueError naming the stage, the input and its shape otherwise)."""
    for name, value in mine.items():
        paths: list[str] = []
        try:
            tensors = flatten(value, name, paths=paths)[0]
        except ValueError as exc:
            raise ValueError(f"stage {k}'s input {name!r}: {exc}") from None
        for path, t in zip(paths, tensors):
            if t.dim() == 0 or t.shape[0] != batch:
                raise ValueError(f"stage {k}'s input {path} has shape {tuple(t.shape)}, but the batch has {batch} "
                                 f"samples: every tensor of stage_inputs splits on dim 0 into microbatches, as x "
                                 f"does, so its dim 0 must be {batch}")
    return map_tensors(mine, lambda t: t.detach().cpu())


def batch_item(item: Any, where: str) -> tuple[Any, Any, Any]:
    """One batch of ``runner.stream`` or ``runner.evaluate`` (``where``): ``(x, target)`` or
    ``(x, target, stage_inputs)``, a tuple or a list (as a DataLoader yields it), or a batch given
    as its microbatches: a :class:`~pipeq.stage.microbatch.Microbatches` of such pairs (or triples)."""
    if isinstance(item, Microbatches):
        return given_batch(item, None, None)
    if isinstance(item, (tuple, list)) and len(item) in (2, 3):
        return item[0], item[1], item[2] if len(item) == 3 else None
    got = f"{type(item).__name__} of {len(item)}" if isinstance(item, (tuple, list)) else type(item).__name__
    raise ValueError(f"{where}: a batch is an (x, target) pair or an (x, target, stage_inputs) triple, got a {got}")
