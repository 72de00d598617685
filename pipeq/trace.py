"""Traces: what every stage did and when, merged into one Chrome trace-event file.

A traced stage appends one row per action to a plain list (cheap enough to leave on)::

    (code, step, microbatch, start_ns, end_ns, bytes)      code: see OPS below

The driver fetches each stage's rows as one int64 tensor, shifts them onto its own clock with
offsets measured over the control channel (NTP-style: the round trip with the smallest delay
wins, measured when the run starts and again when it ends, interpolated in between), adds its
own "step S" spans and writes a Chrome trace-event JSON file (Perfetto, chrome://tracing): one
track per stage (``tid`` = stage, ``pid`` = replica) plus a driver track. ``pipeq report``
(:mod:`pipeq.report`) reads it back.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

VERSION = 1

# code -> (op, category, name prefix)
OPS: dict[int, tuple[str, str, str]] = {
    0: ("F", "forward", "F"),
    1: ("B", "backward", "B"),
    2: ("STEP", "step", "STEP"),
    3: ("SEND_ACT", "send", "send act "),
    4: ("SEND_GRAD", "send", "send grad "),
    5: ("WAIT_ACT", "wait", "wait act "),
    6: ("WAIT_GRAD", "wait", "wait grad "),
    7: ("OUTPUT", "send", "output "),
}
# row codes (OPT_STEP: a schedule's optimizer step; EMIT: a result handed to the driver)
F, B, OPT_STEP, SEND_ACT, SEND_GRAD, WAIT_ACT, WAIT_GRAD, EMIT = range(8)
COLUMNS = 6
#: A stage keeps its most recent rows only (a ring buffer, ~30 MB): a long traced run keeps its
#: last few thousand steps, and the oldest, partly overwritten step is left out of the file.
MAX_ROWS = 200_000


def drop_partial_steps(rows: list[torch.Tensor], truncated: list[bool]) -> list[torch.Tensor]:
    """Leave out every step up to the oldest one a full ring buffer may have cut into."""
    cut = [int(t[:, 1].min()) for t, full in zip(rows, truncated) if full and t.numel()]
    if not cut:
        return rows
    first_whole = max(cut) + 1
    return [t[t[:, 1] >= first_whole] for t in rows]


def schedule_label(schedule: Any) -> str:
    """A schedule's name: registered names and pipeq's schedule objects by name, functions by
    ``module:qualname``."""
    if isinstance(schedule, str):
        return schedule
    if isinstance(getattr(schedule, "name", None), str):
        return schedule.name
    return f"{schedule.__module__}:{getattr(schedule, '__qualname__', type(schedule).__name__)}"


def rows_to_tensor(rows: Sequence[tuple[int, ...]]) -> torch.Tensor:
    """A stage's recorded rows as one (n, 6) int64 tensor (one message frame, no per-row cost)."""
    if not rows:
        return torch.zeros((0, COLUMNS), dtype=torch.int64)
    return torch.tensor(rows, dtype=torch.int64)


def check_rows(t: torch.Tensor, stage: int) -> torch.Tensor:
    if t.dtype != torch.int64 or t.dim() != 2 or t.shape[1] != COLUMNS:
        raise ValueError(f"stage {stage} sent a trace of shape {tuple(t.shape)} {t.dtype}, "
                         f"expected (n, {COLUMNS}) int64")
    if t.numel() and (int(t[:, 0].min()) < 0 or int(t[:, 0].max()) >= len(OPS)):
        raise ValueError(f"stage {stage} sent a trace with an unknown action code")
    return t


@dataclass
class ClockSample:
    """One stage's clock offset (stage time - driver time, ns), measured at driver time ``at_ns``."""

    at_ns: int
    offset_ns: float
    rtt_ns: int


def best_offset(samples: Sequence[tuple[int, int, int]]) -> ClockSample:
    """From (driver send ns, stage ns, driver receive ns) round trips: the least-delayed one."""
    t0, ts, t1 = min(samples, key=lambda s: s[2] - s[0])
    return ClockSample(at_ns=(t0 + t1) // 2, offset_ns=ts - (t0 + t1) / 2, rtt_ns=t1 - t0)


def _offset_at(samples: Sequence[ClockSample], t_ns: float) -> float:
    if len(samples) == 1 or samples[-1].at_ns == samples[0].at_ns:
        return samples[0].offset_ns
    a, b = samples[0], samples[-1]
    return a.offset_ns + (b.offset_ns - a.offset_ns) * (t_ns - a.at_ns) / (b.at_ns - a.at_ns)


@dataclass
class TraceMeta:
    schedule: str
    n_stages: int
    microbatches: int
    replicas: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


def build(
    meta: TraceMeta,
    stage_rows: Sequence[torch.Tensor],
    clocks: Sequence[Sequence[ClockSample]],
    driver_spans: Sequence[tuple[int, bool, int, int, int]],
    replica: int = 0,
    hosts: Sequence[str] | None = None,
    origin_ns: float | None = None,
) -> dict[str, Any]:
    """The Chrome trace-event dict. ``driver_spans``: (step, training, start_ns, end_ns, m)."""
    n = meta.n_stages
    events: list[dict[str, Any]] = []
    shifted: list[tuple[int, list[tuple[int, int, int, float, float, int]]]] = []
    starts = [float(s[2]) for s in driver_spans]
    for k, t in enumerate(stage_rows):
        rows = []
        for code, step, mb, t0, t1, nbytes in t.tolist():
            # interpolate the offset at this moment in driver time (clocks of two hosts can be
            # days apart: convert with the first sample before interpolating)
            off = _offset_at(clocks[k], t0 - clocks[k][0].offset_ns) if clocks and clocks[k] else 0.0
            rows.append((code, step, mb, t0 - off, t1 - off, nbytes))
        shifted.append((k, rows))
        starts += [r[3] for r in rows[:1]]  # rows are in time order: the first starts first
    origin = origin_ns if origin_ns is not None else (min(starts) if starts else 0.0)
    training = {s[0]: s[1] for s in driver_spans}
    pid = replica
    events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"replica {replica}"}})
    for k in range(n + 1):
        name = "driver" if k == n else f"stage {k}" + (f" ({hosts[k]})" if hosts else "")
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": k, "args": {"name": name}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": k, "args": {"sort_index": k}})
    for k, rows in shifted:
        for code, step, mb, t0, t1, nbytes in rows:
            op, cat, prefix = OPS[code]
            events.append({
                "ph": "X", "name": prefix if code == OPT_STEP else f"{prefix}{mb}", "cat": cat,
                "pid": pid, "tid": k, "ts": (t0 - origin) / 1e3, "dur": max(0.0, (t1 - t0) / 1e3),
                "args": {"stage": k, "replica": replica, "step": step, "microbatch": mb,
                         "bytes": nbytes, "op": op, "training": training.get(step, True)},
            })
    for step, train, t0, t1, m in driver_spans:
        events.append({
            "ph": "X", "name": f"step {step}" if train else f"predict {step}", "cat": "driver",
            "pid": pid, "tid": n, "ts": (t0 - origin) / 1e3, "dur": (t1 - t0) / 1e3,
            "args": {"step": step, "replica": replica, "training": train, "microbatches": m},
        })
    return {
        "displayTimeUnit": "ms",
        "otherData": {
            "pipeq_trace_version": VERSION, "schedule": meta.schedule, "n_stages": n,
            "microbatches": meta.microbatches, "replicas": meta.replicas,
            "clock_offsets_us": [c[0].offset_ns / 1e3 if c else 0.0 for c in clocks],
            "clock_rtt_us": [c[0].rtt_ns / 1e3 if c else 0.0 for c in clocks],
            **meta.extra,
        },
        "traceEvents": events,
    }


def write(path: str, trace: dict[str, Any]) -> None:
    """Write the trace (a temporary file, then a rename: never a half-written trace)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(trace, f, separators=(",", ":"))
    os.replace(tmp, path)
