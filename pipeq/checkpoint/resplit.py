"""A loaded checkpoint cut into one snapshot per current stage, whose number may differ from the saved one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from pipeq.checkpoint.data import Checkpoint, CheckpointError, StageSnapshot
from pipeq.checkpoint.names import StageLayout, aux_name, dtype_name

__all__ = ["split"]

_OPTIM = "optimizer state of "


def split(ckpt: Checkpoint, layouts: list[StageLayout]) -> list[StageSnapshot]:
    """Cut a checkpoint into one snapshot per current stage (local names), checked first: a
    name missing or left over, or a tensor whose shape or dtype is not the stage's (when the
    layouts give them), raises a :class:`CheckpointError` naming each, before any stage changes.

    With as many stages as were saved, stage k gets saved stage k's scheduler state and RNG state.
    Otherwise every stage gets saved stage 0's scheduler state and ``rng=None``: RNG streams
    cannot be re-split, so the caller keeps (or reseeds) the current ones. A checkpoint without
    optimizer state gives ``optim={}`` everywhere; the caller then skips loading it.

    Tied weights (:mod:`pipeq.checkpoint.names`): every copy gets the tie's one tensor; a copy's
    optimizer state is its own (saved under the copy's name), else its key's. A tensor the stages
    name twice takes its first name's entries when the checkpoint holds only those; entries
    that only such a second name, or a tied copy, would read are no leftovers.
    """
    same = ckpt.n_stages == len(layouts)
    if (any(lay.aux for lay in layouts) or ckpt.aux_model) and not same:
        raise CheckpointError(
            f"the checkpoint was saved from {ckpt.n_stages} stages and "
            f"{'holds' if ckpt.aux_model else 'these stages have'} auxiliary heads: a head belongs to its stage's "
            f"boundary, so it loads only into {ckpt.n_stages} stages cut as when saved (runner.load_state_dict "
            "loads the main path alone into any cut)")
    cut = _Cut(ckpt, optional=_optional(layouts))
    out: list[StageSnapshot] = []
    offset = 0
    for k, lay in enumerate(layouts):
        out.append(cut.stage(k, lay, offset, same))
        offset += lay.layers
    cut.check(len(layouts), offset)
    return out


@dataclass
class _Cut:
    """One split of ``ckpt``: the entries handed out so far, and everything found not to fit."""

    ckpt: Checkpoint
    optional: set[str] = field(default_factory=set)  # global names no leftover when untaken (see split)
    missing: list[str] = field(default_factory=list)
    misfit: list[str] = field(default_factory=list)
    taken: dict[str, set[str]] = field(default_factory=lambda: {"model": set(), "optim": set(), "aux_model": set(),
                                                                  "aux_optim": set()})

    @property
    def have_optim(self) -> bool:
        return bool(self.ckpt.optim)

    def take(self, part: str, wanted: dict[str, Sequence[str]], k: int) -> dict[str, Any]:
        """Stage ``k``'s entries of the checkpoint's ``part``: ``wanted[local]`` lists the global
        names to take each local name's from, the first one there (the first is its own)."""
        table, taken = getattr(self.ckpt, part), self.taken[part]
        what = _OPTIM if part.endswith("optim") else ""
        mine = {}
        for name, globals_ in wanted.items():
            g = next((g for g in globals_ if g in table), None)
            if g is not None:
                mine[name] = table[g]
                taken.add(g)
            else:
                self.missing.append(f"{what}{globals_[0]} (stage {k})")
        return mine

    def fits(self, k: int, g: str, t: Any, shape: Any, dtype: Any) -> None:
        """Note it if the checkpoint's ``t`` (global name ``g``) is no tensor of stage k's shape and dtype."""
        if not isinstance(t, torch.Tensor):
            self.misfit.append(f"{g} is a {type(t).__name__} in the checkpoint, not a tensor")
        elif shape is not None and list(t.shape) != list(shape):
            self.misfit.append(f"{g} has shape {tuple(t.shape)} in the checkpoint, stage {k} expects {tuple(shape)}")
        elif dtype is not None and dtype_name(t.dtype) != dtype:
            self.misfit.append(f"{g} is {dtype_name(t.dtype)} in the checkpoint, stage {k} holds {dtype}")

    def stage(self, k: int, lay: StageLayout, offset: int, same: bool) -> StageSnapshot:
        """Stage ``k``'s snapshot (it starts at layer ``offset``)."""
        ckpt = self.ckpt
        names = lay.names(k, offset)
        model = self.take("model", {n: [names.model(n)] + ([names.model(lay.aliases[n])] if n in lay.aliases else [])
                                    for n in lay.model_names}, k)
        for name, t in model.items():
            self.fits(k, names.model(name), t, lay.shapes.get(name), lay.dtypes.get(name))
        optim = self.take("optim", {n: [names.own(n), names.model(n)] for n in lay.param_names},
                          k) if self.have_optim else {}
        return StageSnapshot(
            model=model,
            optim=optim,
            sched=ckpt.sched[k] if same else ckpt.sched[0] if ckpt.sched else None,
            rng=ckpt.rng[k] if same else None,
            layers=lay.layers,
            sequential=lay.sequential,
            scaler=ckpt.scaler,
            aux=self.aux(k, lay.aux) if lay.aux else None,
        )

    def aux(self, k: int, lay: dict[str, Any]) -> dict[str, Any]:
        """Stage ``k``'s auxiliary head's part of its snapshot (``lay``: the head's layout)."""

        aux = {"model": self.take("aux_model", {n: [aux_name(k, n)] for n in lay["model_names"]}, k),
               "optim": self.take("aux_optim", {n: [aux_name(k, n)] for n in lay["param_names"]}, k)
               if self.have_optim else {}}
        for name, t in aux["model"].items():
            self.fits(k, aux_name(k, name), t, lay["shapes"].get(name), lay["dtypes"].get(name))
        return aux

    def unexpected(self) -> list[str]:
        """The checkpoint's entries no stage took."""
        ckpt, taken, optional = self.ckpt, self.taken, self.optional
        out = [g for g in ckpt.model if g not in taken["model"] and g not in optional]
        out += [f"{_OPTIM}{g}" for g in ckpt.optim if g not in taken["optim"] and g not in optional]
        out += [g for g in ckpt.aux_model if g not in taken["aux_model"]]
        out += [f"{_OPTIM}{g}" for g in ckpt.aux_optim if self.have_optim and g not in taken["aux_optim"]]
        return out

    def check(self, n_stages: int, layers: int) -> None:
        """Raise a :class:`CheckpointError` naming everything that does not fit these ``n_stages``
        stages of ``layers`` layers in all."""
        unexpected = self.unexpected()
        if not (self.missing or unexpected or self.misfit):
            return
        parts = []
        saved_layers = sum(self.ckpt.layers)
        if saved_layers != layers:
            parts.append(f"the checkpoint has {saved_layers} layers, these stages {layers}")
        for label, names in (("missing ", self.missing), ("unexpected ", unexpected), ("", self.misfit)):
            if names:
                more = f" and {len(names) - 10} more" if len(names) > 10 else ""
                parts.append(f"{label}{', '.join(names[:10])}{more}")
        raise CheckpointError(f"checkpoint does not fit these {n_stages} stages: " + "; ".join(parts))


def _optional(layouts: list[StageLayout]) -> set[str]:
    """The global names of the tensors these stages name twice (second names) and of their tied
    copies: a checkpoint entry under one of them is no leftover when nobody takes it (the tensor
    loads from its first name's, or its tie's, entry)."""
    out: set[str] = set()
    offset = 0
    for k, lay in enumerate(layouts):
        names = lay.names(k, offset)
        out |= {names.own(n) for n in (*lay.aliases, *lay.ties)}
        offset += lay.layers
    return out
