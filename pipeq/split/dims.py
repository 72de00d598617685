"""Which dimensions of a traced split's inputs may change size: torch.export's dynamic shapes, asked and read back.

:func:`requested` says what ``torch.export.export`` is asked for (its ``dynamic_shapes``): by
default every dimension of size 2 or more of every input tensor is ``Dim.AUTO``, so a stage runs
any batch size and any sequence length, and a dimension the model's code fixes (a feature
dimension that meets an ``nn.Linear``, a view to a constant) simply specializes; a dimension of
size 0 or 1 in the example stays fixed (torch.export specializes those). ``pipeq.split(...,
dynamic=...)`` changes that: ``False`` makes only dim 0 dynamic (pipeq's behaviour before
lengths could change), a dict of input name -> ``{dim: Dim | None}`` overrides the default
dimension by dimension (``None``: fixed; a named ``Dim("seq", max=512)`` or ``Dim.DYNAMIC``:
must stay dynamic), or names a whole input ``None`` (all fixed). :func:`read_back` finds, in the
exported program, which dimensions did stay dynamic (and their range) and which were fixed, and
why (the example's size, ``dynamic=``, or the model's code), for ``Split.dynamic`` /
``Split.static`` / ``Split.explain()`` (:func:`describe`); :func:`explain` turns torch's refusal to keep a dimension
the user named dynamic into a :class:`SpecializedDim` naming the input, the dimension and torch's
reason.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.export import Dim

__all__ = ["SpecializedDim", "Request", "requested", "read_back", "describe", "explain", "limits_of", "check_limits"]


class SpecializedDim(ValueError):
    """A dimension the user named dynamic (``dynamic=``) cannot stay dynamic in the trace."""


@dataclass(frozen=True)
class Request:
    """What torch.export is asked for: its ``dynamic_shapes``, and the (input, dim, given value)
    that must stay dynamic (named in ``dynamic=`` as a ``Dim`` or ``Dim.DYNAMIC``)."""

    shapes: dict[str, Any]
    required: list[tuple[str, int, Any]] = field(default_factory=list)


def _must_vary(v: Any) -> bool:
    """A named ``Dim("seq")`` or ``Dim.DYNAMIC``: torch.export refuses to specialize it."""
    return isinstance(v, Dim) or getattr(getattr(v, "type", None), "name", None) == "DYNAMIC"


def _all_dims(v: Any) -> Any:
    """The default for one input: every dimension of size 2 or more of each tensor in it AUTO."""
    if isinstance(v, torch.Tensor):
        return {d: Dim.AUTO for d, n in enumerate(v.shape) if n >= 2} or None
    if isinstance(v, (tuple, list, dict)) and pytree.tree_leaves(v):
        return pytree.tree_map(_all_dims, v, is_leaf=lambda x: isinstance(x, torch.Tensor))
    return None


def _batch_dim(v: Any) -> Any:
    return {0: Dim.AUTO} if isinstance(v, torch.Tensor) and v.dim() > 0 else None


def _override(name: str, value: Any, given: Any, required: list[tuple[str, int, Any]]) -> Any:
    """Input ``name``'s spec: ``given`` (from ``dynamic=``) over the default."""
    if given is None:
        return None
    if not (isinstance(given, dict) and all(type(d) is int for d in given)):
        return given  # a nested input's own structure of specs: torch's format, passed through
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"dynamic={{{name!r}: {given!r}}}: {name} is not a tensor")
    spec = dict(_all_dims(value) or {})
    for d, v in given.items():
        if not -value.dim() <= d < value.dim():
            raise ValueError(f"dynamic={{{name!r}: ...}} names dim {d}, but the example {name} has "
                             f"{value.dim()} dims (shape {tuple(value.shape)})")
        d %= value.dim()
        if v is None or v == Dim.STATIC:
            spec.pop(d, None)
            continue
        if value.shape[d] < 2:
            raise ValueError(f"dynamic= makes {name} dim {d} dynamic, but the example has size {value.shape[d]} "
                             "there: torch.export fixes a size of 0 or 1 into the graph; give an example of "
                             "2 or more in that dimension")
        lo, hi = getattr(v, "min", None), getattr(v, "max", None)
        if lo is not None and value.shape[d] < lo or hi is not None and value.shape[d] > hi:
            raise ValueError(f"dynamic= gives {name} dim {d} the range {lo}..{hi}, but the example has size "
                             f"{value.shape[d]} there: give an example inside the range")
        spec[d] = v
        if _must_vary(v):
            required.append((name, d, v))
    return spec or None


def requested(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic: Any) -> Request:
    """torch.export's ``dynamic_shapes`` for ``model(*args, **kwargs)`` (see the module):
    ``dynamic`` is None / True (the default), False, or a dict of input name -> spec."""
    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    if dynamic is None or dynamic is True:
        return Request({name: _all_dims(v) for name, v in bound.items()})
    if dynamic is False:
        return Request({name: _batch_dim(v) for name, v in bound.items()})
    if not isinstance(dynamic, dict):
        raise ValueError(f"dynamic= takes True, False or a dict of input name -> {{dim: Dim or None}}, got "
                         f"{dynamic!r}")
    unknown = [k for k in dynamic if k not in bound]
    if unknown:
        raise ValueError(f"dynamic= names {', '.join(map(repr, unknown))}, not among the inputs of "
                         f"{type(model).__name__}.forward given in the example ({', '.join(bound)})")
    required: list[tuple[str, int, Any]] = []
    shapes = {name: _override(name, v, dynamic[name], required) if name in dynamic else _all_dims(v)
              for name, v in bound.items()}
    return Request(shapes, required)


def _labels(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """A name for each leaf of ``(args, kwargs)`` as torch.export flattens them (its user inputs):
    the forward's parameter name, with the path inside a nested input (``batch['input_ids']``)."""
    params = [p for p in inspect.signature(model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    out = []
    for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]:
        top, key, rest = path[0].idx, path[1], path[2:]
        if top == 0:
            name = params[key.idx].name if key.idx < len(params) else f"args[{key.idx}]"
        else:
            name = str(key.key)
        out.append(name + pytree.keystr(rest))
    return out


def _bounds(expr: Any, ranges: dict[Any, Any]) -> tuple[int, int | None]:
    vr = ranges.get(expr)
    if vr is None:
        return (2, None)
    hi = vr.upper
    return (int(vr.lower), None if not math.isfinite(float(hi)) else int(hi))


Dims = dict[str, dict[int, Any]]


def _why(label: str, d: int, size: int, request: Request) -> str:
    """Why input ``label``'s dim ``d`` (of ``size`` in the example) is fixed in the trace."""
    if size < 2:
        return f"the example has size {size} there (torch.export fixes sizes 0 and 1)"
    spec = request.shapes.get(label, ...)
    if spec is None or isinstance(spec, dict) and all(type(k) is int for k in spec) and d not in spec:
        return "dynamic= fixes it"
    if spec is ...:  # an entry of a nested input
        return "the model's code or dynamic= fixes it"
    return "the model's code fixes it"


def read_back(program: Any, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              request: Request) -> tuple[Dims, Dims, Dims]:
    """In the exported ``program``: each input tensor's dimensions that stayed dynamic, with their
    range ``(lowest, highest or None)``; those fixed, with their size; and why each is fixed."""
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    user = list(program.graph_signature.user_inputs)
    labels = _labels(model, args, kwargs)
    ranges = program.range_constraints
    dynamic: Dims = {}
    static: Dims = {}
    why: Dims = {}
    if len(user) != len(labels):  # a flattening of torch's own that pipeq does not know: say nothing
        return dynamic, static, why
    for label, name in zip(labels, user):
        node = placeholders.get(name) if isinstance(name, str) else None
        val = node.meta.get("val") if node is not None else None
        if not isinstance(val, torch.Tensor):
            continue
        for d, n in enumerate(val.shape):
            expr = n.node.expr if isinstance(n, torch.SymInt) else None
            if expr is not None and not expr.is_number:
                dynamic.setdefault(label, {})[d] = _bounds(expr, ranges)
            else:  # an int, or a symbol the trace replaced by a number (specialized)
                size = int(expr if expr is not None else n)
                static.setdefault(label, {})[d] = size
                why.setdefault(label, {})[d] = _why(label, d, size, request)
    return dynamic, static, why


def describe(dynamic: Dims, static: Dims, why: Dims) -> str:
    """One line per input: which dimensions vary (and their range), which are fixed and why."""
    lines = []
    for label in dict.fromkeys([*dynamic, *static]):
        parts = [f"dim {d} varies ({lo}..{'' if hi is None else hi})" for d, (lo, hi) in dynamic.get(label, {}).items()]
        parts += [f"dim {d} fixed at {n}: {why.get(label, {}).get(d, 'fixed in the trace')}"
                  for d, n in static.get(label, {}).items()]
        lines.append(f"{label}: " + "; ".join(sorted(parts, key=lambda p: int(p.split()[1]))))
    return "\n".join(lines)


def explain(exc: BaseException, request: Request) -> SpecializedDim | None:
    """torch.export's refusal ``exc`` as a :class:`SpecializedDim`, when it refused a dimension
    named in ``dynamic=``: fixed by the model's code, or the example outside the range given
    (None otherwise: the model is what cannot be traced)."""
    text = str(exc)
    if not request.required or not ("Constraints violated" in text or type(exc).__name__ == "ConstraintViolationError"):
        return None
    named = [(name, d) for name, d, v in request.required
             if (isinstance(v, Dim) and v.__name__ in text) or f"['{name}'].size()[{d}]" in text]
    which = ", ".join(f"{name} dim {d}" for name, d in named) or "a dimension"
    reasons = [ln.strip()[2:].split(". ")[0] for ln in text.splitlines() if ln.strip().startswith("- ")]
    if not reasons:  # the example's size outside a Dim's min / max
        return SpecializedDim(f"pipeq.split: dynamic= names {which} as dynamic, but torch.export refuses the "
                              f"example there: {text.strip().splitlines()[0]}; give Dims whose range holds the example")
    return SpecializedDim(
        f"pipeq.split: dynamic= asks for {which} to stay dynamic, but the model's code fixes its size in the trace "
        f"(torch.export: {'; '.join(reasons)}). Give that dimension as Dim.AUTO (dynamic where the model allows) "
        "or None (fixed), or change the model")


#: One input's held dimensions (dim 0 excepted): dim -> (lowest, highest or None, why); a
#: fixed one has lowest == highest and says why the trace fixed it.
Limits = dict[str, dict[int, tuple[int, "int | None", str]]]


def limits_of(names: Any, dynamic: Dims, static: Dims, why: Dims) -> Limits:
    """The sizes the trace holds for the inputs ``names`` (a stage's own: stage 0's positional
    ones, and the keyword inputs the driver hands it), beyond dim 0: those a microbatch of
    another size may not take. Dim 0 is left out: a batch splits into microbatches of any rows."""
    out: Limits = {}
    for name in names:
        held = {d: (lo, hi, "") for d, (lo, hi) in dynamic.get(name, {}).items() if d > 0}
        held.update((d, (n, n, why.get(name, {}).get(d, ""))) for d, n in static.get(name, {}).items() if d > 0)
        if held:
            out[name] = held
    return out


def check_limits(index: int, limits: Limits, values: dict[str, Any]) -> None:
    """Refuse an input of stage ``index`` whose size the trace does not hold: a graph traced for
    lengths of 2 or more may branch otherwise at length 1 (torch.export specializes sizes 0 and 1),
    and one whose length the trace fixed computes on that length alone."""
    for name, held in limits.items():
        v = values.get(name)
        if not isinstance(v, torch.Tensor):
            continue
        for d, (lo, hi, why) in held.items():
            n = v.shape[d] if d < v.dim() else None
            if n is None or lo <= n and (hi is None or n <= hi):
                continue
            if lo == hi:
                raise ValueError(f"split stage {index}: input {name!r} has size {n} in dim {d}, but the trace fixed "
                                 f"that dimension at {lo} ({why or 'the model fixes it'}; see Split.explain()): give "
                                 f"inputs of that size, or split again with that dimension dynamic")
            span = f"{lo}..{hi}" if hi is not None else f"{lo} or more"
            raise ValueError(f"split stage {index}: input {name!r} has size {n} in dim {d}, outside the sizes the "
                             f"trace holds for it ({span}: torch.export traces sizes 0 and 1 apart, and a forward may "
                             f"branch on them): give it a size of {lo} or more")
