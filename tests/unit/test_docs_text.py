"""What the README and the docs say holds together: every Python block parses and is either run by
tests/docs or marked with the reason it is not, the README stays short, and no document or
docstring points at a path outside the repository, a dated run without its command, or the
project's source documents."""

from __future__ import annotations

import ast
import functools
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
