"""The runner's view of the stages' state: tensors, checkpoints, learning rates, statistics.

:class:`RunnerState` is the part of :class:`~pipeq.PipelineRunner` that reads and writes what
every stage holds through its backend (``get_state``, ``set_state``, ``get_snapshots``,
``restore``, ``layouts``, ``learning_rates``, ``scheduler_step``, ``stats``), naming tensors as
:mod:`pipeq.checkpoint` does.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Mapping

import torch

from pipeq.control.exclusive import exclusive

if TYPE_CHECKING:
    from pipeq import checkpoint

__all__ = ["RunnerState"]


class RunnerState:
    """State dicts, checkpoints, learning rates and statistics of a running pipeline (mixed into
    the runner)."""

    _backend: Any
    lr_schedule: Any
    _stage_layouts: "list[checkpoint.StageLayout] | None" = None

    def _require_running(self) -> None:
        raise NotImplementedError

    # -- state ---------------------------------------------------------------------------------
    def _layouts(self) -> "list[checkpoint.StageLayout]":
        """Every stage's names, layers, shapes and dtypes (asked once; they never change)."""
        from pipeq import checkpoint

        if self._stage_layouts is None:
            self._stage_layouts = [checkpoint.StageLayout(**lay) for lay in self._backend.layouts()]
        return self._stage_layouts

    @exclusive
    def state_dict(self) -> "collections.OrderedDict[str, torch.Tensor]":
        """The model's parameters and buffers (CPU copies) under the flat model's names: those of
        ``nn.Sequential(*layers)``, where a stage that is an ``nn.Sequential`` contributes each of
        its children as one layer and any other stage itself (stage 1's ``0.weight`` after a
        two-layer stage 0 is ``2.weight``); ``pipeq.checkpoint.flat_model(stages)`` is that model.
        Checkpoints (:meth:`save`) and ``pipeq launch``'s model.pt use the same names."""
        from pipeq import checkpoint

        self._require_running()
        return checkpoint.global_state(self._backend.get_state(), self._layouts())

    @exclusive
    def model_state_dict(self) -> "dict[str, torch.Tensor]":
        """:meth:`state_dict` with each tied parameter also under its other names (one tensor),
        as the unsplit model's own ``state_dict()`` has it: ``model.load_state_dict(
        runner.model_state_dict())`` loads a run of :func:`pipeq.split`'s stages into the model."""
        from pipeq import checkpoint
        from pipeq.checkpoint.export import with_aliases

        return with_aliases(self.state_dict(), checkpoint.tie_aliases(self._layouts()))

    @exclusive
    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load a state under the names of :meth:`state_dict` (also one split into another number
        of stages). Every key and shape is checked before any stage changes: a ``ValueError``
        names what does not fit, and the runner goes on. For compatibility, stage-prefixed keys
        (``nn.Sequential(*stages).state_dict()``, ``state_dict()`` of earlier pipeq versions) are
        accepted too. Tensors are copied into the stages' own dtypes, as ``nn.Module`` does."""
        from pipeq import checkpoint

        self._require_running()
        self._backend.set_state(checkpoint.split_state(state, self._layouts()))

    # -- checkpoints ---------------------------------------------------------------------------
    @exclusive
    def save(self, directory: str, meta: Mapping[str, Any] | None = None) -> None:
        """Write a checkpoint as ``directory``: every stage's parameters, buffers, optimizer and
        lr-scheduler state and RNG, under the flat model's names (those of :meth:`state_dict`;
        see :mod:`pipeq.checkpoint`). ``meta`` (plain JSON data) is stored in the manifest.

        The new checkpoint is written beside ``directory`` and swapped in once complete, so a
        checkpoint already there stays loadable until then, even if this process is killed; a
        directory holding anything but a checkpoint is refused (it is replaced as a whole)."""
        from pipeq import checkpoint

        from pipeq.checkpoint.export import ALIASES

        self._require_running()
        meta = dict(meta or {})
        aliases = checkpoint.tie_aliases(self._layouts())
        if aliases:  # the names the unsplit model has beside them (pipeq export writes both)
            meta[ALIASES] = aliases
        checkpoint.save(directory, self._backend.get_snapshots(), meta)

    @exclusive
    def load(self, directory: str) -> dict[str, Any]:
        """Load a checkpoint written by :meth:`save`, also one saved with another number of
        stages (the same layers split differently); returns its ``meta``.

        Every name, shape and dtype is checked against the stages before anything is sent: a
        checkpoint that does not fit raises a ``ValueError`` (``pipeq.checkpoint.CheckpointError``)
        naming each tensor at fault, no stage changes, and the runner goes on."""
        from pipeq import checkpoint

        self._require_running()
        ckpt = checkpoint.load(directory)
        self._backend.restore(checkpoint.split(ckpt, self._layouts()))
        return dict(ckpt.meta)

    @exclusive
    def stats(self, reset_peak: bool = False) -> list[dict[str, Any]]:
        """One dict per stage: ``peak_bytes``, the stage's peak memory since the start or the
        last ``reset_peak=True`` (CUDA: allocated bytes; CPU: the stage process's peak resident
        set; ``memory`` says which), ``skipped_steps`` (steps skipped for non-finite gradients:
        ``precision="fp16"``, ``check_finite="skip"``), ``recompute`` and ``shm_waits`` (how often
        one of the stage's sends found every shared-memory slot of its channel in use: raise
        ``shm_slots`` if it grows). In simulated mode the peak is this process's; with
        ``tensor_parallel``, shard 0's (each shard holds its own part of the stage)."""
        self._require_running()
        return self._backend.stats(reset_peak)

    # -- learning-rate schedule ------------------------------------------------------------------
    @exclusive
    def scheduler_step(self, metric: float | None = None) -> None:
        """Step every stage's lr scheduler once (every replica's), with ``lr_scheduler_interval=
        "epoch"``: e.g. at the end of each epoch. ``metric`` is what a ``ReduceLROnPlateau``
        monitors (e.g. the evaluation's loss) and is required for it; other schedulers take none.
        Anything else is refused with a ``ValueError`` before any stage is told."""
        from pipeq.stage import lr_schedulers

        value = lr_schedulers.check_metric(self.lr_schedule, metric)
        self._require_running()
        self._backend.scheduler_step(value)

    @exclusive
    def learning_rates(self) -> list[list[float]]:
        """Every stage's current learning rates, one per parameter group of its optimizer (AL
        layers: f and b's groups, then g and h's); ``[]`` for a stage without parameters."""
        self._require_running()
        return self._backend.learning_rates()
