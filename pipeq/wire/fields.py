"""The control payloads' fields: what each value must be (:class:`Check`), and how a field is declared.

:mod:`pipeq.wire.control` declares every payload's fields with :func:`wire` and checks them on
decode; a failed check is a :class:`ControlError` naming the kind and the field.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from pipeq.errors import CodecError
from pipeq.wire.messages import Kind

__all__ = ["ControlError", "Check", "INT", "COUNT", "POSITIVE", "FLOAT", "SECONDS", "TEXT", "FLAG", "MAP", "DATA",
           "list_of", "nullable", "wire", "Field", "REQUIRED"]


class ControlError(CodecError):
    """A control message's payload is malformed: ``kind`` and ``field`` say where."""

    def __init__(self, kind: Kind, field: str, problem: str) -> None:
        self.kind = kind
        self.field = field
        super().__init__(f"malformed {kind.name} message: field {field!r} {problem}")


# -- what a field's value must be ------------------------------------------------------------------
@dataclass(frozen=True)
class Check:
    """A test a field's value must pass; ``what`` says what it requires, ``many`` the same of
    a list's elements ("an integer >= 1", "integers >= 1")."""

    what: str
    many: str
    test: Callable[[Any], bool]


INT = Check("an integer", "integers", lambda v: type(v) is int)
COUNT = Check("an integer >= 0", "integers >= 0", lambda v: type(v) is int and v >= 0)
POSITIVE = Check("an integer >= 1", "integers >= 1", lambda v: type(v) is int and v >= 1)
FLOAT = Check("a float", "floats", lambda v: type(v) is float)
SECONDS = Check("a finite number >= 0", "finite numbers >= 0",
                lambda v: (type(v) is int or type(v) is float) and 0 <= v < math.inf)
TEXT = Check("a string", "strings", lambda v: type(v) is str)
FLAG = Check("true or false", "booleans", lambda v: type(v) is bool)
MAP = Check("a map", "maps", lambda v: type(v) is dict)
DATA = Check("plain data", "plain data", lambda v: True)  # a tree: its reader checks it (pipeq.stage.microbatch)


def list_of(item: Check, *, nonempty: bool = False) -> Check:
    """A list whose every element passes ``item`` (and, with ``nonempty``, has one at least)."""

    what = f"a {'non-empty ' if nonempty else ''}list of {item.many}"
    return Check(what, f"lists of {item.many}",
                 lambda v: type(v) is list and (bool(v) or not nonempty) and all(item.test(x) for x in v))


def nullable(check: Check) -> Check:
    """``check``'s values, or nil."""
    return Check(f"{check.what} or nil", f"{check.many} or nils", lambda v: v is None or check.test(v))


REQUIRED: Any = dataclasses.MISSING


def wire(check: Check, *, default: Any = REQUIRED, name: str | None = None) -> Any:
    """A payload field checked with ``check``. With a ``default`` (None or False) it may be absent
    on the wire, where it reads as the default and is left out while it holds it. ``name``: the
    field's key on the wire when it is not the attribute's name (a Python keyword)."""
    meta = {"check": check, "name": name}
    return field(metadata=meta) if default is REQUIRED else field(default=default, metadata=meta)


class Field(NamedTuple):
    attr: str
    name: str  # on the wire
    check: Check
    optional: bool
    default: Any
