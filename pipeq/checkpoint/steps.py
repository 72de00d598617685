"""A run's checkpoints: one ``step-<n>`` directory per saved step, the latest one, pruning."""

from __future__ import annotations

import os
import re
import shutil

from pipeq.checkpoint.atomic import complete_at, foreign, recover, remove

__all__ = ["checkpoint_dir", "latest", "prune"]

_STEP_DIR = re.compile(r"step-(\d+)")
#: A step folder, or what a save into one leaves while it runs (or when killed): group 1 its name.
_STEP_ENTRY = re.compile(r"(step-\d+)|\.(step-\d+)\.(?:old|[0-9a-f]{16}\.tmp)")


def checkpoint_dir(root: str, step: int) -> str:
    """Where a run keeps its checkpoint of ``step`` under ``root``: ``step-<n>``."""
    return os.path.join(root, f"step-{step:08d}")


def _complete(root: str) -> list[tuple[int, str]]:
    """(step, path) of the complete ``step-<n>`` checkpoints under ``root``, oldest first (also
    one that only a save killed mid-swap holds, as ``.step-<n>.old``: :func:`pipeq.checkpoint.load` reads it)."""
    if not os.path.isdir(root):
        return []
    found = set()
    for name in os.listdir(root):
        m = _STEP_ENTRY.fullmatch(name)
        if m and not name.endswith(".tmp") and complete_at(os.path.join(root, name)):
            step_dir = m.group(1) or m.group(2)
            found.add((int(step_dir[5:]), os.path.join(root, step_dir)))
    return sorted(found)


def latest(root: str) -> str | None:
    """The complete ``step-<n>`` checkpoint under ``root`` with the largest n, or None."""
    found = _complete(root)
    return found[-1][1] if found else None


def prune(root: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints under ``root`` (``keep`` < 1: keep
    them all) and every leftover of an unfinished save: temporary directories, ``step-<n>``
    folders without a manifest (of older pipeq versions; only checkpoint files in them); a
    checkpoint a save left as ``.step-<n>.old`` is put back. The deleted paths.

    Each checkpoint's manifest goes first, so a deletion that is cut short leaves an incomplete
    checkpoint (ignored by :func:`latest`), never a complete-looking one with files missing.
    """
    if not os.path.isdir(root):
        return []
    gone = []
    for name in sorted({m.group(1) or m.group(2) for m in map(_STEP_ENTRY.fullmatch, os.listdir(root)) if m}):
        gone += recover(os.path.join(root, name))
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if (_STEP_DIR.fullmatch(name) and os.path.isdir(path) and not os.path.islink(path)
                and not complete_at(path) and not foreign(path)):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    if keep >= 1:
        for _, path in _complete(root)[:-keep]:
            remove(path)
            gone.append(path)
    return gone
