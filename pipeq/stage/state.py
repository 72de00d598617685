"""A stage's state: its tensors for the driver, its checkpoint layout, snapshots and their restore.

:class:`StateIO` is held by :class:`~pipeq.stage.executor.StageExecutor`: it reads and loads the
stage's module and what its :class:`~pipeq.stage.step.Stepper` holds (optimizers, schedulers,
loss scaler). States leave the stage *whole*: a tensor the stage's processes hold in pieces (a
DTensor: tensor parallelism, FSDP) is gathered (``full_tensor()``: a collective, which every
process of the stage makes alike, the driver asking each) and loaded cut to each process's piece,
so ``state_dict``, snapshots and checkpoints hold the usual names and load at any
``tensor_parallel`` or ``data_parallel``, sharded or not. Executors that hold more (an auxiliary
head) hold a subclass that says how.
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

    def __init__(self, index: int, module: nn.Module, device: torch.device, stepper: Stepper,
                 parallel: Any = None) -> None:
        """``parallel``: the stage's parallel layers, whose gathered parameters are freed before a
        state is read or loaded (:meth:`~pipeq.parallel.layers.StageParallel.release`)."""
        self.index = index
        self.module = module
        self.device = device
        self.stepper = stepper
        self.parallel = parallel
        self.pieces = parallel is not None and parallel.slice_size > 1  # DTensors to gather and cut

    def _release(self) -> None:
        if self.parallel is not None:
            self.parallel.release()

    def _whole(self, value: Any) -> Any:
        if not self.pieces:
            return value
        from pipeq.parallel.tensor import whole

        return whole(value)

    def _cut(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (whole tensors by the module's names) cut as the module holds them."""
        if not self.pieces:
            return state
        from pipeq.parallel.tensor import like

        current = self.module.state_dict()
        return {n: like(t, current[n]) if n in current else t for n, t in state.items()}

    # -- state (the driver's state_dict / load_state_dict) --------------------------------------
    def tensors(self) -> tuple[list[str], list[torch.Tensor]]:
        """The module's state dict as (names, whole CPU tensors)."""
        self._release()
        sd = self.module.state_dict()
        names = list(sd)
        return names, [self._whole(sd[n].detach()).to("cpu") for n in names]

    def load(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
        """Load (names, tensors) as :meth:`tensors` gave them (every entry of the module)."""
        self._release()
        self.module.load_state_dict(self._cut(dict(zip(names, tensors))), strict=True)

    # -- checkpoints ---------------------------------------------------------------------------
    def layout(self) -> dict[str, Any]:
        """What a checkpoint needs to know of this stage to hand it its part (local names)."""
        from pipeq.checkpoint import layout_of

        return dataclasses.asdict(layout_of(self.module))

    def snapshot(self) -> dict[str, Any]:
        """Parameters and buffers, every optimizer's and scheduler's state and the RNG, as whole CPU copies."""
        from pipeq.checkpoint import optimizers_snapshot, schedulers_snapshot, stage_snapshot

        self._release()
        scaler = self.stepper.scaler
        snap = dict(stage_snapshot(self.module))
        snap["optim"] = optimizers_snapshot(self.module, self.stepper.optimizers())
        snap["sched"] = schedulers_snapshot(self.stepper.schedulers())
        snap["scaler"] = scaler.state_dict() if scaler is not None else None
        return self._whole(snap)

    def _cut_optim(self, optim: dict[str, Any]) -> dict[str, Any]:
        """A snapshot's optimizer states, each parameter's tensors of its shape cut as it is held."""
        if not self.pieces:
            return optim
        from pipeq.parallel.tensor import like

        by_name = dict(self.module.named_parameters())
        out = {}
        for name, entry in optim.items():
            p = by_name.get(name)
            state = {k: like(v, p) if p is not None and isinstance(v, torch.Tensor) and v.shape == p.shape else v
                     for k, v in (entry.get("state") or {}).items()}
            out[name] = {**entry, "state": state}
        return out

    def restore(self, snap: dict[str, Any]) -> None:
        """Load a :meth:`snapshot` (possibly re-split from another stage count, or taken at another
        tensor or data parallelism)."""
        from pipeq.checkpoint import load_optimizer_snapshot, load_schedulers_snapshot

        self._release()
        if self.pieces:
            snap = {**snap, "model": self._cut(snap["model"]), "optim": self._cut_optim(snap.get("optim") or {})}
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
