"""Names a package imports on first use (PEP 562), so that importing it stays light (no torch).

    _LAZY = {"PipelineRunner": ("pipeq.control.runner", "PipelineRunner"), "split": ("pipeq.split", None)}
    __getattr__ = lazy_getattr(__name__, _LAZY, globals())

A name maps to ``(module, attribute)``, or ``(module, None)`` for the module itself; the first
use imports it and keeps it in the package's namespace, so the next one is a plain lookup. The
package's ``if TYPE_CHECKING:`` block imports the same names, for type checkers and the reference.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, names: Mapping[str, tuple[str, str | None]],
                 namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The module-level ``__getattr__`` of ``package`` (whose globals are ``namespace``) that
    imports ``names`` on first use."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attr = names[name]
        value = importlib.import_module(module)
        if attr is not None:
            value = getattr(value, attr)
        namespace[name] = value
        return value

    return __getattr__
