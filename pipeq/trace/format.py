"""Traces: the one owner of pipeq's trace file, which says what every stage did and when.

Writing. A traced stage appends one row per action to a plain list (cheap enough to leave on)::

    (code, step, microbatch, start_ns, end_ns, bytes)      code: see OPS below

The driver fetches each stage's rows as one int64 tensor, shifts them onto its own clock with
offsets measured over the control channel (NTP-style: the round trip with the smallest delay
wins, measured when the run starts and again when it ends, interpolated in between), adds its
own "step S" spans and writes a Chrome trace-event JSON file (Perfetto, chrome://tracing): one
track per stage (``tid`` = stage, ``pid`` = replica) plus a driver track (:func:`build`,
:func:`write`). :func:`planned_trace` writes a schedule's plan (its dry run) in the same format.

The file (version 1, :data:`VERSION`): ``otherData`` holds ``pipeq_trace_version`` (1),
``schedule``, ``n_stages``, ``microbatches``, ``replicas``, ``clock_offsets_us`` (and a run's
``clock_rtt_us``, ``clock_origin_ns``: the driver's clock at ``ts`` 0, ``clock_samples``: per
stage, every ``[at_ns, offset_ns, rtt_ns]`` measured, from which :mod:`pipeq.trace.critical` maps a
stage's times back onto its own clock, and ``hosts``, each stage's, when they were several; a
plan's ``planned``, ``backward_cost``, ``unit_us``); every ``"X"`` event of a
stage has ``ts`` and ``dur`` (microseconds, clocks aligned to the driver's) and ``args`` with
``stage``, ``step`` and optionally ``replica`` (default: the event's ``pid``), ``microbatch``
(default -1), ``op``, ``bytes`` (default 0) and ``training`` (default true). ``cat`` says what
the time was: ``forward``, ``backward``, ``step`` (compute), ``send``, ``wait`` (blocked on an
input); events of other categories are read and kept. The driver's ``"step S"`` (``"predict
S"``) spans have ``cat`` ``driver`` and ``args`` ``step``, ``replica``, ``training``,
``microbatches``; ``"M"`` events name the tracks. A stage's parallel layers record ``parallel``
events: ``GATHER`` (FSDP gathers its parameters; ``bytes``: what it then holds whole), ``FREE``
and ``REDUCE`` (the step's reduce-scatter and the replicas' all-reduce; ``bytes``: the gradients).

Reading. :func:`load_trace` (a file) and :func:`trace_from_dict` (a parsed one) check a trace
and index it (:class:`Trace`, :class:`Event`), with a ValueError saying what is wrong. The
numbers are :mod:`pipeq.trace.report`'s, the pictures :mod:`pipeq.trace.plot`'s.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from pipeq import schedules
from pipeq.schedules import Action, Op
from pipeq.schedules.plan import table_costs

__all__ = ["VERSION", "Trace", "Event", "TraceMeta", "load_trace", "trace_from_dict", "planned_trace", "save_trace"]

VERSION = 1
"""The trace format's version, in the file's metadata."""

# what an event's time was (its "cat"): compute, sending, waiting for an input, a driver's step, a
# stage's parallel layers (FSDP's gathers and frees, the reductions over shards and replicas)
FORWARD_CAT, BACKWARD_CAT, STEP_CAT, SEND_CAT, WAIT_CAT, DRIVER_CAT, PARALLEL_CAT = (
    "forward", "backward", "step", "send", "wait", "driver", "parallel")
COMPUTE_CATS = (FORWARD_CAT, BACKWARD_CAT, STEP_CAT)

# row codes (OPT_STEP: a schedule's optimizer step; EMIT: a result handed to the driver)
F, B, OPT_STEP, SEND_ACT, SEND_GRAD, WAIT_ACT, WAIT_GRAD, EMIT = range(8)
I, W = 8, 9  # a split backward's input gradient and weight gradients (zero-bubble schedules)
# a stage's parallel layers (pipeq.parallel.layers): FSDP's gather of its parameters (bytes: what
# it holds whole), their free, the step's reductions (bytes: the gradients reduced)
GATHER, FREE, REDUCE = 10, 11, 12
# code -> (op, category, name prefix): the one table of ops
OPS: dict[int, tuple[str, str, str]] = {
    F: ("F", FORWARD_CAT, "F"),
    B: ("B", BACKWARD_CAT, "B"),
    OPT_STEP: ("STEP", STEP_CAT, "STEP"),
    SEND_ACT: ("SEND_ACT", SEND_CAT, "send act "),
    SEND_GRAD: ("SEND_GRAD", SEND_CAT, "send grad "),
    WAIT_ACT: ("WAIT_ACT", WAIT_CAT, "wait act "),
    WAIT_GRAD: ("WAIT_GRAD", WAIT_CAT, "wait grad "),
    EMIT: ("OUTPUT", SEND_CAT, "output "),
    I: ("I", BACKWARD_CAT, "I"),
    W: ("W", BACKWARD_CAT, "W"),
    GATHER: ("GATHER", PARALLEL_CAT, "gather "),
    FREE: ("FREE", PARALLEL_CAT, "free "),
    REDUCE: ("REDUCE", PARALLEL_CAT, "reduce "),
}
#: a compute action's row code; OP_OF_CODE: back (the one mapping between the two)
CODE_OF_OP: dict[Op, int] = {Op.FORWARD: F, Op.BACKWARD: B, Op.INPUT_GRAD: I, Op.WEIGHT_GRAD: W, Op.STEP: OPT_STEP}
OP_OF_CODE: dict[int, Op] = {code: op for op, code in CODE_OF_OP.items()}
COLUMNS = 6
#: A stage keeps its most recent rows only (a ring buffer, ~30 MB): a long traced run keeps its
#: last few thousand steps, and the oldest, partly overwritten step is left out of the file.
MAX_ROWS = 200_000

# derived from OPS, for reading: an event's category when it names none, its op when it names none
# (a compute category's first op, F, B or STEP, else the category in capitals, SEND or WAIT)
_CAT_OF_OP = {op: cat for op, cat, _ in OPS.values()}
_OPS_OF_CAT = {cat: [op for op, c in _CAT_OF_OP.items() if c == cat] for cat in _CAT_OF_OP.values()}
_OP_OF_CAT = {cat: ops[0] if len(ops) == 1 or cat in COMPUTE_CATS else cat.upper() for cat, ops in _OPS_OF_CAT.items()}


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
    return schedules.resolve(schedule).label


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


def _to_driver(samples: Sequence[ClockSample]) -> Any:
    """A stage's clock (ns) to the driver's: every moment shifted by the offset interpolated at
    that moment (clocks of two hosts can be days apart: converted with the first sample before
    interpolating). Starts and ends go through the same increasing map, so one stage's actions,
    which follow each other on its own clock, never overlap on the driver's."""
    if not samples:
        return float
    first = samples[0].offset_ns
    return lambda t: t - _offset_at(samples, t - first)


@dataclass
class TraceMeta:
    """What a trace is of: the schedule, the stage and microbatch counts, the replicas, and more."""

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
        to_driver = _to_driver(clocks[k] if clocks else [])
        for code, step, mb, t0, t1, nbytes in t.tolist():
            rows.append((code, step, mb, to_driver(t0), to_driver(t1), nbytes))
        shifted.append((k, rows))
        starts += [r[3] for r in rows[:1]]  # rows are in time order: the first starts first
    origin = origin_ns if origin_ns is not None else (min(starts) if starts else 0.0)
    training = {s[0]: s[1] for s in driver_spans}
    events += _tracks(replica, f"replica {replica}",
                      [f"stage {k}" + (f" ({hosts[k]})" if hosts else "") for k in range(n)])
    for k, rows in shifted:
        for code, step, mb, t0, t1, nbytes in rows:
            op, cat, prefix = OPS[code]
            name = prefix.strip() if code == OPT_STEP or mb < 0 else f"{prefix}{mb}"
            events.append(_stage_span(name, cat, op, replica, k, step,
                                      mb, (t0 - origin) / 1e3, max(0.0, (t1 - t0) / 1e3), nbytes,
                                      training.get(step, True)))
    for step, train, t0, t1, m in driver_spans:
        events.append(_step_span(replica, n, step, train, m, (t0 - origin) / 1e3, (t1 - t0) / 1e3))
    return _file(meta, events, clock_offsets_us=[c[0].offset_ns / 1e3 if c else 0.0 for c in clocks],
                 clock_rtt_us=[c[0].rtt_ns / 1e3 if c else 0.0 for c in clocks], clock_origin_ns=origin,
                 clock_samples=[[[s.at_ns, s.offset_ns, s.rtt_ns] for s in c] for c in clocks],
                 **({"hosts": list(hosts)} if hosts else {}))


def _tracks(pid: int, process: str, stages: list[str]) -> list[dict[str, Any]]:
    """The metadata events naming a process (a replica, a plan) and its tracks: the stages', the driver's."""
    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": process}}]
    for k, name in enumerate([*stages, "driver"]):
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": k, "args": {"name": name}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": k, "args": {"sort_index": k}})
    return events


def _stage_span(name: str, cat: str, op: str, replica: int, stage: int, step: int, mb: int, ts_us: float,
                dur_us: float, nbytes: int, training: bool) -> dict[str, Any]:
    """One stage's timed event ("X")."""
    return {"ph": "X", "name": name, "cat": cat, "pid": replica, "tid": stage, "ts": ts_us, "dur": dur_us,
            "args": {"stage": stage, "replica": replica, "step": step, "microbatch": mb, "bytes": nbytes,
                     "op": op, "training": training}}


def _step_span(replica: int, n_stages: int, step: int, training: bool, m: int, ts_us: float,
               dur_us: float) -> dict[str, Any]:
    """The driver's span of one step (or forward-only "predict" step) on the driver's track."""
    return {"ph": "X", "name": f"step {step}" if training else f"predict {step}", "cat": DRIVER_CAT,
            "pid": replica, "tid": n_stages, "ts": ts_us, "dur": dur_us,
            "args": {"step": step, "replica": replica, "training": training, "microbatches": m}}


def _file(meta: TraceMeta, events: list[dict[str, Any]], **other: Any) -> dict[str, Any]:
    """The trace dict: ``otherData`` (the version, ``meta``, ``other``, ``meta.extra``) and the events."""
    head = {"pipeq_trace_version": VERSION, "schedule": meta.schedule, "n_stages": meta.n_stages,
            "microbatches": meta.microbatches, "replicas": meta.replicas}
    return {"displayTimeUnit": "ms", "otherData": {**head, **other, **meta.extra}, "traceEvents": events}


def write(path: str, trace: dict[str, Any]) -> None:
    """Write the trace (a temporary file, then a rename: never a half-written trace)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(trace, f, separators=(",", ":"))
    os.replace(tmp, path)


# ---------------------------------------------------------------- reading


@dataclass(frozen=True, slots=True)
class Event:
    """One timed span of one stage (an ``"X"`` event of the trace)."""

    stage: int
    replica: int
    step: int
    microbatch: int
    op: str  # args.op: F, B, STEP, SEND_ACT, SEND_GRAD, OUTPUT, WAIT_ACT, WAIT_GRAD, or other
    cat: str  # forward, backward, step, send, wait, or a category this module does not know
    name: str
    start_us: float
    dur_us: float
    bytes: int
    training: bool

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


@dataclass
class Trace:
    """A pipeq trace file, checked: the stages' events and the driver's step spans."""

    meta: dict[str, Any]  # the file's otherData
    events: list[Event]  # stage events, sorted by start time
    driver: dict[tuple[int, int], tuple[float, float]]  # (replica, step) -> (start_us, dur_us)
    n_stages: int
    replicas: int
    driver_training: dict[tuple[int, int], bool] = field(default_factory=dict)
    source: str = "<trace>"

    def is_training(self, key: tuple[int, int]) -> bool:
        """Whether step ``key`` = (replica, step) was a training step (not forward-only)."""
        if key in self.driver_training:
            return self.driver_training[key]
        return any(e.training for e in self.events if (e.replica, e.step) == key)

    def step_keys(self) -> list[tuple[int, int]]:
        """Every (replica, step) with stage events or a driver span, in step order."""
        keys = {(e.replica, e.step) for e in self.events} | set(self.driver)
        return sorted(keys, key=lambda k: (k[1], k[0]))


def load_trace(path: str | os.PathLike[str]) -> Trace:
    """Read and check a pipeq trace file; ValueError naming the file and what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"cannot read trace {os.fspath(path)}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{os.fspath(path)} is not JSON ({exc}); expected a pipeq trace, as written by "
            "PipelineRunner(trace=...) or pipeq launch --trace"
        ) from None
    return trace_from_dict(data, source=os.fspath(path))


def trace_from_dict(data: Any, source: str = "<trace>") -> Trace:
    """Check a parsed trace (e.g. from :func:`planned_trace`) and index it."""
    meta = _check_header(data, source)
    events: list[Event] = []
    driver: dict[tuple[int, int], tuple[float, float]] = {}
    driver_training: dict[tuple[int, int], bool] = {}
    for i, ev in enumerate(data["traceEvents"]):
        if not isinstance(ev, dict):
            raise ValueError(f"{source}: traceEvents[{i}] is not an object")
        if ev.get("ph") != "X":
            continue  # metadata, instants, counters: not timed spans of a stage
        if ev.get("cat") == DRIVER_CAT:
            key, span, training = _driver_span(ev, i, source)
            if key in driver:  # two spans of one step: keep their union
                s0, d0 = driver[key]
                start, end = min(s0, span[0]), max(s0 + d0, span[0] + span[1])
                span = (start, end - start)
            driver[key] = span
            if training is not None:
                driver_training[key] = training
        else:
            events.append(_stage_event(ev, i, source))
    n_stages = _count(meta, "n_stages", 1 + max((e.stage for e in events), default=-1), source)
    replicas = _count(meta, "replicas", 1 + max((e.replica for e in events), default=-1), source)
    for e in events:
        if e.stage >= n_stages or e.replica >= replicas:
            where, said = (("stage", f"n_stages={n_stages}") if e.stage >= n_stages
                           else ("replica", f"replicas={replicas}"))
            raise ValueError(f"{source}: event {e.name!r} is on {where} {getattr(e, where)}, but the trace "
                             f"says {said} (otherData)")
    if not events and not driver:
        raise ValueError(f"{source}: the trace has no timed events (\"ph\": \"X\"); was the run traced "
                         "for at least one step?")
    events.sort(key=lambda e: (e.start_us, e.replica, e.stage))
    return Trace(meta, events, driver, n_stages, replicas, driver_training, source)


def _check_header(data: Any, source: str) -> dict[str, Any]:
    if isinstance(data, list):
        raise ValueError(f"{source} is a bare list of trace events; a pipeq trace is an object with "
                         "traceEvents and otherData.pipeq_trace_version")
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{source} has no traceEvents list; is it a pipeq trace (Chrome trace-event "
                         "JSON written by PipelineRunner(trace=...) or pipeq launch --trace)?")
    meta = data.get("otherData")
    if not isinstance(meta, dict) or "pipeq_trace_version" not in meta:
        raise ValueError(f"{source} has no otherData.pipeq_trace_version: not a pipeq trace (write one "
                         "with PipelineRunner(trace=...) or pipeq launch --trace)")
    version = meta["pipeq_trace_version"]
    if version != VERSION:
        raise ValueError(f"{source} is a pipeq trace of version {version!r}; this pipeq reads version "
                         f"{VERSION} (use the pipeq that wrote it, or re-trace the run)")
    return meta


def _count(meta: dict[str, Any], key: str, seen: int, source: str) -> int:
    value = meta.get(key, max(seen, 1))
    if type(value) is not int or value < 1:
        raise ValueError(f"{source}: otherData.{key} must be a positive integer, got {value!r}")
    return value


def _number(ev: dict[str, Any], key: str, i: int, source: str) -> float:
    value = ev.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        what = "has no" if value is None else f"has a non-numeric ({value!r})"
        raise ValueError(f"{source}: traceEvents[{i}] ({ev.get('name')!r}) {what} {key!r}; "
                         "every \"X\" event needs ts and dur in microseconds")
    if key == "dur" and value < 0:
        raise ValueError(f"{source}: traceEvents[{i}] ({ev.get('name')!r}) has a negative dur {value}")
    return float(value)


def _int_arg(args: dict[str, Any], key: str, i: int, ev: dict[str, Any], source: str,
             default: int | None = None) -> int:
    value = args.get(key, default)
    if type(value) is not int:
        what = "has no" if value is None else f"has a non-integer ({value!r})"
        raise ValueError(f"{source}: traceEvents[{i}] ({ev.get('name')!r}) {what} args.{key}")
    return value


def _args(ev: dict[str, Any], i: int, source: str) -> dict[str, Any]:
    args = ev.get("args")
    if not isinstance(args, dict):
        raise ValueError(f"{source}: traceEvents[{i}] ({ev.get('name')!r}) has no args; a stage's "
                         "\"X\" event needs args.stage and args.step")
    return args


def _stage_event(ev: dict[str, Any], i: int, source: str) -> Event:
    start, dur = _number(ev, "ts", i, source), _number(ev, "dur", i, source)
    args = _args(ev, i, source)
    stage = _int_arg(args, "stage", i, ev, source)
    step = _int_arg(args, "step", i, ev, source)
    pid = ev.get("pid", 0)
    replica = _int_arg(args, "replica", i, ev, source, pid if type(pid) is int else 0)
    if stage < 0 or replica < 0:
        raise ValueError(f"{source}: traceEvents[{i}] ({ev.get('name')!r}) has a negative stage or replica")
    op = str(args.get("op", ""))
    cat = str(ev.get("cat") or _CAT_OF_OP.get(op, "other"))
    nbytes = args.get("bytes", 0)
    return Event(
        stage=stage, replica=replica, step=step,
        microbatch=_int_arg(args, "microbatch", i, ev, source, -1),
        op=op or _OP_OF_CAT.get(cat, cat), cat=cat, name=str(ev.get("name", cat)),
        start_us=start, dur_us=dur,
        bytes=int(nbytes) if isinstance(nbytes, (int, float)) and not isinstance(nbytes, bool) else 0,
        training=bool(args.get("training", True)),
    )


def _driver_span(ev: dict[str, Any], i: int, source: str) -> tuple[tuple[int, int], tuple[float, float], bool | None]:
    start, dur = _number(ev, "ts", i, source), _number(ev, "dur", i, source)
    args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
    step = args.get("step")
    if type(step) is not int:
        name = str(ev.get("name", ""))
        if not (name.startswith("step ") and name[5:].strip().isdigit()):
            raise ValueError(f"{source}: traceEvents[{i}] (driver span {name!r}) has no args.step")
        step = int(name[5:])
    pid = ev.get("pid", 0)
    replica = args.get("replica", pid if type(pid) is int else 0)
    training = args.get("training")
    return (int(replica), step), (start, dur), None if training is None else bool(training)



# ---------------------------------------------------------------- a schedule's plan


def planned_trace(schedule: str | schedules.ScheduleFn, n_stages: int, n_microbatches: int,
                  backward_cost: int = 2, unit_us: float = 1000.0, costs: Sequence[int] | None = None,
                  ) -> dict[str, Any]:
    """A schedule's planned step (its dry run) as a trace dict in the traced runs' format.

    ``n_stages`` counts processes: a schedule of v stages per process plans v·N stages (each
    its own row, by model stage). Forward and optimizer step take one time unit (``unit_us`` microseconds), backward
    ``backward_cost`` units, communication none; or ``costs`` = (F, I, W) units, a B being I + W
    (see :func:`pipeq.schedules.plan.table_costs`). Draw it with :func:`pipeq.trace.plot_trace`,
    keep it with :func:`save_trace`.
    """
    if type(backward_cost) is not int or backward_cost < 1:
        raise ValueError(f"backward_cost is in forward time units, a positive integer; got {backward_cost!r}")
    if not unit_us > 0:
        raise ValueError(f"unit_us must be positive, got {unit_us!r}")
    cost = table_costs(costs, backward_cost)
    n_stages = n_stages * schedules.resolve(schedule).stages_per_process  # (n_stages counted processes)
    held = schedules.process_stages(schedule, n_stages)  # with virtual stages, several per process
    lowered = schedules.build(schedule, n_stages, n_microbatches)
    timeline = schedules.dry_run(lowered, cost=cost, stages=held)
    name = schedules.schedule_name(schedule)
    events = _tracks(0, f"plan: {name}", [f"stage {k}" for k in range(n_stages)])
    end = 0
    for k, row in enumerate(timeline):
        for t, a in row:
            units = cost[a.op]
            end = max(end, t + units)
            label = str(Action(a.op, a.microbatch))
            events.append(_stage_span(label, _CAT_OF_OP[a.op.value], a.op.value, 0, held[k][a.chunk], 0, a.microbatch,
                                      t * unit_us, units * unit_us, 0, True))
    events.append(_step_span(0, n_stages, 0, True, n_microbatches, 0.0, end * unit_us))
    extra: dict[str, Any] = {"planned": True, "backward_cost": cost[Op.BACKWARD], "unit_us": unit_us}
    if costs is not None:
        extra["costs"] = list(costs)
    meta = TraceMeta(name, n_stages, n_microbatches, extra=extra)
    return _file(meta, events, clock_offsets_us=[0.0] * n_stages)


def save_trace(trace_dict: dict[str, Any], path: str | os.PathLike[str]) -> str:
    """Write a trace dict (e.g. :func:`planned_trace`'s) as JSON; return the path."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(trace_dict, f)
        f.write("\n")
    return os.fspath(path)
