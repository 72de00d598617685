"""Checkpoints of a pipeline: write stage snapshots to disk, read them back, re-split them.

The driver gathers one :class:`StageSnapshot` per stage (plain data, already on the CPU; see
:func:`stage_snapshot`) and :func:`save` writes them; :func:`load` reads a checkpoint back and
:func:`split` cuts it into snapshots for the current run, whose number of stages may differ.
Nothing here opens a socket or a process.

A checkpoint stores everything under *global* names: those of the flat model
``nn.Sequential(*layers)``, where a stage that is an ``nn.Sequential`` contributes each of its
children as one layer and any other stage module contributes itself as one layer. Stage k's
``offset`` is the number of layers of stages 0..k-1; its local ``"i.rest"`` is global
``f"{offset + i}.rest"`` (sequential) and its local ``"rest"`` is ``f"{offset}.rest"`` (otherwise).
The same flat model cut another way maps to the same names, so 3 stages load into 2.

On disk a checkpoint is a directory of ``stage-{k}.pt`` files (``torch.save``; read back with
``weights_only=True``, never by plain unpickling) and a ``manifest.json`` with every file's size
and sha256. Each file is written to a temporary name, fsynced and renamed; the manifest is written
the same way and last, so a directory without a manifest is an unfinished save.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch
from torch import nn

FORMAT = "pipeq-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"step-(\d+)")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupted, or does not fit the current stages."""


class StageSnapshot(TypedDict):
    """One stage's state under its *local* names (a plain dict, so it travels as data)."""

    model: dict[str, torch.Tensor]  # the stage module's state_dict
    optim: dict[str, dict]  # param name -> {"state": {...}, "group": {hyperparameters}}
    sched: dict | None  # lr-scheduler state_dict
    rng: torch.Tensor | None  # torch.get_rng_state() of the stage process
    layers: int
    sequential: bool


@dataclass
class StageLayout:
    """What :func:`split` needs to know of one current stage (local names)."""

    model_names: list[str]
    param_names: list[str]
    layers: int
    sequential: bool


@dataclass
class Checkpoint:
    """A loaded checkpoint: model and optimizer state under global names, the rest per saved stage."""

    model: dict[str, torch.Tensor]
    optim: dict[str, dict]
    sched: list[dict | None]
    rng: list[torch.Tensor | None]
    n_stages: int
    layers: list[int]
    meta: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------- names


def is_sequential(module: nn.Module) -> bool:
    return isinstance(module, nn.Sequential)


def layers_of(module: nn.Module) -> int:
    """How many layers of the flat model this stage module is."""
    return len(module) if is_sequential(module) else 1


def layout_of(module: nn.Module) -> StageLayout:
    return StageLayout(
        model_names=list(module.state_dict().keys()),
        param_names=[name for name, _ in module.named_parameters()],
        layers=layers_of(module),
        sequential=is_sequential(module),
    )


def layer_of(global_: str) -> int:
    """The flat-model layer a global name belongs to."""
    head = global_.split(".", 1)[0]
    if not head.isdigit():
        raise ValueError(f"{global_!r} is not a global name: it must start with a layer number")
    return int(head)


def to_global(local: str, offset: int, sequential: bool) -> str:
    if not sequential:
        return f"{offset}.{local}"
    head, dot, rest = local.partition(".")
    if not head.isdigit():
        raise ValueError(
            f"{local!r} does not start with a child index; an nn.Sequential stage must hold its "
            "parameters and buffers in its children (or pass sequential=False)"
        )
    return f"{offset + int(head)}{dot}{rest}"


# ---------------------------------------------------------------------------- optimizer


def _plain(value: Any) -> Any:
    """A detached CPU copy of tensors, tuples as lists, everything else as is."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _param_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The module's name of every optimizer parameter, in the optimizer's flattened order."""
    by_id = {id(p): name for name, p in module.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    unknown = [f"{tuple(p.shape)} (position {i})" for i, p in enumerate(params) if id(p) not in by_id]
    if unknown:
        raise ValueError(
            f"the optimizer holds parameters that are not in the stage module: {', '.join(unknown)}; "
            "build the stage's optimizer over module.parameters()"
        )
    return [by_id[id(p)] for p in params]


def optimizer_snapshot(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
    """The ``optim`` field of a snapshot: per parameter name, its state and its group's hyperparameters."""
    names = _param_names(module, optimizer)
    sd = optimizer.state_dict()
    out: dict[str, dict] = {name: {"state": {}, "group": {}} for name, _ in module.named_parameters()}
    for group in sd["param_groups"]:
        hyper = {k: _plain(v) for k, v in group.items() if k not in ("params", "param_names")}
        for pid in group["params"]:
            out[names[pid]] = {"state": _plain(sd["state"].get(pid, {})), "group": dict(hyper)}
    return out


def load_optimizer_snapshot(
    module: nn.Module, optimizer: torch.optim.Optimizer, optim: dict[str, dict], device: torch.device | str
) -> None:
    """Load an ``optim`` field (local names) into ``optimizer``, a fresh optimizer over ``module``."""
    names = _param_names(module, optimizer)
    missing = [n for n in names if n not in optim]
    if missing:
        raise ValueError(f"the optimizer snapshot has no entry for parameters: {', '.join(missing)}")
    state: dict[int, dict] = {}
    groups: list[dict] = []
    pos = 0
    for group in optimizer.param_groups:
        ids = list(range(pos, pos + len(group["params"])))
        pos += len(ids)
        hyper = {k: v for k, v in group.items() if k != "params"}  # kept for an empty group
        if ids:
            saved = [optim[names[i]]["group"] for i in ids]
            differ = [names[i] for i, g in zip(ids, saved) if g != saved[0]]
            if differ:
                raise ValueError(
                    f"parameters {names[ids[0]]} and {', '.join(differ)} are in one optimizer group "
                    "but their snapshots have different hyperparameters; group them as when saved"
                )
            for k, v in saved[0].items():  # back to the optimizer's own types (betas is a tuple)
                hyper[k] = tuple(v) if isinstance(group.get(k), tuple) and isinstance(v, list) else v
        groups.append({**hyper, "params": ids})
        for i in ids:
            entry = optim[names[i]]["state"]
            if entry:  # copies, so the live state never aliases the snapshot
                state[i] = {
                    k: v.detach().to(device, copy=True) if isinstance(v, torch.Tensor) else v
                    for k, v in entry.items()
                }
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def stage_snapshot(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    rng: bool = True,
) -> StageSnapshot:
    """Everything of one stage that a checkpoint keeps, as CPU copies under local names."""
    return StageSnapshot(
        model={k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()},
        optim=optimizer_snapshot(module, optimizer) if optimizer is not None else {},
        sched=_plain(scheduler.state_dict()) if scheduler is not None else None,
        rng=torch.get_rng_state() if rng else None,
        layers=layers_of(module),
        sequential=is_sequential(module),
    )


# ---------------------------------------------------------------------------- disk


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_atomic(directory: str, name: str, write: Any) -> None:
    """Write ``name`` through a temporary file in ``directory``: write(f), fsync, rename."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(directory: str, snapshots: list[StageSnapshot], meta: dict) -> None:
    """Write one checkpoint (``meta``: json-able, e.g. step and epoch) into ``directory``."""
    json.dumps(meta)  # fail before touching the disk if meta is not json-able
    os.makedirs(directory, exist_ok=True)
    manifest_path = os.path.join(directory, MANIFEST)
    if os.path.exists(manifest_path):  # never leave an old manifest over new files
        os.unlink(manifest_path)
        _fsync_dir(directory)
    names = [f"stage-{k}.pt" for k in range(len(snapshots))]
    for stale in os.listdir(directory):  # stages of a larger old checkpoint, crashed saves' temps
        if re.fullmatch(r"stage-\d+\.pt|\..+\.tmp", stale) and stale not in names:
            os.unlink(os.path.join(directory, stale))
    files = []
    offset = 0
    for name, snap in zip(names, snapshots):
        seq = snap["sequential"]
        data = {
            "model": {to_global(k, offset, seq): v for k, v in snap["model"].items()},
            "optim": {to_global(k, offset, seq): v for k, v in snap["optim"].items()},
            "sched": snap["sched"],
            "rng": snap["rng"],
            "layers": snap["layers"],
            "sequential": seq,
        }
        _write_atomic(directory, name, lambda f: torch.save(data, f))
        path = os.path.join(directory, name)
        files.append({"name": name, "bytes": os.path.getsize(path), "sha256": _sha256(path)})
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
    _write_atomic(directory, MANIFEST, lambda f: f.write(text))
    _fsync_dir(directory)


def load(directory: str) -> Checkpoint:
    """Read and verify a checkpoint; model and optimizer state come back under global names."""
    manifest_path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise CheckpointError(
            f"{directory} has no manifest.json: not a pipeq checkpoint, or its save did not finish"
        )
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{manifest_path} is not readable JSON ({e}); the checkpoint is damaged")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path} is not a pipeq checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{directory} is checkpoint format version {manifest.get('version')!r}; "
            f"this pipeq reads version {VERSION}"
        )
    files = manifest.get("files", [])
    if not (len(files) == manifest.get("n_stages") == len(manifest.get("layers", [])) and "meta" in manifest):
        raise CheckpointError(f"{manifest_path} is inconsistent (n_stages, layers, files, meta): damaged")
    ckpt = Checkpoint({}, {}, [], [], manifest["n_stages"], list(manifest["layers"]), manifest["meta"])
    for k, entry in enumerate(files):
        path = os.path.join(directory, os.path.basename(entry["name"]))  # never outside directory
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing; the checkpoint is incomplete")
        size = os.path.getsize(path)
        if size != entry["bytes"]:
            raise CheckpointError(f"{path} has {size} bytes, the manifest says {entry['bytes']}: corrupted")
        if _sha256(path) != entry["sha256"]:
            raise CheckpointError(f"{path} does not match its sha256 in the manifest: corrupted")
        try:
            data = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as e:
            raise CheckpointError(f"{path} cannot be loaded safely (weights_only): {e}") from e
        if not isinstance(data, dict) or not {"model", "optim", "sched", "rng", "layers"} <= data.keys():
            raise CheckpointError(f"{path} is not a pipeq stage file")
        if data["layers"] != ckpt.layers[k]:
            raise CheckpointError(f"{path} has {data['layers']} layers, its manifest {ckpt.layers[k]}")
        for part in ("model", "optim"):
            target = getattr(ckpt, part)
            dup = [name for name in data[part] if name in target]
            if dup:
                raise CheckpointError(f"{path} repeats {part} names of earlier stages: {', '.join(dup[:10])}")
            target.update(data[part])
        ckpt.sched.append(data["sched"])
        ckpt.rng.append(data["rng"])
    return ckpt


def checkpoint_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def _complete(root: str) -> list[tuple[int, str]]:
    """(step, path) of the complete ``step-<n>`` checkpoints under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.fullmatch(name)
        if m and os.path.isfile(os.path.join(root, name, MANIFEST)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def latest(root: str) -> str | None:
    """The complete ``step-<n>`` checkpoint under ``root`` with the largest n, or None."""
    found = _complete(root)
    return found[-1][1] if found else None


def prune(root: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints under ``root``; the deleted paths.

    The manifest goes first, so a deletion that is cut short leaves an incomplete checkpoint
    (ignored by :func:`latest`), never a complete-looking one with files missing.
    """
    if keep < 1:
        return []
    gone = []
    for _, path in _complete(root)[:-keep]:
        os.remove(os.path.join(path, MANIFEST))
        shutil.rmtree(path, ignore_errors=True)
        gone.append(path)
    return gone


# ---------------------------------------------------------------------------- re-split


def split(ckpt: Checkpoint, layouts: list[StageLayout]) -> list[StageSnapshot]:
    """Cut a checkpoint into one snapshot per current stage (local names).

    With as many stages as were saved, stage k gets saved stage k's scheduler state and RNG state.
    Otherwise every stage gets saved stage 0's scheduler state and ``rng=None``: RNG streams
    cannot be re-split, so the caller keeps (or reseeds) the current ones. A checkpoint without
    optimizer state gives ``optim={}`` everywhere; the caller then skips loading it.
    """
    have_optim = bool(ckpt.optim)
    missing: list[str] = []
    claimed: set[str] = set()
    claimed_optim: set[str] = set()
    out: list[StageSnapshot] = []
    offset = 0
    same = ckpt.n_stages == len(layouts)

    def take(names: list[str], table: dict[str, Any], taken: set[str], k: int, what: str) -> dict[str, Any]:
        """This stage's entries of a global-name ``table``, under their local names."""
        mine = {}
        for name in names:
            g = to_global(name, offset, lay.sequential)
            if g in table:
                mine[name] = table[g]
                taken.add(g)
            else:
                missing.append(f"{what}{g} (stage {k})")
        return mine

    for k, lay in enumerate(layouts):
        model = take(lay.model_names, ckpt.model, claimed, k, "")
        optim = take(lay.param_names, ckpt.optim, claimed_optim, k, "optimizer state of ") if have_optim else {}
        out.append(
            StageSnapshot(
                model=model,
                optim=optim,
                sched=ckpt.sched[k] if same else ckpt.sched[0] if ckpt.sched else None,
                rng=ckpt.rng[k] if same else None,
                layers=lay.layers,
                sequential=lay.sequential,
            )
        )
        offset += lay.layers
    unexpected = [g for g in ckpt.model if g not in claimed]
    unexpected += [f"optimizer state of {g}" for g in ckpt.optim if g not in claimed_optim]
    if missing or unexpected:
        parts = []
        saved_layers = sum(ckpt.layers)
        if saved_layers != offset:
            parts.append(f"the checkpoint has {saved_layers} layers, these stages {offset}")
        for label, names in (("missing", missing), ("unexpected", unexpected)):
            if names:
                more = f" and {len(names) - 10} more" if len(names) > 10 else ""
                parts.append(f"{label} {', '.join(names[:10])}{more}")
        raise CheckpointError(f"checkpoint does not fit these {len(layouts)} stages: " + "; ".join(parts))
    return out
