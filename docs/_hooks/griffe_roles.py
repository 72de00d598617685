"""A griffe extension for the API reference: pipeq's docstrings are written with reStructuredText's
roles (``:class:`~pipeq.errors.PipelineError```, ``:meth:`state_dict```) and literal blocks
(``text::``), which mkdocstrings' Markdown shows verbatim. Each role becomes a code span linked to
the object when the reference documents it (an optional cross-reference: plain code otherwise), and
a paragraph's closing ``::`` a colon, the indented block after it staying a code block."""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|mod|meth|func|attr|data|exc|obj):`(?P<text>[^`]+)`")
_LITERAL = re.compile(r"(?<=\S)::$", re.MULTILINE)


def _target(text: str) -> tuple[str, str]:
    """A role's content -> (what it shows, the identifier it names)."""
    if text.endswith(">") and " <" in text:  # `title <target>`
        title, target = text[:-1].split(" <", 1)
        return title, target.lstrip("~")
    target = text.lstrip("~").removesuffix("()")
    shown = target.rsplit(".", 1)[-1] if text.startswith("~") else target
    return shown + ("()" if text.endswith("()") else ""), target


def _context(obj: Any) -> str:
    """Where a dotless role target is looked for: the class a docstring belongs to (or is), else
    the module."""
    while obj is not None and not (obj.is_class or obj.is_module):
        obj = obj.parent
    return obj.path if obj is not None else ""


def convert(text: str, context: str = "") -> str:
    """``text`` (a docstring) with its roles and literal-block colons in Markdown."""

    def link(match: re.Match[str]) -> str:
        shown, target = _target(match["text"])
        if "." not in target and context:
            target = f"{context}.{target}"
        return f'<autoref identifier="{html.escape(target)}" optional>`{shown}`</autoref>'

    return _LITERAL.sub(":", _ROLE.sub(link, text))


class RstRoles(griffe.Extension):
    """Every object's docstring converted (:func:`convert`) as griffe loads it."""

    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        """griffe's event: an object was loaded, its docstring with it."""
        if obj.docstring is not None:
            obj.docstring.value = convert(obj.docstring.value, _context(obj))
