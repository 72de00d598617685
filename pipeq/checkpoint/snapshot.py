"""A stage's snapshot: its parameters, optimizer and lr-scheduler state and RNG, as CPU copies.

An optimizer's state is saved per parameter name (its state and its group's hyperparameters), so
it re-splits with the model. A stage with several optimizers (Associated Learning's f+b and g+h)
saves each parameter's state under its own name, and its schedulers' states as
``{"pipeq_schedulers": [...]}``. Scheduler state that is no tree (MultiStepLR's milestones) is
kept as :func:`pipeq.tree.to_plain` spells it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from pipeq.checkpoint.data import CheckpointError, StageSnapshot
from pipeq.checkpoint.names import is_sequential, layers_of, naming_of
from pipeq.tree import from_plain, to_plain

__all__ = ["optimizer_snapshot", "load_optimizer_snapshot", "optimizers_snapshot", "schedulers_snapshot",
           "load_schedulers_snapshot", "stage_snapshot"]


def _param_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The module's name of every optimizer parameter, in the optimizer's flattened order."""
    by_id = {id(p): name for name, p in module.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    unknown = [f"{tuple(p.shape)} (position {i})" for i, p in enumerate(params) if id(p) not in by_id]
    if unknown:
        raise ValueError(
            f"the optimizer holds parameters that are not in the stage module: {', '.join(unknown)}; "
            "build the stage's optimizer over module.parameters()"
        )
    return [by_id[id(p)] for p in params]


def optimizer_snapshot(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
    """The ``optim`` field of a snapshot: per parameter name, its state and its group's hyperparameters."""
    names = _param_names(module, optimizer)
    sd = optimizer.state_dict()
    out: dict[str, dict] = {name: {"state": {}, "group": {}} for name, _ in module.named_parameters()}
    for group in sd["param_groups"]:
        hyper = {k: to_plain(v) for k, v in group.items() if k not in ("params", "param_names")}
        for pid in group["params"]:
            out[names[pid]] = {"state": to_plain(sd["state"].get(pid, {})), "group": dict(hyper)}
    return out


def load_optimizer_snapshot(
    module: nn.Module, optimizer: torch.optim.Optimizer, optim: dict[str, dict], device: torch.device | str
) -> None:
    """Load an ``optim`` field (local names) into ``optimizer``, a fresh optimizer over ``module``."""
    names = _param_names(module, optimizer)
    missing = [n for n in names if n not in optim]
    if missing:
        raise ValueError(f"the optimizer snapshot has no entry for parameters: {', '.join(missing)}")
    state: dict[int, dict] = {}
    groups: list[dict] = []
    pos = 0
    for group in optimizer.param_groups:
        ids = list(range(pos, pos + len(group["params"])))
        pos += len(ids)
        hyper = {k: v for k, v in group.items() if k != "params"}  # kept for an empty group
        if ids:
            saved = [optim[names[i]]["group"] for i in ids]
            differ = [names[i] for i, g in zip(ids, saved) if g != saved[0]]
            if differ:
                raise ValueError(
                    f"parameters {names[ids[0]]} and {', '.join(differ)} are in one optimizer group "
                    "but their snapshots have different hyperparameters; group them as when saved"
                )
            for k, v in saved[0].items():  # back to the optimizer's own types (betas is a tuple)
                hyper[k] = tuple(v) if isinstance(group.get(k), tuple) and isinstance(v, list) else v
        groups.append({**hyper, "params": ids})
        for i in ids:
            entry = optim[names[i]]["state"]
            if entry:  # copies, so the live state never aliases the snapshot
                state[i] = {
                    k: v.detach().to(device, copy=True) if isinstance(v, torch.Tensor) else v
                    for k, v in entry.items()
                }
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def optimizers_snapshot(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, dict]:
    """The ``optim`` field of a stage whose ``optimizers`` hold disjoint parameters of ``module``
    (AL's f+b and g+h): each parameter's entry from the optimizer that holds it."""
    out: dict[str, dict] = {name: {"state": {}, "group": {}} for name, _ in module.named_parameters()}
    for optimizer in optimizers:
        snap = optimizer_snapshot(module, optimizer)
        out.update((name, snap[name]) for name in _param_names(module, optimizer))
    return out


_SCHEDULERS = "pipeq_schedulers"


def schedulers_snapshot(schedulers: Sequence[Any]) -> dict | None:
    """The ``sched`` field: one scheduler's state, or ``{"pipeq_schedulers": [...]}`` of several."""
    if not schedulers:
        return None
    states = [to_plain(s.state_dict()) for s in schedulers]
    return states[0] if len(states) == 1 else {_SCHEDULERS: states}


def load_schedulers_snapshot(schedulers: Sequence[Any], sched: dict | None, stage: int) -> None:
    """Load a ``sched`` field into these schedulers (nothing when either side has none)."""
    if not schedulers or sched is None:
        return
    states = sched[_SCHEDULERS] if isinstance(sched, dict) and _SCHEDULERS in sched else [sched]
    if len(states) != len(schedulers):
        raise CheckpointError(f"stage {stage} has {len(schedulers)} lr scheduler(s) but the checkpoint holds the "
                              f"state of {len(states)}: load it into a run of the same schedule and lr_scheduler")
    for scheduler, state in zip(schedulers, states):
        scheduler.load_state_dict(from_plain(state))


def stage_snapshot(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    rng: bool = True,
) -> StageSnapshot:
    """Everything of one stage that a checkpoint keeps, as CPU copies under local names (and how
    those names read: :func:`~pipeq.checkpoint.names.naming_of`)."""
    naming = naming_of(module)
    return StageSnapshot(
        model={k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()},
        optim=optimizer_snapshot(module, optimizer) if optimizer is not None else {},
        sched=to_plain(scheduler.state_dict()) if scheduler is not None else None,
        rng=torch.get_rng_state() if rng else None,
        layers=layers_of(module),
        sequential=is_sequential(module),
        names_global=naming["names_global"],
        ties=naming["ties"],
        tie_stages=naming["tie_stages"],
    )
