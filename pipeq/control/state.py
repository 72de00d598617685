"""The stages' state under the flat model's names: state dicts, checkpoints and snapshots in and out.

:class:`StateAccess` is the runner's collaborator for everything that reads or writes what the
stages hold: it asks the backend (:class:`~pipeq.runtime.backend.Backend`) for each stage's
tensors or snapshot and names them as :mod:`pipeq.checkpoint` does (the flat model
``nn.Sequential(*layers)``), or splits a state, checkpoint or snapshot by the stages' layouts
before any stage is sent a tensor. The runner checks that the pipeline runs and settles the steps
in flight before it calls any of these.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Mapping

import torch

if TYPE_CHECKING:
    from pipeq import checkpoint
    from pipeq.control.snapshots import MemorySnapshot
    from pipeq.runtime.backend import Backend

__all__ = ["StateAccess"]


class StateAccess:
    """Reads and writes every stage's state through ``backend``, under the flat model's names."""

    def __init__(self, backend: Backend, n_stages: int) -> None:
        self.backend = backend
        self.n_stages = n_stages
        self._layouts: list[checkpoint.StageLayout] | None = None

    def layouts(self) -> list[checkpoint.StageLayout]:
        """Every stage's names, layers, shapes and dtypes (asked once; they never change)."""
        from pipeq import checkpoint

        if self._layouts is None:
            self._layouts = [checkpoint.StageLayout(**lay) for lay in self.backend.layouts()]
        return self._layouts

    def state_dict(self) -> collections.OrderedDict[str, torch.Tensor]:
        """The parameters and buffers (CPU copies), under the flat model's names."""
        from pipeq import checkpoint

        return checkpoint.global_state(self.backend.get_state(), self.layouts())

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """:meth:`state_dict` with each tied parameter also under its other names (one tensor)."""
        from pipeq import checkpoint
        from pipeq.checkpoint.export import with_aliases

        return with_aliases(self.state_dict(), checkpoint.tie_aliases(self.layouts()))

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Split ``state`` by the stages' layouts (every key and shape checked first) and load it."""
        from pipeq import checkpoint

        self.backend.set_state(checkpoint.split_state(state, self.layouts()))

    def save(self, directory: str, meta: Mapping[str, Any] | None) -> None:
        """Write every stage's snapshot as the checkpoint ``directory``, the tied names in its meta."""
        from pipeq import checkpoint
        from pipeq.checkpoint.export import ALIASES

        meta = dict(meta or {})
        aliases = checkpoint.tie_aliases(self.layouts())
        if aliases:  # the names the unsplit model has beside them (pipeq export writes both)
            meta[ALIASES] = aliases
        checkpoint.save(directory, self.backend.get_snapshots(), meta)

    def load(self, directory: str) -> dict[str, Any]:
        """Load the checkpoint ``directory`` (split by the stages' layouts, checked first); its meta."""
        from pipeq import checkpoint

        ckpt = checkpoint.load(directory)
        self.backend.restore(checkpoint.split(ckpt, self.layouts()))
        return dict(ckpt.meta)

    def restore(self, snap: MemorySnapshot) -> None:
        """Load an in-memory snapshot of the same stages into every stage and replica."""
        if len(snap.stages) != self.n_stages:
            raise ValueError(f"the snapshot holds {len(snap.stages)} stages, this runner {self.n_stages}; "
                             "restore it into a runner of the same stages (or save and load a checkpoint)")
        self.backend.restore(snap.stages)
