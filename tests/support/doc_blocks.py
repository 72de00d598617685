"""The Python blocks of the README and of docs/: found, marked runnable or not, and run in order.

A fenced block whose info string is ``python`` (or ``py``) is runnable: the tests run a page's
runnable blocks in order in one fresh, file-less ``__main__`` (as a notebook would: a later block
sees what an earlier one defined). A block that cannot run here is marked on the line just before
its fence with the reason, which must say why::

    <!-- not run: needs a CUDA device -->
    ```python
    ...
    ```

Blocks of other languages (bash, toml) are not Python and are not run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import types
from typing import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<why>.*?)\s*-->")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<info>[^\s`]*)")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced Python block: its page, its first line's number (1-based), its code, and the
    reason it is not run (None: it runs)."""

    page: str
    line: int
    code: str
    not_run: str | None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[str]:
    """The README and every Markdown page of docs/, relative to the repository."""
    found = ["README.md"]
    docs = os.path.join(ROOT, "docs")
    for folder, _, files in sorted(os.walk(docs)):
        found += sorted(os.path.relpath(os.path.join(folder, f), ROOT) for f in files if f.endswith(".md"))
    return found


def python_blocks(page: str) -> list[Block]:
    """The Python blocks of ``page`` (relative to the repository), in order."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        lines = f.read().splitlines()
    blocks, k = [], 0
    while k < len(lines):
        m = FENCE.match(lines[k])
        if m is None:
            k += 1
            continue
        fence, indent, start = m.group("fence"), len(m.group("indent")), k
        k += 1
        body = []
        while k < len(lines) and not lines[k].strip().startswith(fence):
            body.append(lines[k][indent:] if not lines[k][:indent].strip() else lines[k].lstrip())
            k += 1
        k += 1
        if m.group("info").lower() not in ("python", "py"):
            continue
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marked = NOT_RUN.search(before)
        blocks.append(Block(page, start + 1, "\n".join(body) + "\n", marked.group("why") if marked else None))
    return blocks


@contextlib.contextmanager
def file_less_main() -> Iterator[types.ModuleType]:
    """A fresh ``__main__`` with no file, as a notebook's or ``python -``'s, for the time of a page."""
    saved = sys.modules["__main__"]
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    try:
        yield main
    finally:
        sys.modules["__main__"] = saved


def run_page(page: str) -> int:
    """Run ``page``'s runnable blocks in order in one file-less ``__main__``; the number run. An
    error names the block's page and line."""
    blocks = [b for b in python_blocks(page) if b.not_run is None]
    with file_less_main() as main:
        for block in blocks:
            code = compile(block.code, f"{block.where}", "exec")
            try:
                exec(code, main.__dict__)
            except BaseException as exc:
                raise AssertionError(f"the block at {block.where} failed: {type(exc).__name__}: {exc}") from exc
    return len(blocks)
