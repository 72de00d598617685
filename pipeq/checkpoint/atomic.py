"""Crash-safe replacement of a checkpoint directory: write a new one beside it, swap it in.

:func:`pipeq.checkpoint.save` never writes into a checkpoint: it writes the new one into a fresh
hidden sibling ``.{name}.<random>.tmp`` (:func:`make_temp`; every file fsynced, the manifest last),
then swaps it in with two renames (``name`` -> ``.{name}.old``, the new one -> ``name``) and
deletes the old one (:func:`swap`). Killed at any moment, it leaves the last complete checkpoint
loadable: a load reads ``.{name}.old`` when a kill fell between the two renames, and the next save
(or :func:`recover`) puts things right. A directory without a manifest is an unfinished save,
never loaded.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from typing import Any

from pipeq.checkpoint.data import MANIFEST

__all__ = ["write_file", "replace_file", "fsync_dir", "complete_at", "old_of", "foreign", "remove", "recover", "make_temp", "swap"]

#: What a checkpoint directory may hold: its files, and temporary files of older pipeq versions.
_OURS = re.compile(r"manifest\.json|stage-\d+\.pt|\..+\.tmp")


def write_file(path: str, write: Any) -> None:
    """Create ``path`` (it must not exist), write(f), fsync."""
    with open(path, "xb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def replace_file(path: str, write: Any) -> None:
    """Write the single file ``path`` crash-safe: write(f) into ``path.tmp`` (fsynced), renamed
    over ``path``; ``path`` is the old file or the new one at any moment, and a failure (a full
    disk) leaves no ``path.tmp`` behind."""
    tmp = path + ".tmp"
    _unlink(tmp)  # a killed write's leftover
    try:
        write_file(tmp, write)
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def _unlink(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def fsync_dir(directory: str) -> None:
    """Make ``directory``'s entries (files made, renames) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def complete_at(path: str) -> bool:
    """Whether ``path`` holds a complete checkpoint (its manifest, written last)."""
    return os.path.isfile(os.path.join(path, MANIFEST))


def old_of(path: str) -> str:
    """Where a save keeps the previous checkpoint while it swaps the new one in."""
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.old")


def _temps_of(path: str) -> list[str]:
    """The temporary directories saves into ``path`` left behind (killed before the swap)."""
    parent, name = os.path.split(path)
    pattern = re.compile(rf"\.{re.escape(name)}\.[0-9a-f]{{16}}\.tmp")
    try:
        entries = os.listdir(parent)
    except FileNotFoundError:
        return []
    return [os.path.join(parent, e) for e in entries if pattern.fullmatch(e)]


def foreign(path: str) -> list[str]:
    """Entries of directory ``path`` that no checkpoint holds."""
    return sorted(e for e in os.listdir(path) if not _OURS.fullmatch(e))


def remove(path: str) -> None:
    """Delete a checkpoint directory, manifest first: a deletion cut short leaves an incomplete
    checkpoint (never loaded), never a complete-looking one with files missing."""
    try:
        os.remove(os.path.join(path, MANIFEST))
    except FileNotFoundError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def recover(directory: str) -> list[str]:
    """Put right what interrupted saves into ``directory`` left behind; the paths deleted.

    A save killed before its swap leaves a ``.{name}.<random>.tmp`` sibling: deleted. One killed
    between the swap's two renames leaves the previous checkpoint as ``.{name}.old`` and no
    ``name``: renamed back. One killed after them leaves ``.{name}.old`` next to the new ``name``:
    deleted. Saves call this first; only one process may save into a directory at a time.
    """
    path = os.path.realpath(directory)
    old = old_of(path)
    gone = []
    if os.path.isdir(old):
        if complete_at(path) or not complete_at(old):
            remove(old)
            gone.append(old)
        elif not os.path.lexists(path) or (os.path.isdir(path) and not foreign(path)):
            if os.path.lexists(path):  # an unfinished save of an older pipeq: the old one wins
                remove(path)
                gone.append(path)
            os.rename(old, path)
            fsync_dir(os.path.dirname(path))
    for tmp in _temps_of(path):
        shutil.rmtree(tmp, ignore_errors=True)
        gone.append(tmp)
    return gone


def make_temp(path: str) -> str:
    """A new empty hidden sibling directory of ``path`` to write its next checkpoint into."""
    parent, name = os.path.split(path)
    while True:
        tmp = os.path.join(parent, f".{name}.{secrets.token_hex(8)}.tmp")
        try:
            os.mkdir(tmp)
            return tmp
        except FileExistsError:
            continue


def swap(new: str, path: str) -> None:
    """Put the complete checkpoint ``new`` in place of ``path`` (the old one goes last)."""
    old = old_of(path)
    had = os.path.lexists(path)
    if had:
        os.rename(path, old)
    try:
        os.rename(new, path)
    except BaseException:
        if had and not os.path.lexists(path):
            os.rename(old, path)
        raise
    fsync_dir(os.path.dirname(path))
    if had:
        remove(old)
