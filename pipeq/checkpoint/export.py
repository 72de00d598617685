"""``pipeq export``: a run's model state as one file or folder other tools read (DCP, safetensors, torch.save).

The state is the whole model's, under its own names: those of the model that :func:`pipeq.split`
cut (``transformer.h.0.attn.c_attn.weight``), or the flat model's for a list of stages. A tied
parameter, which a checkpoint holds once, is written under every name the model gives it
(``tok_emb.weight`` and ``lm_head.weight``), so the unsplit model loads the export with a strict
``load_state_dict``::

    sd = model.state_dict(); torch.distributed.checkpoint.load(sd, checkpoint_id=out)   # dcp
    model.load_state_dict(safetensors.torch.load_file(out))                              # safetensors
    model.load_state_dict(torch.load(out, weights_only=True))                            # pt

Optimizer state stays in the checkpoint (resume from it).
"""

from __future__ import annotations

import os
from typing import Mapping

import torch

from pipeq.checkpoint.atomic import replace_file
from pipeq.checkpoint.data import MANIFEST, CheckpointError
from pipeq.checkpoint.disk import load
from pipeq.checkpoint.full import describe_checkpoint, is_no_space, no_space_error
from pipeq.checkpoint.steps import latest

__all__ = ["FORMATS", "ALIASES", "model_state", "save_model", "with_aliases", "export"]

FORMATS = ("dcp", "safetensors", "pt")
#: The checkpoint meta entry (and model.pt's companion) that maps each tied alias to its key.
ALIASES = "tied_names"


def with_aliases(state: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """``state`` with each tied parameter also under its other names (``aliases``: alias -> the
    name ``state`` holds it under), the same tensor, in the model's order where known."""
    out = dict(state)
    for alias, key in aliases.items():
        if key not in state:
            raise CheckpointError(f"the tied name {alias!r} refers to {key!r}, which the state does not hold")
        out[alias] = state[key]
    return out


def _find(source: str) -> str:
    """The checkpoint directory or model file ``source`` names (a run directory: its final
    state, else its newest checkpoint)."""
    if os.path.isfile(source):
        return source
    if not os.path.isdir(source):
        raise FileNotFoundError(f"{source}: no such checkpoint, run directory or model file")
    if os.path.isfile(os.path.join(source, MANIFEST)):
        return source
    for candidate in (os.path.join(source, "final"), latest(os.path.join(source, "checkpoints"))):
        if candidate and os.path.isfile(os.path.join(candidate, MANIFEST)):
            return candidate
    raise CheckpointError(f"{source} holds no checkpoint: name a checkpoint directory (with {MANIFEST}), a run "
                          "directory of pipeq launch, or a model.pt")


def model_state(source: str) -> dict[str, torch.Tensor]:
    """The whole model's state in ``source`` (see :func:`_find`), tied names included."""
    path = _find(source)
    if os.path.isfile(path):
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError(f"{path} is not a state_dict (a dict of tensors)")
        return state
    ckpt = load(path)
    return with_aliases(ckpt.model, ckpt.meta.get(ALIASES, {}))


def save_model(source: str, path: str, then: str) -> None:
    """``source``'s model state (a checkpoint, see :func:`model_state`) as the ``torch.save`` file
    ``path``, crash-safe (:func:`~pipeq.checkpoint.atomic.replace_file`). A full disk raises a
    :class:`~pipeq.checkpoint.NoSpaceError` that says ``source`` is intact and ``then`` what to do."""
    state = model_state(source)
    try:
        replace_file(path, lambda f: torch.save(state, f))
    except (OSError, RuntimeError) as exc:
        if is_no_space(exc):
            raise no_space_error(path, "the model state", exc, f"{describe_checkpoint(source)} is intact",
                                 then) from exc
        raise


def _write_dcp(state: dict[str, torch.Tensor], out: str) -> None:
    import torch.distributed.checkpoint as dcp

    if os.path.exists(out) and os.listdir(out):
        raise FileExistsError(f"{out} exists and is not empty: name a new directory for the DCP export")
    dcp.save({k: v.contiguous() for k, v in state.items()}, checkpoint_id=out, no_dist=True)


def _write_safetensors(state: dict[str, torch.Tensor], out: str) -> None:
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise RuntimeError("--format safetensors needs the safetensors package: pip install safetensors") from exc
    seen: dict[int, str] = {}
    plain = {}
    for name, t in state.items():  # safetensors refuses two names of one storage: tied names get a copy
        t = t.contiguous()
        plain[name] = t.clone() if t.untyped_storage().data_ptr() in seen else t
        seen.setdefault(t.untyped_storage().data_ptr(), name)
    save_file(plain, out)


def export(source: str, fmt: str, out: str) -> str:
    """Write ``source``'s model state as ``fmt`` (``"dcp"``: a directory; ``"safetensors"``,
    ``"pt"``: a file) at ``out``; returns ``out``."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    state = {k: v.detach().cpu() for k, v in model_state(source).items()}
    if fmt == "dcp":
        _write_dcp(state, out)
    elif fmt == "safetensors":
        _write_safetensors(state, out)
    else:
        torch.save(state, out)
    return out
