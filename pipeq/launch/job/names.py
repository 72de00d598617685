"""The importable names a job file gives: resolved, their factories' arguments checked, typos caught."""

from __future__ import annotations

import difflib
import importlib
import inspect
import sys
from typing import Any, Callable, Iterable, Mapping, Sequence

__all__ = ["resolve", "check_args", "did_you_mean", "required_positional", "importable"]


def importable(paths: Sequence[str]) -> None:
    """Make a job's modules importable: its folders go *after* everything already on sys.path,
    so installed packages win (a ``pipeq/`` source checkout beside the job file, of another
    version, must not shadow the pipeq running it, here or in a stage process)."""
    for p in paths:
        if p not in sys.path:
            sys.path.append(p)


def resolve(spec: str, key: str) -> Any:
    """The object named by ``"package.module:attribute"`` (``key`` names the setting in errors)."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"{key} = {spec!r}: expected 'package.module:name', e.g. 'torch.optim:SGD'")
    mod_name, attr = spec.split(":")
    try:
        obj: Any = importlib.import_module(mod_name)
    except Exception as exc:
        raise ValueError(f"{key} = {spec!r}: cannot import {mod_name!r} ({type(exc).__name__}: {exc})") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{key} = {spec!r}: module {mod_name!r} has no {attr!r}") from None
    return obj


def required_positional(fn: Callable, given: Iterable[str] = ()) -> int:
    """How many positional arguments ``fn`` needs beyond the keywords ``given`` (its job's
    ``*_args``); -1 when it has no signature to read."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return -1
    given = set(given)
    return sum(1 for p in params if p.default is p.empty and p.name not in given
               and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def check_args(fn: Callable, args: Mapping[str, Any], key: str, spec: str) -> None:
    """The job's ``{key}_args`` are keyword arguments ``fn`` (named ``{key} = spec``) accepts: a
    ``ValueError`` names the key, the factory and the arguments it does not take. (A callable
    without a readable signature, or one taking ``**kwargs``, is left to the call.)"""
    if not args:
        return
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    takes = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [a for a in args if a not in takes]
    if unknown:
        close = did_you_mean(unknown, takes, "it takes") if takes else "it takes no keyword arguments"
        raise ValueError(f"{key}_args: {key} = {spec!r} does not take the argument(s) {unknown}; {close}")


def did_you_mean(wrong: Iterable[str], known: Iterable[str], what: str) -> str:
    """``did you mean 'x'?`` for names close to a known one, else the known names."""
    known = sorted(known)
    close = {w: difflib.get_close_matches(w, known, n=1) for w in wrong}
    if all(close.values()):
        return "did you mean " + ", ".join(repr(c[0]) for c in close.values()) + "?"
    return f"{what}: {known}"
