"""A stage's state: its tensors for the driver, its checkpoint layout, snapshots and their restore.

:class:`StateIO` is held by :class:`~pipeq.stage.executor.StageExecutor`: it reads and loads the
stage's module and what its :class:`~pipeq.stage.step.Stepper` holds (optimizers, schedulers,
loss scaler). Executors that hold more (an auxiliary head, a sharded module) hold a subclass
that says how.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from torch import nn

from pipeq.stage.step import Stepper

__all__ = ["StateIO"]


class StateIO:
    """State dicts, checkpoint layouts, snapshots and restores of stage ``index`` (see the module)."""

    def __init__(self, index: int, module: nn.Module, device: torch.device, stepper: Stepper) -> None:
        self.index = index
        self.module = module
        self.device = device
        self.stepper = stepper

    # -- state (the driver's state_dict / load_state_dict) --------------------------------------
    def tensors(self) -> tuple[list[str], list[torch.Tensor]]:
        """The module's state dict as (names, CPU tensors)."""
        sd = self.module.state_dict()
        names = list(sd)
        return names, [sd[n].detach().to("cpu") for n in names]

    def load(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
        """Load (names, tensors) as :meth:`tensors` gave them (every entry of the module)."""
        self.module.load_state_dict(dict(zip(names, tensors)), strict=True)

    # -- checkpoints ---------------------------------------------------------------------------
    def layout(self) -> dict[str, Any]:
        """What a checkpoint needs to know of this stage to hand it its part (local names)."""
        from pipeq.checkpoint import layout_of

        return dataclasses.asdict(layout_of(self.module))

    def snapshot(self) -> dict[str, Any]:
        """Parameters and buffers, every optimizer's and scheduler's state and the RNG, as CPU copies."""
        from pipeq.checkpoint import optimizers_snapshot, schedulers_snapshot, stage_snapshot

        scaler = self.stepper.scaler
        snap = dict(stage_snapshot(self.module))
        snap["optim"] = optimizers_snapshot(self.module, self.stepper.optimizers())
        snap["sched"] = schedulers_snapshot(self.stepper.schedulers())
        snap["scaler"] = scaler.state_dict() if scaler is not None else None
        return snap

    def restore(self, snap: dict[str, Any]) -> None:
        """Load a :meth:`snapshot` (possibly re-split from another stage count)."""
        from pipeq.checkpoint import load_optimizer_snapshot, load_schedulers_snapshot

        self.module.load_state_dict(snap["model"], strict=True)
        # the schedulers first: the optimizers' saved hyperparameters (the scheduled lr) win
        load_schedulers_snapshot(self.stepper.schedulers(), snap.get("sched"), self.index)
        if snap.get("optim"):
            for optimizer in self.stepper.optimizers():
                load_optimizer_snapshot(self.module, optimizer, snap["optim"], self.device)
        if snap.get("rng") is not None:
            torch.set_rng_state(snap["rng"])
        scaler = self.stepper.scaler
        if scaler is not None and isinstance(snap.get("scaler"), dict):
            scaler.load_state_dict(snap["scaler"])
