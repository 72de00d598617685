"""What the README and the docs say holds together: every Python block parses and is either run by
tests/docs or marked with the reason it is not, the README stays short, no document or
docstring points at a path outside the repository, a dated run without its command, or the
project's source documents, and every name under pipeq that any text of the repository writes
(code, messages, docs, job files) is one that exists: no module path that moved lives on."""

from __future__ import annotations

import ast
import functools
import importlib
import os
import re

import pytest

from doc_blocks import ROOT, pages, python_blocks

BLOCKS = [b for p in pages() for b in python_blocks(p)]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.where)
def test_every_python_block_parses_and_says_why_when_it_is_not_run(block):
    ast.parse(block.code, block.where)
    if block.not_run is not None:
        assert len(block.not_run.split()) >= 3, f"{block.where}: say why the block is not run"


def test_the_docs_run_most_of_their_python():
    run = [b for b in BLOCKS if b.not_run is None]
    assert len(run) >= len(BLOCKS) / 2, [b.where for b in BLOCKS if b.not_run]


def test_the_readme_is_short():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) <= 200


@functools.cache
def _texts() -> list[tuple[str, str]]:
    """(path, text) of every page, and of every docstring of the library, examples, benches,
    recipes and tests."""
    found = []
    for page in pages() + ["bench/README.md", "tests/gpu/README.md"]:
        path = os.path.join(ROOT, page)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                found.append((page, f.read()))
    for top in ("pipeq", "examples", "bench", "workers", "tests", "docs"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT)
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
                if name.endswith(".py"):
                    tree = ast.parse(text)
                    docs = [ast.get_docstring(n, clean=False) for n in ast.walk(tree)
                            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
                    found.append((rel, "\n".join(d for d in docs if d)))
                elif name.endswith((".md", ".toml", ".sh", ".sbatch")) or name in ("README",):
                    found.append((rel, text))
    return found


OUTSIDE = re.compile(r"\.\./shared|/work/|seeds/|/home/\w+|notes/(algorithms|what-users-hit|measured-here|house)\.md")
SOURCE_DOCS = re.compile(r"\bseed (tutorial|notebook|document|code|paper|repo\w*|\d{3})\b|\bthe seeds?\b(?! of)"
                         r"(?!'s)(?= (says|shows|gives|ships|runs|uses|'s|notebook|tutorial))", re.IGNORECASE)
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def test_no_text_points_outside_the_repository_or_at_source_documents():
    bad = []
    for path, text in _texts():
        for pattern in (OUTSIDE, SOURCE_DOCS):
            bad += [f"{path}: {m.group(0)!r}" for m in pattern.finditer(text)]
    assert not bad, bad


def test_no_text_dates_a_measurement():
    """A figure comes with the command that prints it, not the day it was printed."""
    bad = [f"{path}: {m.group(0)}" for path, text in _texts() for m in DATE.finditer(text)]
    assert not bad, bad


#: A dotted name under pipeq as a text writes it: ``pipeq.trace.analyze``, ``import pipeq.models.resnet``,
#: a job file's ``"pipeq.models.resnet:stages"``.
DOTTED = re.compile(r"(?<![\w./-])pipeq(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*)?")
#: ``from pipeq.x import a, b`` (the names imported from pipeq or a module under it).
FROM_IMPORT = re.compile(r"\bfrom (pipeq(?:\.\w+)*) import (?:\(([^)]*)\)|([\w ,]+))")
#: Written like a name under pipeq, but none: a logger's name.
NOT_NAMES = {"pipeq.zap"}
#: Modules never imported to look a name up in (importing one changes the process: its names are read).
NOT_IMPORTED = {"pipeq.runtime.preload", "pipeq.__main__"}
PACKAGE = os.path.join(ROOT, "pipeq")


def _every_text() -> list[tuple[str, str]]:
    """(path, whole text) of every source, page, job file and script of the repository."""
    found = [(name, open(os.path.join(ROOT, name), encoding="utf-8").read())
             for name in ("README.md", "mkdocs.yml", "setup.cfg", "pyproject.toml")
             if os.path.isfile(os.path.join(ROOT, name))]
    for top in ("pipeq", "examples", "bench", "workers", "tests", "docs"):
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in files:
                if name.endswith((".py", ".md", ".toml", ".sh", ".sbatch", ".yml", ".cfg", ".ipynb")):
                    path = os.path.join(folder, name)
                    with open(path, encoding="utf-8", errors="replace") as f:
                        found.append((os.path.relpath(path, ROOT), f.read()))
    return found


def _module_names(module: str) -> set[str]:
    """The names a module's top level defines, read without importing it."""
    path = os.path.join(ROOT, *module.split(".")) + ".py"
    names: set[str] = set()
    for node in ast.parse(open(path, encoding="utf-8").read()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


@functools.cache
def resolves(dotted: str) -> bool:
    """Whether ``dotted`` (``pipeq.a.b``, ``pipeq.a.b:name``) names a module of pipeq or something in
    one: its longest prefix of module files, then attributes of that module."""
    path, _, attr = dotted.partition(":")
    parts = path.split(".")
    where, i = ROOT, 0
    while i < len(parts) and (os.path.isdir(os.path.join(where, parts[i]))
                              or os.path.isfile(os.path.join(where, parts[i] + ".py"))):
        where, i = os.path.join(where, parts[i]), i + 1
    rest = parts[i:] + ([attr] if attr else [])
    if i == 0:
        return False
    if not rest:
        return True
    module = ".".join(parts[:i])
    if module in NOT_IMPORTED:
        return len(rest) == 1 and rest[0] in _module_names(module)
    try:
        value = importlib.import_module(module)
        for name in rest:
            value = getattr(value, name)
    except (ImportError, AttributeError):
        return False
    return True


def _names_written(text: str) -> list[str]:
    names = [m.group(0) for m in DOTTED.finditer(text)]
    for m in FROM_IMPORT.finditer(text):
        imported = re.sub(r"#[^\n]*", "", m[2] or m[3]).replace("\n", ",")
        names += [f"{m[1]}.{n.split(' as ')[0].strip()}" for n in imported.split(",") if n.strip()]
    return [n for n in names if n not in NOT_NAMES]


def test_every_name_under_pipeq_that_a_text_writes_exists():
    """No alias for a moved module exists: a text (example, test, bench, job file, page, docstring,
    message) that still names a module where it used to be fails here, whatever the name."""
    here = os.path.relpath(__file__, ROOT)  # this file writes wrong names on purpose (below)
    bad = sorted({f"{path}: {name}" for path, text in _every_text() if path != here
                  for name in _names_written(text) if not resolves(name)})
    assert not bad, "\n".join(bad)


def test_the_scan_finds_a_moved_module_and_a_name_that_is_not_there():
    moved = "from pipeq import report\nstages = \"pipeq.resnet:stages\"\nx = pipeq.al.ALLayer\n"
    assert [n for n in _names_written(moved) if not resolves(n)] == [
        "pipeq.resnet:stages", "pipeq.al.ALLayer", "pipeq.report"]
    assert not resolves("pipeq.models.resnet:nothing") and not resolves("pipeq.trace.no_such_name")
    assert resolves("pipeq.models.resnet:stages") and resolves("pipeq.trace.analyze")
    assert resolves("pipeq.runtime.preload.signal") and not resolves("pipeq.runtime.preload.gone")
