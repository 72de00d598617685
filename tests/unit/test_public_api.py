"""The public API: every name the API reference documents imports from ``pipeq`` or a public module
(pipeq.launch.reference.FRONTS), never from the folders below them; every public name is
documented; every package says what it exports (``__all__``); the names imported on first use are
the ones type checkers and the reference see."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re

import pytest

import pipeq
from pipeq.launch import reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "pipeq")
#: The folders users never import from (the CLI is a command, not an import).
PRIVATE = ("pipeq.control", "pipeq.runtime", "pipeq.launch", "pipeq.wire", "pipeq.stage", "pipeq.parallel")


def _hook():
    """docs/_hooks/generate.py, the MkDocs hook that fills the pages' markers."""
    spec = importlib.util.spec_from_file_location("docs_generate", os.path.join(ROOT, "docs", "_hooks", "generate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def api_page() -> str:
    """docs/reference/api.md as MkDocs renders it (its marker filled in)."""
    with open(os.path.join(ROOT, "docs", "reference", "api.md"), encoding="utf-8") as f:
        return _hook().render(f.read(), "reference/api.md")


def documented(page: str) -> list[str]:
    """The dotted names a page's mkdocstrings blocks document: each ``::: name``, and the members a
    block of a module lists (``members: [a, b]`` under ``::: pipeq.trace``); a class's members are
    its attributes, documented with it."""
    out = []
    for block in re.split(r"^(?=::: )", page, flags=re.MULTILINE):
        m = re.match(r"::: (\S+)", block)
        if not m:
            continue
        out.append(m[1])
        members = re.search(r"^\s+members: \[([^\]]*)\]", block, flags=re.MULTILINE)
        if members and members[1].strip():
            names = [name.strip() for name in members[1].split(",")]
            value = _value(m[1]) if not_public(m[1]) is None else None
            if isinstance(value, type):
                assert [n for n in names if not hasattr(value, n)] == [], m[1]
            else:
                out += [f"{m[1]}.{name}" for name in names]
    return out


def not_public(name: str) -> str | None:
    """Why ``name`` is not a public name (None when it is: a public module, or a name of one's
    ``__all__`` that imports from it)."""
    if name in reference.FRONTS:
        return None
    if name.startswith(PRIVATE):
        return f"{name}: under a private folder"
    front, _, attr = name.rpartition(".")
    if front not in reference.FRONTS:
        return f"{name}: {front} is not a public module"
    module = importlib.import_module(front)
    if attr not in module.__all__:
        return f"{name}: not in {front}.__all__"
    try:
        exec(f"from {front} import {attr}", {})
    except ImportError as exc:
        return f"{name}: {exc}"
    return None


def test_every_object_the_api_reference_documents_imports_from_the_public_surface():
    names = documented(api_page())
    assert len(names) > 150 and "pipeq.PipelineRunner" in names and "pipeq.trace.analyze" in names
    assert [why for name in names if (why := not_public(name))] == []


def test_the_check_fails_for_a_name_documented_at_an_internal_path():
    page = ("::: pipeq.control.config.RunConfig\n\n::: pipeq.research.al.executor.ALExecutor\n\n"
            "::: pipeq.schedules\n    options:\n      members: [zbv, EXPORTS]\n\n::: pipeq.RunConfig\n")
    assert [why for name in documented(page) if (why := not_public(name))] == [
        "pipeq.control.config.RunConfig: under a private folder",
        "pipeq.research.al.executor.ALExecutor: pipeq.research.al.executor is not a public module",
        "pipeq.schedules.EXPORTS: not in pipeq.schedules.__all__"]


def test_every_public_name_is_documented_once():
    names = documented(api_page())
    shown = {id(_value(name)) for name in names}
    missing = [f"{front}.{attr}" for front in reference.FRONTS for attr in importlib.import_module(front).__all__
               if id(_value(f"{front}.{attr}")) not in shown]
    assert missing == []
    assert len(names) == len(set(names))


def _value(name: str):
    if name in reference.FRONTS:
        return importlib.import_module(name)
    front, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(front), attr)


def test_the_public_modules_are_public_and_listed_on_the_api_page():
    page = api_page()
    assert not [front for front in reference.FRONTS if front.startswith(PRIVATE)]
    assert all(f"`{front}`" in page for front in reference.FRONTS)
    assert "pipeq.launch" not in page and "pipeq.control" not in page


def test_a_section_that_names_a_private_path_is_refused(monkeypatch):
    sections = reference.API_SECTIONS
    monkeypatch.setattr(reference, "API_SECTIONS", [*sections, ("x", "", ["pipeq.control.config.RunConfig"])])
    with pytest.raises(ValueError, match=r"documents \['pipeq.control.config.RunConfig'\]"):
        reference.api_markdown()
    monkeypatch.setattr(reference, "API_SECTIONS", [(t, i, [n for n in names if n != "pipeq.Tie"])
                                                    for t, i, names in sections])
    with pytest.raises(ValueError, match=r"public names no section of API_SECTIONS documents: \['pipeq.Tie'\]"):
        reference.api_markdown()


def _packages() -> list[str]:
    """Every package's __init__.py, relative to the repository."""
    return sorted(os.path.relpath(os.path.join(folder, "__init__.py"), ROOT)
                  for folder, _, files in os.walk(PACKAGE) if "__init__.py" in files)


def _assigned(tree: ast.Module, name: str) -> ast.expr | None:
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return node.value
    return None


@pytest.mark.parametrize("path", _packages())
def test_every_package_says_what_it_exports(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        value = _assigned(ast.parse(f.read()), "__all__")
    assert isinstance(value, ast.List), f"{path}: no __all__ = [...]"
    module = importlib.import_module(os.path.dirname(path).replace(os.sep, "."))
    folder = os.path.dirname(os.path.join(ROOT, path))
    submodules = {n for n in module.__all__ if os.path.exists(os.path.join(folder, n + ".py"))
                  or os.path.isfile(os.path.join(folder, n, "__init__.py"))}  # what ``import *`` imports
    assert [n for n in module.__all__ if not hasattr(module, n) and n not in submodules] == []


@pytest.mark.parametrize("front", ["pipeq", "pipeq.research", "pipeq.trace"])
def test_the_names_imported_on_first_use_are_what_type_checkers_see(front):
    """A front imports some names on first use (``__getattr__``: no torch at ``import pipeq``);
    its ``if TYPE_CHECKING:`` block imports the same names, for type checkers and the reference."""
    module = importlib.import_module(front)
    with open(module.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    seen = {a.asname or a.name for node in block.body for a in node.names}
    assert seen == set(module._LAZY) and set(module._LAZY) <= set(module.__all__)
    for name in module._LAZY:
        assert getattr(module, name) is not None
