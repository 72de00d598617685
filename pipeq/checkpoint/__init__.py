"""Checkpoints of a pipeline: write stage snapshots to disk, read them back, re-split them.

The driver gathers one :class:`StageSnapshot` per stage (plain data, already on the CPU; see
:func:`stage_snapshot`) and :func:`save` writes them; :func:`load` reads a checkpoint back and
:func:`split` cuts it into snapshots for the current run, whose number of stages may differ.
Nothing here opens a socket or a process.

Everything is named by *global* names, those of the flat model ``nn.Sequential(*layers)``
(:func:`flat_model`), so 3 stages load into 2; ``runner.state_dict()``,
``runner.load_state_dict()``, checkpoints and ``pipeq launch``'s model.pt all use them. The parts:

    data        what a checkpoint is made of: StageSnapshot, Checkpoint, CheckpointError
    names       the global names (flat_model, global_state, split_state), auxiliary heads' names
    snapshot    a stage's snapshot: model, optimizers and lr schedulers, RNG
    disk        stage files and a manifest with their sizes and sha256: save, load
    full        a save that runs out of disk space, said plainly (NoSpaceError)
    atomic      a save replaces a checkpoint crash-safely (recover puts right what a kill left)
    steps       a run's step-<n> checkpoints: checkpoint_dir, latest, prune
    resplit     split: a checkpoint over another cut of the flat model
    export      ``pipeq export``: a run's model state for other tools (DCP, safetensors, torch.save)
"""

from __future__ import annotations

from pipeq.checkpoint.atomic import recover
from pipeq.checkpoint.data import (FORMAT, MANIFEST, VERSION, Checkpoint, CheckpointError, DamagedCheckpointError,
                                   NoSpaceError, StageSnapshot)
from pipeq.checkpoint.disk import load, save
from pipeq.checkpoint.names import (AUX_PREFIX, StageLayout, aux_name, flat_model, global_names, global_state,
                                    is_sequential, layer_of, layers_of, layout_of, split_state, tie_aliases,
                                    to_global)
from pipeq.checkpoint.resplit import split
from pipeq.checkpoint.snapshot import (load_optimizer_snapshot, load_schedulers_snapshot, optimizer_snapshot,
                                       optimizers_snapshot, schedulers_snapshot, stage_snapshot)
from pipeq.checkpoint.steps import checkpoint_dir, latest, prune

__all__ = [
    "FORMAT", "VERSION", "MANIFEST", "CheckpointError", "DamagedCheckpointError", "NoSpaceError", "StageSnapshot",
    "Checkpoint",
    "StageLayout", "is_sequential", "layers_of", "layout_of", "flat_model", "layer_of", "to_global", "AUX_PREFIX",
    "aux_name", "global_names", "global_state", "split_state", "tie_aliases",
    "optimizer_snapshot", "load_optimizer_snapshot", "optimizers_snapshot", "schedulers_snapshot",
    "load_schedulers_snapshot", "stage_snapshot",
    "save", "load", "recover", "checkpoint_dir", "latest", "prune", "split",
]
