"""TDP schedule CSV files: :func:`from_csv` reads one as a schedule the runner takes, :func:`to_csv`
writes a pipeq schedule as one (the file I/O around the pure :mod:`pipeq.schedules.tdp_csv`)."""

from __future__ import annotations

from typing import Any

from pipeq.schedules.plan import build
from pipeq.schedules.registry import resolve
from pipeq.schedules.tdp_csv import CsvSchedule, dumps

__all__ = ["from_csv", "to_csv"]


def from_csv(path: str) -> CsvSchedule:
    """The schedule a TDP compute-only CSV file holds (one stage per process; validated and dry-run)."""
    with open(path, newline="") as f:
        return CsvSchedule(f.read(), label=f"csv:{path}")


def to_csv(path: str, schedule: Any, n_stages: int, n_microbatches: int, placement: str = "loop") -> str:
    """Write ``schedule``'s plan (validated and dry-run first) as TDP's compute-only CSV; its text."""
    build(schedule, n_stages, n_microbatches)
    text = dumps(resolve(schedule).plan(n_stages, n_microbatches), placement)
    with open(path, "w", newline="") as f:
        f.write(text)
    return text
