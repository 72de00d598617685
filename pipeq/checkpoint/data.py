"""What a checkpoint is made of: a stage's snapshot, a loaded checkpoint, its files' names, its error."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NotRequired, TypedDict

import torch

__all__ = ["FORMAT", "VERSION", "MANIFEST", "CheckpointError", "DamagedCheckpointError", "NoSpaceError",
           "StageSnapshot", "Checkpoint"]

FORMAT = "pipeq-checkpoint"
"""The ``format`` a checkpoint's manifest names."""
VERSION = 1
"""The checkpoint format's version, in the manifest."""
MANIFEST = "manifest.json"
"""The file of a checkpoint directory that describes it (written last: a checkpoint without one is incomplete)."""


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupted, or does not fit the current stages."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint's files are damaged: a manifest that is not readable or not consistent, a
    stage file missing, or one whose size or sha256 differs from its manifest, or that does not
    load. (One that is whole but does not fit, or of another format version, is a plain
    :class:`CheckpointError`.)"""


class NoSpaceError(CheckpointError):
    """A save ran out of disk space (or quota); the previous checkpoint is intact. ``path``: the
    checkpoint being saved (see :mod:`pipeq.checkpoint.full`)."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


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
    # how its names read beyond layers (pipeq.checkpoint.names.naming_of): model names, tied weights
    names_global: NotRequired[bool]
    ties: NotRequired[dict[str, str]]  # every local name of a tied parameter -> its tie's key
    tie_stages: NotRequired[dict[str, list[int]]]  # tie key -> the stages holding a copy


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
    scaler: dict | None = None  # fp16's loss-scaler state (pipeq.stage.numerics.LossScaler)
    aux_model: dict[str, torch.Tensor] = field(default_factory=dict)  # "aux_heads.{k}.{local}" -> tensor
    aux_optim: dict[str, dict] = field(default_factory=dict)  # the heads' optimizer state, by those names
