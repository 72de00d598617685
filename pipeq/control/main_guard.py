"""The main script: what a stage process finds in it, and refusals of what it could not unpickle.

Both start methods (spawn, forkserver) start a stage by running the main script again as
``__mp_main__`` (without what is under its ``if __name__ == "__main__":``) and unpickle what
refers to ``__main__`` from that; a package's ``__main__.py`` (python -m pkg) is not run again.
:func:`check_picklable` pickles what a stage is started with and refuses, before any process
starts, a class or function the stage could not find; :func:`check_main_guard` refuses a runner
started from the top level of the main script.

A main module with no file to run again (a notebook kernel, an interactive session, ``python -c``,
a script read from standard input with ``python -``) is another matter: the stage processes cannot
find what it defines by name, so :func:`stage_pickle` ships it by value, with cloudpickle (as Ray,
Dask and joblib do), and :func:`starting_stages` keeps multiprocessing from having each stage run
``<stdin>`` again. What travels by reference (a schedule, a tensor-parallel plan) is refused there
if it names ``__main__``. Either way the pickles reach a stage only through its process start.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import io
import os
import pickle
import sys
import threading
import types
from multiprocessing import process
from typing import Any, Iterator

from pipeq.errors import MainScriptError

__all__ = ["check_picklable", "check_main_guard", "main_script", "main_without_file", "stage_pickle",
           "starting_stages"]

_STARTING = threading.Lock()  # one start at a time hides __main__.__file__ (starting_stages)


class _MainNames(pickle.Pickler):
    """Pickles, and notes the top-level names of ``__main__`` that the pickle refers to."""

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self.names: list[str] = []

    def reducer_override(self, obj: Any) -> Any:
        if (isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__"
                and obj.__qualname__.split(".")[0] not in self.names):
            self.names.append(obj.__qualname__.split(".")[0])
        return NotImplemented  # pickled as usual



def check_picklable(what: str, obj: Any, *, by_value: bool = False) -> None:
    """Refuse, before any process starts, what a stage process could not unpickle. ``by_value``:
    ``obj`` travels as :func:`stage_pickle` makes it (by value, when ``__main__`` has no file)."""
    if by_value and main_without_file():
        try:
            _by_value_pickler(what)(io.BytesIO()).dump(obj)
        except MainScriptError:
            raise
        except Exception as exc:
            raise ValueError(f"{what} cannot be pickled to start its stage process ({exc}); define classes "
                             "and functions in the notebook or script itself or at module level of a module "
                             "(no lambdas or local classes there), or use mode='simulated'") from exc
        return
    pickler = _MainNames(io.BytesIO())
    try:
        pickler.dump(obj)
    except Exception as exc:
        raise ValueError(
            f"{what} cannot be pickled to start its stage process ({exc}); define classes and "
            "functions at module level (no lambdas or local classes), or use mode='simulated'"
        ) from exc
    if pickler.names:
        _check_main_names(what, pickler.names)


def main_without_file() -> bool:
    """True when ``__main__`` has no file a stage process could run again, nor a name to import it
    by: a notebook kernel, an interactive session, ``python -c``, or ``python -`` (whose
    ``__file__`` is ``<stdin>``)."""
    main = sys.modules.get("__main__")
    if main is None or getattr(getattr(main, "__spec__", None), "name", None):
        return False  # python -m: imported by name
    path = getattr(main, "__file__", None)
    if path and not os.path.isabs(path) and process.ORIGINAL_DIR is not None:
        path = os.path.join(process.ORIGINAL_DIR, path)  # where multiprocessing would look
    return not path or not os.path.isfile(path)


def stage_pickle(obj: Any) -> bytes:
    """``obj`` pickled for a stage process (see :func:`check_picklable` with ``by_value``): as
    usual, or when ``__main__`` has no file with cloudpickle, which ships what ``__main__``
    defines (classes, functions, lambdas) by value and everything else as pickle does."""
    if main_without_file():
        buf = io.BytesIO()
        _by_value_pickler("the stages")(buf).dump(obj)
        return buf.getvalue()
    return pickle.dumps(obj)


@contextlib.contextmanager
def starting_stages() -> Iterator[None]:
    """Around starting stage processes. With spawn and forkserver, multiprocessing has each child
    run ``__main__.__file__`` again; under ``python -`` that is ``<stdin>``, and every stage would
    die of FileNotFoundError. So a ``__file__`` that names no file is hidden from multiprocessing
    while they start (the stages get what ``__main__`` defines by value: :func:`stage_pickle`)."""
    main = sys.modules.get("__main__")
    if main is None or not getattr(main, "__file__", None) or not main_without_file():
        yield
        return
    with _STARTING:
        path = main.__file__
        del main.__file__
        try:
            yield
        finally:
            main.__file__ = path


_PICKLER: list[type] = []


def _by_value_pickler(what: str) -> type:
    """cloudpickle's Pickler, by value for what ``__main__`` defines only: any other class or
    function goes by reference as with pickle (a lambda or local class of a module is refused,
    as it is when ``__main__`` has a file)."""
    if _PICKLER:
        return _PICKLER[0]
    try:
        import cloudpickle
    except ImportError:
        raise MainScriptError(
            f"{what}: __main__ has no file here (a notebook, python - or python -c), so what it defines "
            "is shipped to the stage processes with cloudpickle, which is not installed: pip install "
            "cloudpickle, define the stages in a module of their own, or use mode='simulated'") from None

    class MainByValue(cloudpickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, (type, types.FunctionType)):
                module = getattr(obj, "__module__", None)
                # pickle's own, by reference, but for __main__'s and the types of what makes up a
                # function by value (code, cell: not found by name in builtins)
                if module != "__main__" and (module != "builtins" or getattr(builtins, obj.__qualname__, None) is obj):
                    return NotImplemented
            return super().reducer_override(obj)

    _PICKLER.append(MainByValue)
    return MainByValue


def main_script() -> "tuple[str, ast.Module] | None":
    """(path, parsed source) of the script stage processes run again at start; None when they
    run none (a package's ``__main__``, an interactive session, ``python -c``) or it cannot be read."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path or _package_main(main):
        return None
    try:
        with open(path, "rb") as f:
            return path, ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None


def _package_main(main: types.ModuleType) -> bool:
    name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    return name == "__main__" or name.endswith(".__main__")


def _guard(test: ast.expr) -> bool | None:
    """True for ``__name__ == "__main__"``, False for ``!=``, None for any other test."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], (ast.Eq, ast.NotEq))):
        return None
    left, right = test.left, test.comparators[0]

    def name(n: ast.expr) -> bool:
        return isinstance(n, ast.Name) and n.id == "__name__"

    def main(n: ast.expr) -> bool:
        return isinstance(n, ast.Constant) and n.value == "__main__"

    if not (name(left) and main(right) or main(left) and name(right)):
        return None
    return isinstance(test.ops[0], ast.Eq)


def _guarded_lines(tree: ast.Module) -> list[tuple[int, int]]:
    """The line ranges that run only when the script is ``__main__``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (eq := _guard(node.test)) is not None:
            block = node.body if eq else node.orelse
            if block:
                out.append((block[0].lineno, block[-1].end_lineno or block[-1].lineno))
    return out


def _bindings(stmts: list[ast.stmt], guarded: bool, into: tuple[set[str], set[str]]) -> None:
    """Names the statements bind at module level: into[0] outside the guard, into[1] under it."""
    for st in stmts:
        if isinstance(st, ast.If) and (eq := _guard(st.test)) is not None:
            _bindings(st.body, guarded or eq, into)
            _bindings(st.orelse, guarded or not eq, into)
            continue
        names = into[1] if guarded else into[0]
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(st.name)
            continue
        if isinstance(st, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in st.names)
            continue
        blocks = [getattr(st, f) for f in ("body", "orelse", "finalbody") if isinstance(getattr(st, f, None), list)]
        blocks += [h.body for h in getattr(st, "handlers", [])]
        for b in blocks:
            _bindings(b, guarded, into)
        names.update(h.name for h in getattr(st, "handlers", []) if h.name)
        heads = [v for f, v in ast.iter_fields(st) if f not in ("body", "orelse", "finalbody", "handlers")]
        for head in heads:
            for part in head if isinstance(head, list) else [head]:
                if isinstance(part, ast.AST):
                    names.update(n.id for n in ast.walk(part) if isinstance(n, ast.Name)
                                 and isinstance(n.ctx, ast.Store))


def _check_main_names(what: str, names: list[str]) -> None:
    """Refuse a stage (or loss, optimizer...) that a stage process could not unpickle: one that
    names a class or function of the main script defined under its ``__main__`` guard, or of a
    package's ``__main__.py``."""
    main = sys.modules.get("__main__")
    if main is not None and getattr(main, "__file__", None) and _package_main(main):
        raise MainScriptError(
            f"{what}: {names[0]} is defined in {main.__file__}; stage processes do not run a package's "
            "__main__.py again, so they cannot find it. Define it in another module of the package "
            "and import it from there")
    if main_without_file():
        raise MainScriptError(
            f"{what}: {names[0]} is defined in __main__, which has no file here (a notebook, python - or "
            f"python -c), and {what} is handed to the stage processes by name, so they cannot find it. "
            f"Define {names[0]} in a module of its own and import it, or use mode='simulated'")
    found = main_script()
    if found is None:
        return
    path, tree = found
    outside: set[str] = set()
    inside: set[str] = set()
    _bindings(tree.body, False, (outside, inside))
    for name in names:
        if name in inside and name not in outside:
            script = os.path.basename(path)
            raise MainScriptError(
                f"{what}: {name} is defined under 'if __name__ == \"__main__\":' in {script}; every "
                f"stage process runs {script} again without that block, so it cannot find {name}. Define "
                f"{name} at module level, above the guard (or in a module of its own)")


def check_main_guard() -> None:
    """Refuse to start stage processes from the top level of the main script outside an
    ``if __name__ == "__main__":`` block: each stage process runs the script again (``spawn``
    and ``forkserver`` both do), which would start the pipeline again from inside the stage."""
    found = main_script()
    if found is None:
        return
    path, tree = found
    main_globals = sys.modules["__main__"].__dict__
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_globals is main_globals and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None or os.path.realpath(frame.f_code.co_filename) != os.path.realpath(path):
        return  # not by the script's own top-level code (at exit, a REPL after python -i, exec)
    line = frame.f_lineno
    if any(first <= line <= last for first, last in _guarded_lines(tree)):
        return
    script = os.path.basename(path)
    raise MainScriptError(
        f"the pipeline is started at the top level of {script} (line {line}), outside an "
        f"'if __name__ == \"__main__\":' block. Every stage process runs {script} again when it "
        "starts (with either start method, 'spawn' or 'forkserver'), so each would start the "
        "pipeline again. Put the code that builds and runs the runner under "
        f"'if __name__ == \"__main__\":' (classes and functions the stages use stay above it)")
