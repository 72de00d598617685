"""What one stage takes of a TRAIN / PREDICT command: x, the target and its stage inputs, rebuilt from the command's tensors."""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from pipeq.stage import microbatch
from pipeq.wire.control import Predict, Train

__all__ = ["BatchParts", "batch_parts"]


class BatchParts(NamedTuple):
    """A stage's part of a batch: x (stage 0), the target (a stage that computes a loss) and its
    stage inputs (a dict of keyword arguments of its forward), each None when it has none."""

    x: Any
    target: Any
    inputs: dict[str, Any] | None


def batch_parts(cmd: Train | Predict, tensors: Sequence[torch.Tensor], stage: int, wants_x: bool,
                wants_target: bool) -> BatchParts:
    """The parts ``cmd`` carries (its payload checked the counts against ``tensors``): x's tensors
    first (``nx`` of them), then the inputs' (``ninputs``), then the target's; for anything but a
    lone tensor, their trees (:mod:`pipeq.stage.microbatch`), which are checked here: a malformed
    one raises a :class:`~pipeq.tree.TreeError`. A ``split`` command's parts are lists of
    microbatches (:class:`~pipeq.stage.microbatch.Microbatches`)."""
    nx = cmd.nx if cmd.nx is not None else (1 if wants_x else 0)
    if nx > len(tensors):
        raise ValueError(f"stage {stage}: the command carries {len(tensors)} tensors, not x's {nx}")
    x = microbatch.unpack_input(cmd.x, tensors[:nx], cmd.split) if wants_x else None
    end = nx
    inputs = None
    if cmd.inputs is not None:
        end = nx + (cmd.ninputs or 0)
        inputs = microbatch.unpack_kwargs(cmd.inputs, tensors[nx:end], cmd.split)
    target = None
    if wants_target and isinstance(cmd, Train):  # (PREDICT carries no target)
        target = microbatch.unpack_input(cmd.target, tensors[end:], cmd.split)
    return BatchParts(x, target, inputs)
