"""TDP schedule CSV files: :func:`from_csv` reads one as a schedule the runner takes, :func:`to_csv`
writes a pipeq schedule as one (the file I/O around the pure :mod:`pipeq.schedules.tdp_csv`)."""

from __future__ import annotations

from typing import Any

from pipeq.schedules.plan import build
from pipeq.schedules.registry import resolve
from pipeq.schedules.tdp_csv import CsvSchedule, dumps

__all__ = ["from_csv", "to_csv"]


def from_csv(path: str, placement: str = "loop") -> CsvSchedule:
    """The schedule a TDP compute-only CSV file holds (validated and dry-run); a file of several
    stages per process places them ``placement``: ``"loop"`` or ``"v"``."""
    with open(path, newline="") as f:
        return CsvSchedule(f.read(), label=f"csv:{path}", placement=placement)


def to_csv(path: str, schedule: Any, n_processes: int, n_microbatches: int) -> str:
    """Write ``schedule``'s plan on ``n_processes`` (validated and dry-run first) as TDP's
    compute-only CSV, in the schedule's placement; its text."""
    policy = resolve(schedule)
    build(policy, n_processes * policy.stages_per_process, n_microbatches)
    text = dumps(policy.plan(n_processes, n_microbatches), policy.placement)
    with open(path, "w", newline="") as f:
        f.write(text)
    return text
