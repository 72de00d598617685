"""What a plan holds, in bytes: each process's peak, from what each of its stages was measured to hold.

A stage holds its ``static`` bytes all step (parameters, gradients, optimizer state) and, for
each microbatch in flight, ``per_microbatch`` bytes of activations: from the microbatch's forward
to its backward (``B``), or to its weight gradient (``W``) when the backward is split (the
activations a ``W`` needs stay until it runs). A process's peak is its stages' static bytes plus
the highest sum, over its plan, of its stages' activations in flight (two stages of a V hold
theirs at once). :func:`process_bytes` walks a lowered plan; ``schedule="auto"`` with
``auto_memory_limit`` keeps the schedules whose every process fits (:mod:`pipeq.schedules.choose`).
Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pipeq.schedules.actions import Op, Schedule

__all__ = ["Footprint", "process_bytes", "format_bytes"]


@dataclass(frozen=True)
class Footprint:
    """What each model stage holds, measured: ``static[s]`` bytes all step, ``per_microbatch[s]``
    bytes for each microbatch in flight."""

    static: tuple[float, ...]
    per_microbatch: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.static) != len(self.per_microbatch):
            raise ValueError(f"a footprint of {len(self.static)} static and {len(self.per_microbatch)} "
                             "per-microbatch figures: give one of each per stage")


def process_bytes(lowered: Schedule, where: Sequence[Sequence[int]], footprint: Footprint) -> list[float]:
    """Each process's predicted peak bytes under ``lowered`` (one action list per process;
    ``where[p]``: process p's model stages, indexed by an action's ``chunk``)."""
    n = len(footprint.static)
    if sum(len(w) for w in where) != n:
        raise ValueError(f"a footprint of {n} stages for a plan of {sum(len(w) for w in where)}")
    out = []
    for acts, stages in zip(lowered, where):
        level = peak = 0.0
        for a in acts:
            if a.op is Op.FORWARD:
                level += footprint.per_microbatch[stages[a.chunk]]
                peak = max(peak, level)
            elif a.op in (Op.BACKWARD, Op.WEIGHT_GRAD):
                level -= footprint.per_microbatch[stages[a.chunk]]
        out.append(sum(footprint.static[s] for s in stages) + peak)
    return out


def format_bytes(n: float) -> str:
    """``n`` bytes for people: ``"1.5 GiB"``, ``"320 MiB"``, ``"12 KiB"``, ``"100 B"``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"
