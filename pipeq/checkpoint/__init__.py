"""Checkpoints of a pipeline: write stage snapshots to disk, read them back, re-split them.

The driver gathers one :class:`StageSnapshot` per stage (plain data, already on the CPU; see
:func:`stage_snapshot`) and :func:`save` writes them; :func:`load` reads a checkpoint back and
:func:`split` cuts it into snapshots for the current run, whose number of stages may differ.
Nothing here opens a socket or a process.

Everything is named by *global* names, those of the flat model ``nn.Sequential(*layers)``
(:func:`flat_model`), where a stage that is an ``nn.Sequential`` contributes each of its children
as one layer and any other stage module contributes itself as one layer. Stage k's ``offset`` is
the number of layers of stages 0..k-1; its local ``"i.rest"`` is global ``f"{offset + i}.rest"``
(sequential) and its local ``"rest"`` is ``f"{offset}.rest"`` (otherwise). The same flat model cut
another way maps to the same names, so 3 stages load into 2. ``runner.state_dict()``,
``runner.load_state_dict()``, checkpoints and ``pipeq launch``'s model.pt all use these names
(:func:`global_state`, :func:`split_state`).

An interlocking run's auxiliary heads are no layers of the flat model: stage k's head is saved
under ``aux_heads.{k}.{local}`` (parameters, buffers and their optimizer state), and loads only
into a run of as many stages (a head belongs to its stage's boundary). A stage with several
optimizers (Associated Learning's f+b and g+h) saves each parameter's state under its own name,
and its schedulers' states as ``{"pipeq_schedulers": [...]}``.

On disk a checkpoint is a directory of ``stage-{k}.pt`` files (``torch.save``; read back with
``weights_only=True``, never by plain unpickling) and a ``manifest.json`` with every file's size
and sha256. :func:`save` never writes into a checkpoint: it writes the new one into a fresh hidden
sibling ``.{name}.<random>.tmp`` (every file fsynced, the manifest last), then swaps it in with two
renames (``name`` -> ``.{name}.old``, the new one -> ``name``) and deletes the old one. Killed at any
moment, it leaves the last complete checkpoint loadable: :func:`load` reads ``.{name}.old`` when a
kill fell between the two renames, and the next save (or :func:`prune`) puts things right. A
directory without a manifest is an unfinished save, never loaded.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import secrets
import shutil
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, NotRequired, Sequence, TypedDict

import torch
from torch import nn

FORMAT = "pipeq-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"step-(\d+)")
#: A step folder, or what a save into one leaves while it runs (or when killed): group 1 its name.
_STEP_ENTRY = re.compile(r"(step-\d+)|\.(step-\d+)\.(?:old|[0-9a-f]{16}\.tmp)")


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
    scaler: NotRequired[dict | None]  # fp16's loss scale (the same on every stage)
    # interlocking: the stage's auxiliary head, {"model": state_dict, "optim": like optim}
    aux: NotRequired[dict | None]


@dataclass
class StageLayout:
    """What :func:`split` and :func:`split_state` need to know of one current stage (local names)."""

    model_names: list[str]
    param_names: list[str]
    layers: int
    sequential: bool
    shapes: dict[str, list[int]] = field(default_factory=dict)  # model name -> shape (empty: unchecked)
    dtypes: dict[str, str] = field(default_factory=dict)  # model name -> dtype, "float32"
    aux: dict[str, Any] | None = None  # the auxiliary head's layout (these fields of it), if any


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
    scaler: dict | None = None  # fp16's loss-scaler state (pipeq.numerics.LossScaler)
    aux_model: dict[str, torch.Tensor] = field(default_factory=dict)  # "aux_heads.{k}.{local}" -> tensor
    aux_optim: dict[str, dict] = field(default_factory=dict)  # the heads' optimizer state, by those names


# ---------------------------------------------------------------------------- names


def is_sequential(module: nn.Module) -> bool:
    """Whether the stage contributes its children as layers: an ``nn.Sequential`` whose state
    all lives in its children (one with parameters or buffers of its own is one layer)."""
    return isinstance(module, nn.Sequential) and all(
        name.partition(".")[0].isdigit() for name in module.state_dict())


def layers_of(module: nn.Module) -> int:
    """How many layers of the flat model this stage module is."""
    return len(module) if is_sequential(module) else 1


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layout_of(module: nn.Module) -> StageLayout:
    sd = module.state_dict()
    return StageLayout(
        model_names=list(sd.keys()),
        param_names=[name for name, _ in module.named_parameters()],
        layers=layers_of(module),
        sequential=is_sequential(module),
        shapes={name: list(t.shape) for name, t in sd.items()},
        dtypes={name: _dtype_name(t.dtype) for name, t in sd.items()},
    )


def flat_model(stages: Iterable[nn.Module]) -> nn.Sequential:
    """The flat model ``nn.Sequential(*layers)`` of these stages (sharing their modules): its
    ``state_dict()`` keys are the names ``runner.state_dict()``, checkpoints and model.pt use, so
    ``flat_model(stages).load_state_dict(runner.state_dict())`` loads a run into your model."""
    layers: list[nn.Module] = []
    for stage in stages:
        layers += list(stage) if is_sequential(stage) else [stage]
    return nn.Sequential(*layers)


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


#: The first part of an auxiliary head's names in a checkpoint (see the module docstring).
AUX_PREFIX = "aux_heads"


def aux_name(stage: int, local: str) -> str:
    """Stage ``stage``'s auxiliary head's ``local`` name as a checkpoint holds it."""
    return f"{AUX_PREFIX}.{stage}.{local}"


def global_names(layouts: Sequence[StageLayout]) -> list[list[str]]:
    """Each stage's model names (in order) as global names."""
    out, offset = [], 0
    for lay in layouts:
        out.append([to_global(name, offset, lay.sequential) for name in lay.model_names])
        offset += lay.layers
    return out


def global_state(per_stage: Sequence[tuple[Sequence[str], Sequence[torch.Tensor]]],
                 layouts: Sequence[StageLayout]) -> "collections.OrderedDict[str, torch.Tensor]":
    """Each stage's (local names, tensors) as one state_dict under global names, in the flat
    model's order (what ``runner.state_dict()`` returns)."""
    out: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
    offset = 0
    for (names, tensors), lay in zip(per_stage, layouts):
        for name, t in zip(names, tensors):
            out[to_global(name, offset, lay.sequential)] = t
        offset += lay.layers
    return out


def split_state(state: Mapping[str, torch.Tensor], layouts: Sequence[StageLayout]
                ) -> list[tuple[list[str], list[torch.Tensor]]]:
    """A state_dict under global names as each stage's (local names, tensors), every key and
    shape checked before anything is loaded (a ``ValueError`` naming the key otherwise).

    Also accepted, for state_dicts of earlier pipeq versions and of ``nn.Sequential(*stages)``:
    stage-prefixed names ``f"{k}.{local}"``, when the keys are exactly those.
    """
    flat = global_names(layouts)
    prefixed = [[f"{k}.{name}" for name in lay.model_names] for k, lay in enumerate(layouts)]
    keys = set(state)
    want_flat = {g for names in flat for g in names}
    want_prefixed = {g for names in prefixed for g in names}
    if keys == want_flat:
        chosen = flat
    elif keys == want_prefixed:
        chosen = prefixed
    else:  # report against the naming the keys are closer to
        chosen, want = ((prefixed, want_prefixed) if len(keys & want_prefixed) > len(keys & want_flat)
                        else (flat, want_flat))
        raise ValueError(
            f"state_dict does not fit these {len(layouts)} stages: missing keys {sorted(want - keys)}, "
            f"unexpected keys {sorted(keys - want)} (keys are the flat model's names, as "
            "runner.state_dict() and pipeq.checkpoint.flat_model(stages).state_dict() give them)")
    per_stage = []
    for k, (lay, keys_k) in enumerate(zip(layouts, chosen)):
        tensors = []
        for name, key in zip(lay.model_names, keys_k):
            t = state[key]
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"state_dict['{key}'] is a {type(t).__name__}, not a tensor")
            shape = lay.shapes.get(name)
            if shape is not None and list(t.shape) != list(shape):
                raise ValueError(f"state_dict['{key}'] has shape {tuple(t.shape)}, stage {k} expects {tuple(shape)}")
            tensors.append(t.detach().cpu())
        per_stage.append((list(lay.model_names), tensors))
    return per_stage


# ---------------------------------------------------------------------------- optimizer


#: How a dict with keys other than strings travels (the wire takes string keys only): its items.
_KEYED = "pipeq_keyed_items"


def _plain(value: Any) -> Any:
    """A detached CPU copy of tensors, tuples as lists, a dict whose keys are not all strings
    (MultiStepLR's milestones, a Counter of ints) as ``{"pipeq_keyed_items": [[key, value], ...]}``,
    everything else as is (:func:`_unplain` undoes it)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: _plain(v) for k, v in value.items()}
        return {_KEYED: [[_plain(k), _plain(v)] for k, v in value.items()]}
    return value


def _unplain(value: Any) -> Any:
    """:func:`_plain`'s keyed items back as a dict (list keys as tuples, to be hashable)."""
    if isinstance(value, list):
        return [_unplain(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_KEYED} and isinstance(value[_KEYED], list):
            return {tuple(k) if isinstance(k, list) else k: _unplain(v) for k, v in value[_KEYED]}
        return {k: _unplain(v) for k, v in value.items()}
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


def optimizers_snapshot(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, dict]:
    """The ``optim`` field of a stage whose ``optimizers`` hold disjoint parameters of ``module``
    (AL's f+b and g+h): each parameter's entry from the optimizer that holds it."""
    out: dict[str, dict] = {name: {"state": {}, "group": {}} for name, _ in module.named_parameters()}
    for optimizer in optimizers:
        snap = optimizer_snapshot(module, optimizer)
        out.update((name, snap[name]) for name in _param_names(module, optimizer))
    return out


_SCHEDULERS = "pipeq_schedulers"


def schedulers_snapshot(schedulers: Sequence[Any]) -> dict | None:
    """The ``sched`` field: one scheduler's state, or ``{"pipeq_schedulers": [...]}`` of several."""
    if not schedulers:
        return None
    states = [_plain(s.state_dict()) for s in schedulers]
    return states[0] if len(states) == 1 else {_SCHEDULERS: states}


def load_schedulers_snapshot(schedulers: Sequence[Any], sched: dict | None, stage: int) -> None:
    """Load a ``sched`` field into these schedulers (nothing when either side has none)."""
    if not schedulers or sched is None:
        return
    states = sched[_SCHEDULERS] if isinstance(sched, dict) and _SCHEDULERS in sched else [sched]
    if len(states) != len(schedulers):
        raise CheckpointError(f"stage {stage} has {len(schedulers)} lr scheduler(s) but the checkpoint holds the "
                              f"state of {len(states)}: load it into a run of the same schedule and lr_scheduler")
    for scheduler, state in zip(schedulers, states):
        scheduler.load_state_dict(_unplain(state))


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

#: What a checkpoint directory may hold: its files, and temporary files of older pipeq versions.
_OURS = re.compile(r"manifest\.json|stage-\d+\.pt|\..+\.tmp")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_file(path: str, write: Any) -> None:
    """Create ``path`` (it must not exist), write(f), fsync."""
    with open(path, "xb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _complete_at(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def _old_of(path: str) -> str:
    """Where :func:`save` keeps the previous checkpoint while it swaps the new one in."""
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


def _foreign(path: str) -> list[str]:
    """Entries of directory ``path`` that no checkpoint holds."""
    return sorted(e for e in os.listdir(path) if not _OURS.fullmatch(e))


def _remove(path: str) -> None:
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
    old = _old_of(path)
    gone = []
    if os.path.isdir(old):
        if _complete_at(path) or not _complete_at(old):
            _remove(old)
            gone.append(old)
        elif not os.path.lexists(path) or (os.path.isdir(path) and not _foreign(path)):
            if os.path.lexists(path):  # an unfinished save of an older pipeq: the old one wins
                _remove(path)
                gone.append(path)
            os.rename(old, path)
            _fsync_dir(os.path.dirname(path))
    for tmp in _temps_of(path):
        shutil.rmtree(tmp, ignore_errors=True)
        gone.append(tmp)
    return gone


def save(directory: str, snapshots: list[StageSnapshot], meta: dict) -> None:
    """Write one checkpoint (``meta``: json-able, e.g. step and epoch) as ``directory``.

    A checkpoint already there is replaced only once the new one is complete and fsynced (see the
    module docstring): killed at any moment, this leaves ``directory`` loadable as the old or the
    new checkpoint. ``directory`` must hold nothing but a checkpoint (it is replaced as a whole).
    """
    json.dumps(meta)  # fail before touching the disk if meta is not json-able
    path = os.path.realpath(directory)
    parent, name = os.path.split(path)
    cwd = os.path.realpath(os.getcwd())
    if os.path.commonpath([path, cwd]) == path:
        raise CheckpointError(f"cannot save a checkpoint as {path}: it is (or holds) the current directory, "
                              "and a save replaces the whole directory; save into a directory of its own")
    os.makedirs(parent, exist_ok=True)
    recover(path)
    if os.path.lexists(path):
        if not os.path.isdir(path):
            raise CheckpointError(f"cannot save a checkpoint as {path}: it is a file, not a directory")
        foreign = _foreign(path)
        if foreign:
            more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
            raise CheckpointError(
                f"cannot save a checkpoint as {path}: it holds files no checkpoint holds "
                f"({', '.join(foreign[:5])}{more}), and a save replaces the whole directory; "
                "save into a directory of its own")
    while True:
        tmp = os.path.join(parent, f".{name}.{secrets.token_hex(8)}.tmp")
        try:
            os.mkdir(tmp)
            break
        except FileExistsError:
            continue
    try:
        files = []
        offset = 0
        for k, snap in enumerate(snapshots):
            seq = snap["sequential"]
            data = {
                "model": {to_global(n, offset, seq): v for n, v in snap["model"].items()},
                "optim": {to_global(n, offset, seq): v for n, v in snap["optim"].items()},
                "sched": snap["sched"],
                "rng": snap["rng"],
                "layers": snap["layers"],
                "sequential": seq,
                "scaler": snap.get("scaler"),
            }
            aux = snap.get("aux")
            if aux is not None:
                data["aux"] = {part: {aux_name(k, n): v for n, v in aux[part].items()} for part in ("model", "optim")}
            file = os.path.join(tmp, f"stage-{k}.pt")
            _write_file(file, lambda f: torch.save(data, f))
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
        _write_file(os.path.join(tmp, MANIFEST), lambda f: f.write(text))
        _fsync_dir(tmp)
        _swap(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap(new: str, path: str) -> None:
    """Put the complete checkpoint ``new`` in place of ``path`` (the old one goes last)."""
    old = _old_of(path)
    had = os.path.lexists(path)
    if had:
        os.rename(path, old)
    try:
        os.rename(new, path)
    except BaseException:
        if had and not os.path.lexists(path):
            os.rename(old, path)
        raise
    _fsync_dir(os.path.dirname(path))
    if had:
        _remove(old)


def load(directory: str) -> Checkpoint:
    """Read and verify a checkpoint; model and optimizer state come back under global names.

    A save into ``directory`` that was killed between its two renames left the previous
    checkpoint as ``.{name}.old`` and none at ``directory``: that one is read.
    """
    if not _complete_at(directory) and _complete_at(_old_of(os.path.realpath(directory))):
        directory = _old_of(os.path.realpath(directory))
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
    return ckpt


def checkpoint_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def _complete(root: str) -> list[tuple[int, str]]:
    """(step, path) of the complete ``step-<n>`` checkpoints under ``root``, oldest first (also
    one that only a save killed mid-swap holds, as ``.step-<n>.old``: :func:`load` reads it)."""
    if not os.path.isdir(root):
        return []
    found = set()
    for name in os.listdir(root):
        m = _STEP_ENTRY.fullmatch(name)
        if m and not name.endswith(".tmp") and _complete_at(os.path.join(root, name)):
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
                and not _complete_at(path) and not _foreign(path)):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    if keep >= 1:
        for _, path in _complete(root)[:-keep]:
            _remove(path)
            gone.append(path)
    return gone


# ---------------------------------------------------------------------------- re-split


def split(ckpt: Checkpoint, layouts: list[StageLayout]) -> list[StageSnapshot]:
    """Cut a checkpoint into one snapshot per current stage (local names), checked first: a
    name missing or left over, or a tensor whose shape or dtype is not the stage's (when the
    layouts give them), raises a :class:`CheckpointError` naming each, before any stage changes.

    With as many stages as were saved, stage k gets saved stage k's scheduler state and RNG state.
    Otherwise every stage gets saved stage 0's scheduler state and ``rng=None``: RNG streams
    cannot be re-split, so the caller keeps (or reseeds) the current ones. A checkpoint without
    optimizer state gives ``optim={}`` everywhere; the caller then skips loading it.
    """
    have_optim = bool(ckpt.optim)
    same = ckpt.n_stages == len(layouts)
    heads = [k for k, lay in enumerate(layouts) if lay.aux]
    if (heads or ckpt.aux_model) and not same:
        raise CheckpointError(
            f"the checkpoint was saved from {ckpt.n_stages} stages and "
            f"{'holds' if ckpt.aux_model else 'these stages have'} auxiliary heads: a head belongs to its stage's "
            f"boundary, so it loads only into {ckpt.n_stages} stages cut as when saved (runner.load_state_dict "
            "loads the main path alone into any cut)")
    missing: list[str] = []
    misfit: list[str] = []
    claimed: set[str] = set()
    claimed_optim: set[str] = set()
    claimed_aux: set[str] = set()
    out: list[StageSnapshot] = []
    offset = 0

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

    def fits(k: int, g: str, t: Any, shape: Any, dtype: Any) -> None:
        if not isinstance(t, torch.Tensor):
            misfit.append(f"{g} is a {type(t).__name__} in the checkpoint, not a tensor")
        elif shape is not None and list(t.shape) != list(shape):
            misfit.append(f"{g} has shape {tuple(t.shape)} in the checkpoint, stage {k} expects {tuple(shape)}")
        elif dtype is not None and _dtype_name(t.dtype) != dtype:
            misfit.append(f"{g} is {_dtype_name(t.dtype)} in the checkpoint, stage {k} holds {dtype}")

    def take_aux(k: int, names: list[str], table: dict[str, Any], what: str) -> dict[str, Any]:
        mine = {}
        for name in names:
            g = aux_name(k, name)
            if g in table:
                mine[name] = table[g]
                claimed_aux.add(what + g)
            else:
                missing.append(f"{what}{g} (stage {k})")
        return mine

    for k, lay in enumerate(layouts):
        model = take(lay.model_names, ckpt.model, claimed, k, "")
        for name, t in model.items():
            fits(k, to_global(name, offset, lay.sequential), t, lay.shapes.get(name), lay.dtypes.get(name))
        optim = take(lay.param_names, ckpt.optim, claimed_optim, k, "optimizer state of ") if have_optim else {}
        aux = None
        if lay.aux:
            aux = {"model": take_aux(k, lay.aux["model_names"], ckpt.aux_model, ""),
                   "optim": take_aux(k, lay.aux["param_names"], ckpt.aux_optim, "optimizer state of ")
                   if have_optim else {}}
            for name, t in aux["model"].items():
                fits(k, aux_name(k, name), t, lay.aux["shapes"].get(name), lay.aux["dtypes"].get(name))
        out.append(
            StageSnapshot(
                model=model,
                optim=optim,
                sched=ckpt.sched[k] if same else ckpt.sched[0] if ckpt.sched else None,
                rng=ckpt.rng[k] if same else None,
                layers=lay.layers,
                sequential=lay.sequential,
                scaler=ckpt.scaler,
                aux=aux,
            )
        )
        offset += lay.layers
    unexpected = [g for g in ckpt.model if g not in claimed]
    unexpected += [f"optimizer state of {g}" for g in ckpt.optim if g not in claimed_optim]
    unexpected += [g for g in ckpt.aux_model if g not in claimed_aux]
    unexpected += [f"optimizer state of {g}" for g in ckpt.aux_optim
                   if have_optim and f"optimizer state of {g}" not in claimed_aux]
    if missing or unexpected or misfit:
        parts = []
        saved_layers = sum(ckpt.layers)
        if saved_layers != offset:
            parts.append(f"the checkpoint has {saved_layers} layers, these stages {offset}")
        for label, names in (("missing ", missing), ("unexpected ", unexpected), ("", misfit)):
            if names:
                more = f" and {len(names) - 10} more" if len(names) > 10 else ""
                parts.append(f"{label}{', '.join(names[:10])}{more}")
        raise CheckpointError(f"checkpoint does not fit these {len(layouts)} stages: " + "; ".join(parts))
    return out
