"""A checkpoint on disk: a directory of ``stage-{k}.pt`` files and a manifest, saved and loaded.

On disk a checkpoint is a directory of ``stage-{k}.pt`` files (``torch.save``; read back with
``weights_only=True``, never by plain unpickling), each under global names, and a
``manifest.json`` with every file's size and sha256. :func:`save` replaces a checkpoint only once
the new one is complete (:mod:`pipeq.checkpoint.atomic`), and :func:`load` verifies every file
against the manifest before it reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any

import torch

from pipeq.checkpoint.atomic import complete_at, foreign, fsync_dir, make_temp, old_of, recover, swap, write_file
from pipeq.checkpoint.data import (FORMAT, MANIFEST, VERSION, Checkpoint, CheckpointError, DamagedCheckpointError,
                                   StageSnapshot)
from pipeq.checkpoint.full import is_no_space, no_space_error
from pipeq.checkpoint.names import StageNames, aux_name

__all__ = ["save", "load"]


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save(directory: str, snapshots: list[StageSnapshot], meta: dict) -> None:
    """Write one checkpoint (``meta``: json-able, e.g. step and epoch) as ``directory``.

    A checkpoint already there is replaced only once the new one is complete and fsynced (see
    :mod:`pipeq.checkpoint.atomic`): killed at any moment, this leaves ``directory`` loadable as
    the old or the new checkpoint. ``directory`` must hold nothing but a checkpoint (it is
    replaced as a whole).
    """
    json.dumps(meta)  # fail before touching the disk if meta is not json-able
    path = _save_target(directory)
    try:
        tmp = make_temp(path)
    except OSError as exc:
        if is_no_space(exc):  # no inode left for it
            raise no_space_error(path, "the checkpoint (creating its temporary directory)", exc) from exc
        raise
    try:
        _write_checkpoint(tmp, snapshots, meta)
        swap(tmp, path)
    except _Full as full:  # said plainly, once the partial copy is gone (and its space back)
        shutil.rmtree(tmp, ignore_errors=True)
        raise no_space_error(path, full.what, full.exc) from full.exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save_target(directory: str) -> str:
    """The real path a save into ``directory`` replaces, checked, with earlier saves' leftovers put right."""
    path = os.path.realpath(directory)
    parent = os.path.dirname(path)
    cwd = os.path.realpath(os.getcwd())
    if os.path.commonpath([path, cwd]) == path:
        raise CheckpointError(f"cannot save a checkpoint as {path}: it is (or holds) the current directory, "
                              "and a save replaces the whole directory; save into a directory of its own")
    os.makedirs(parent, exist_ok=True)
    recover(path)
    if os.path.lexists(path):
        if not os.path.isdir(path):
            raise CheckpointError(f"cannot save a checkpoint as {path}: it is a file, not a directory")
        alien = foreign(path)
        if alien:
            more = f" and {len(alien) - 5} more" if len(alien) > 5 else ""
            raise CheckpointError(
                f"cannot save a checkpoint as {path}: it holds files no checkpoint holds "
                f"({', '.join(alien[:5])}{more}), and a save replaces the whole directory; "
                "save into a directory of its own")
    return path


def _stage_data(k: int, snap: StageSnapshot, offset: int) -> dict[str, Any]:
    """What ``stage-{k}.pt`` holds: stage k's snapshot under global names (it starts at layer
    ``offset``): a tied parameter only from its owner, under its key; every copy's optimizer state,
    under the copy's own name (see :mod:`pipeq.checkpoint.names`)."""
    seq = snap["sequential"]
    names = StageNames(k, offset, seq, snap.get("names_global", False), snap.get("ties") or {},
                       snap.get("tie_stages") or {})
    model = snap["model"]
    data = {
        "model": {key: model[n] for n, key in names.saved(model)},
        "optim": {names.own(n): v for n, v in snap["optim"].items()},
        "sched": snap["sched"],
        "rng": snap["rng"],
        "layers": snap["layers"],
        "sequential": seq,
        "scaler": snap.get("scaler"),
    }
    aux = snap.get("aux")
    if aux is not None:
        data["aux"] = {part: {aux_name(k, n): v for n, v in aux[part].items()} for part in ("model", "optim")}
    return data


def _write_checkpoint(tmp: str, snapshots: list[StageSnapshot], meta: dict) -> None:
    """Write every stage file into the empty directory ``tmp``, fsynced, and the manifest last."""
    files = []
    offset = 0
    for k, snap in enumerate(snapshots):
        data = _stage_data(k, snap, offset)
        file = os.path.join(tmp, f"stage-{k}.pt")
        _writing(f"stage {k}", lambda: write_file(file, lambda f: torch.save(data, f)))
        files.append({"name": f"stage-{k}.pt", "bytes": os.path.getsize(file), "sha256": _sha256(file)})
        offset += snap["layers"]
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "n_stages": len(snapshots),
        "layers": [s["layers"] for s in snapshots],
        "files": files,
        "meta": meta,
    }
    text = json.dumps(manifest, indent=1).encode()
    file = os.path.join(tmp, MANIFEST)
    _writing("the manifest", lambda: (write_file(file, lambda f: f.write(text)), fsync_dir(tmp)))


class _Full(Exception):
    """The disk filled while a save wrote ``what``: see :func:`save`."""

    def __init__(self, what: str, exc: BaseException) -> None:
        super().__init__(what)
        self.what, self.exc = what, exc


def _writing(what: str, write: Any) -> None:
    """``write()``, a full disk on the way raised as a :class:`_Full` saying what was written."""
    try:
        write()
    except (OSError, RuntimeError) as exc:
        if is_no_space(exc):
            raise _Full(what, exc) from exc
        raise


def load(directory: str) -> Checkpoint:
    """Read and verify a checkpoint; model and optimizer state come back under global names.

    A save into ``directory`` that was killed between its two renames left the previous
    checkpoint as ``.{name}.old`` and none at ``directory``: that one is read.
    """
    if not complete_at(directory) and complete_at(old_of(os.path.realpath(directory))):
        directory = old_of(os.path.realpath(directory))
    manifest = _read_manifest(directory)
    ckpt = Checkpoint({}, {}, [], [], manifest["n_stages"], list(manifest["layers"]), manifest["meta"])
    for k, entry in enumerate(manifest["files"]):
        path = os.path.join(directory, os.path.basename(entry["name"]))  # never outside directory
        _add_stage(ckpt, k, path, _read_stage(path, entry, ckpt.layers[k]))
    return ckpt


def _read_manifest(directory: str) -> dict[str, Any]:
    """``directory``'s manifest, checked to be one of a complete checkpoint this pipeq reads."""
    manifest_path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise CheckpointError(
            f"{directory} has no manifest.json: not a pipeq checkpoint, or its save did not finish"
        )
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise DamagedCheckpointError(f"{manifest_path} is not readable JSON ({e}); the checkpoint is damaged")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DamagedCheckpointError(f"{manifest_path} is not a pipeq checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{directory} is checkpoint format version {manifest.get('version')!r}; "
            f"this pipeq reads version {VERSION}"
        )
    files = manifest.setdefault("files", [])
    if not (len(files) == manifest.get("n_stages") == len(manifest.get("layers", [])) and "meta" in manifest):
        raise DamagedCheckpointError(f"{manifest_path} is inconsistent (n_stages, layers, files, meta): damaged")
    return manifest


def _read_stage(path: str, entry: dict[str, Any], layers: int) -> dict[str, Any]:
    """The stage file ``path``, verified against its manifest ``entry`` and read safely."""
    if not os.path.isfile(path):
        raise DamagedCheckpointError(f"{path} is missing; the checkpoint is incomplete")
    size = os.path.getsize(path)
    if size != entry["bytes"]:
        raise DamagedCheckpointError(f"{path} has {size} bytes, the manifest says {entry['bytes']}: corrupted")
    if _sha256(path) != entry["sha256"]:
        raise DamagedCheckpointError(f"{path} does not match its sha256 in the manifest: corrupted")
    try:
        data = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:
        raise DamagedCheckpointError(f"{path} cannot be loaded safely (weights_only): {e}") from e
    if not isinstance(data, dict) or not {"model", "optim", "sched", "rng", "layers"} <= data.keys():
        raise DamagedCheckpointError(f"{path} is not a pipeq stage file")
    if data["layers"] != layers:
        raise DamagedCheckpointError(f"{path} has {data['layers']} layers, its manifest {layers}")
    return data


def _add_stage(ckpt: Checkpoint, k: int, path: str, data: dict[str, Any]) -> None:
    """Stage file ``k`` (read from ``path``) into ``ckpt``: its names must be new."""
    for part in ("model", "optim"):
        target = getattr(ckpt, part)
        dup = [name for name in data[part] if name in target]
        if dup:
            raise CheckpointError(f"{path} repeats {part} names of earlier stages: {', '.join(dup[:10])}")
        target.update(data[part])
    aux = data.get("aux")
    if aux is not None:
        if not (isinstance(aux, dict) and isinstance(aux.get("model"), dict) and isinstance(aux.get("optim"), dict)):
            raise CheckpointError(f"{path} has a malformed auxiliary head entry")
        ckpt.aux_model.update(aux["model"])
        ckpt.aux_optim.update(aux["optim"])
    ckpt.sched.append(data["sched"])
    ckpt.rng.append(data["rng"])
    if k == 0 and isinstance(data.get("scaler"), dict):
        ckpt.scaler = data["scaler"]
