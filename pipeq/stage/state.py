"""A stage's state: its tensors for the driver, its checkpoint layout, snapshots and their restore.

:class:`StageState` is a part of :class:`~pipeq.StageExecutor`: the executor
holds the module, its optimizers, schedulers and loss scaler, and these methods read and load
them. Executors that hold more (an auxiliary head, a sharded module) override them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
from torch import nn

from pipeq.stage.numerics import LossScaler

__all__ = ["StageState"]


class StageState:
    """State dicts, checkpoint layouts, snapshots and restores of a stage (see the module)."""

    # what the executor provides
    index: int
    device: torch.device
    module: nn.Module
    scaler: LossScaler | None
    optimizers: Callable[[], list[torch.optim.Optimizer]]
    schedulers: Callable[[], list[Any]]

    # -- state (the driver's state_dict / load_state_dict) --------------------------------------
    def state_tensors(self) -> tuple[list[str], list[torch.Tensor]]:
        """The module's state dict as (names, CPU tensors)."""
        sd = self.module.state_dict()
        names = list(sd)
        return names, [sd[n].detach().to("cpu") for n in names]

    def load_state(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
        """Load (names, tensors) as :meth:`state_tensors` gave them (every entry of the module)."""
        self.module.load_state_dict(dict(zip(names, tensors)), strict=True)

    # -- checkpoints ---------------------------------------------------------------------------
    def layout(self) -> dict[str, Any]:
        """What a checkpoint needs to know of this stage to hand it its part (local names)."""
        from pipeq.checkpoint import layout_of

        return dataclasses.asdict(layout_of(self.module))

    def snapshot(self) -> dict[str, Any]:
        """Parameters and buffers, every optimizer's and scheduler's state and the RNG, as CPU copies."""
        from pipeq.checkpoint import optimizers_snapshot, schedulers_snapshot, stage_snapshot

        snap = dict(stage_snapshot(self.module))
        snap["optim"] = optimizers_snapshot(self.module, self.optimizers())
        snap["sched"] = schedulers_snapshot(self.schedulers())
        snap["scaler"] = self.scaler.state_dict() if self.scaler is not None else None
        return snap

    def restore(self, snap: dict[str, Any]) -> None:
        """Load a :meth:`snapshot` (possibly re-split from another stage count)."""
        from pipeq.checkpoint import load_optimizer_snapshot, load_schedulers_snapshot

        self.module.load_state_dict(snap["model"], strict=True)
        # the schedulers first: the optimizers' saved hyperparameters (the scheduled lr) win
        load_schedulers_snapshot(self.schedulers(), snap.get("sched"), self.index)
        if snap.get("optim"):
            for optimizer in self.optimizers():
                load_optimizer_snapshot(self.module, optimizer, snap["optim"], self.device)
        if snap.get("rng") is not None:
            torch.set_rng_state(snap["rng"])
        if self.scaler is not None and isinstance(snap.get("scaler"), dict):
            self.scaler.load_state_dict(snap["scaler"])
