"""Reading a pipeq trace: where each stage's time went, how big the pipeline bubble was, pictures.

A traced run (``PipelineRunner(..., trace="run.json")`` or ``pipeq launch --trace run.json``)
writes one Chrome trace-event JSON file (it opens in Perfetto or chrome://tracing). This module
reads it back::

    trace = load_trace("run.json")
    print(format_report(analyze(trace, skip_first=1)))   # or: pipeq report run.json --skip-first 1
    plot_trace(trace, "run.png")                          # the last training step, stage x time

and draws a schedule's *plan* the same way (``pipeq schedule 1f1b --stages 4 --microbatches 8
--plot plan.png``)::

    plot_trace(planned_trace("1f1b", 4, 8), "plan.png", steps="all")

The file (version 1): ``otherData`` holds ``pipeq_trace_version`` (1), ``schedule``,
``n_stages``, ``microbatches``, ``replicas``; every ``"X"`` event of a stage has ``ts`` and
``dur`` (microseconds, clocks aligned to the driver's) and ``args`` with ``stage``, ``step``
and optionally ``replica`` (default: the event's ``pid``), ``microbatch`` (default -1),
``op``, ``bytes`` (default 0) and ``training`` (default true). ``cat`` says what the time was:
``forward``, ``backward``, ``step`` (compute), ``send``, ``wait`` (blocked on an input); other
categories are kept but left out of the numbers (and drawn grey). A step's wall time runs from
its first stage event's start to its last one's end (the driver's ``"step S"`` spans, ``cat``
``driver``, are drawn, and used for steps without stage events).

Bubble: the share of a step's wall time a stage does not compute, averaged over the stages. The
ideal, (N-1)/(m+N-1) for N stages and m microbatches, is that of fill-drain and 1F1B with equal
stage costs and free communication (and no optimizer step). Nothing here starts a process or
opens a socket; matplotlib is needed for the pictures only (``pip install 'pipeq[plot]'``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Union

from . import schedules
from .schedules import Op

TRACE_VERSION = 1

COMPUTE_CATS = ("forward", "backward", "step")
SEND_CAT = "send"
WAIT_CAT = "wait"
DRIVER_CAT = "driver"

_CAT_OF_OP = {"F": "forward", "B": "backward", "STEP": "step", "SEND_ACT": "send", "SEND_GRAD": "send",
              "OUTPUT": "send", "WAIT_ACT": "wait", "WAIT_GRAD": "wait"}
_OP_OF_CAT = {"forward": "F", "backward": "B", "step": "STEP", "send": "SEND", "wait": "WAIT"}

StepSelection = Union[int, str, Iterable[int], None]


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
    if version != TRACE_VERSION:
        raise ValueError(f"{source} is a pipeq trace of version {version!r}; this pipeq reads version "
                         f"{TRACE_VERSION} (use the pipeq that wrote it, or re-trace the run)")
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


# ---------------------------------------------------------------- the numbers


@dataclass
class StageStep:
    """Where one stage's time went in one step (microseconds; bytes)."""

    replica: int
    step: int
    stage: int
    wall_us: float
    compute_us: float = 0.0  # forward + backward + optimizer step
    send_us: float = 0.0
    wait_us: float = 0.0  # blocked waiting for an input
    idle_us: float = 0.0  # the rest of the step's wall time (never negative)
    bytes_sent: int = 0
    bytes_received: int = 0

    @property
    def bubble(self) -> float:
        """Share of the step's wall time this stage did not compute."""
        return _bubble(self.compute_us, self.wall_us)


@dataclass
class StepStats:
    """One step of one replica: its wall time, its stages, its measured and ideal bubble."""

    replica: int
    step: int
    training: bool
    wall_us: float
    microbatches: int
    stages: list[StageStep]
    bubble: float  # mean over the stages of (1 - compute / wall)
    ideal_bubble: float  # (N-1)/(m+N-1)
    slowest_stage: int  # the stage with the most compute


@dataclass
class StageTotals:
    """One stage summed over every step analysed (microseconds; bytes)."""

    stage: int
    steps: int = 0  # (replica, step) pairs summed
    wall_us: float = 0.0
    compute_us: float = 0.0
    send_us: float = 0.0
    wait_us: float = 0.0
    idle_us: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0

    @property
    def compute_fraction(self) -> float:
        return self.compute_us / self.wall_us if self.wall_us > 0 else 0.0

    @property
    def bubble(self) -> float:
        return _bubble(self.compute_us, self.wall_us)

    def per_step(self, total: float) -> float:
        return total / self.steps if self.steps else 0.0


@dataclass
class Report:
    """:func:`analyze`'s result; :func:`format_report` prints it."""

    schedule: str
    n_stages: int
    replicas: int
    include_predict: bool
    skipped: list[int]  # step numbers left out by skip_first
    steps: list[StepStats]
    stages: list[StageTotals]
    bubble: float  # mean over steps of the measured bubble
    ideal_bubble: float  # mean over steps of (N-1)/(m+N-1)
    slowest_stage: int  # the stage with the most compute over the run

    @property
    def microbatches(self) -> list[int]:
        """The distinct microbatch counts of the steps analysed."""
        return sorted({s.microbatches for s in self.steps})


def _bubble(compute_us: float, wall_us: float) -> float:
    return min(1.0, max(0.0, 1.0 - compute_us / wall_us)) if wall_us > 0 else 0.0


def ideal_bubble(n_stages: int, n_microbatches: int) -> float:
    """(N-1)/(m+N-1): fill-drain's and 1F1B's bubble with equal stage costs and free communication."""
    return (n_stages - 1) / (n_microbatches + n_stages - 1) if n_microbatches > 0 else 0.0


def select_steps(trace: Trace, steps: StepSelection) -> set[int] | None:
    """Step numbers named by ``steps``: None -> the last training step, "all" -> None (every step),
    an int or iterable of ints -> those; ValueError if the trace has none of them."""
    present = sorted({k[1] for k in trace.step_keys()})
    if isinstance(steps, str):
        if steps != "all":
            return select_steps(trace, parse_steps(steps))
        return None
    if steps is None:
        training = sorted({k[1] for k in trace.step_keys() if trace.is_training(k)})
        return {(training or present)[-1]}
    wanted = {steps} if isinstance(steps, int) else {int(s) for s in steps}
    if not wanted & set(present):
        raise ValueError(f"{trace.source} has no step {_span_text(sorted(wanted))}; its steps are "
                         f"{_span_text(present)}")
    return wanted


def parse_steps(text: str) -> str | int | range:
    """``"all"``, ``"N"`` or ``"N-M"`` (inclusive) as given to ``--steps``."""
    text = text.strip()
    if text == "all":
        return "all"
    lo, sep, hi = text.partition("-")
    try:
        if not sep:
            return int(lo)
        first, last = int(lo), int(hi)
    except ValueError:
        raise ValueError(f"--steps takes all, N or N-M (e.g. 5 or 3-7), got {text!r}") from None
    if last < first:
        raise ValueError(f"--steps {text}: the range ends before it starts; write N-M with N <= M")
    return range(first, last + 1)


def _span_text(values: list[int]) -> str:
    if not values:
        return "(none)"
    if len(values) > 1 and values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ", ".join(map(str, values[:8])) + (", ..." if len(values) > 8 else "")


def analyze(trace: Trace, include_predict: bool = False, *, skip_first: int = 0,
            steps: StepSelection = "all") -> Report:
    """Per step and stage: compute, send, wait and idle time, bytes moved, the bubble.

    Covers the training steps (and the forward-only ones with ``include_predict``) among
    ``steps`` (default "all"; see :func:`select_steps`), leaving out the first ``skip_first`` of
    them (the first step includes lazy initialisation).
    """
    if type(skip_first) is not int or skip_first < 0:
        raise ValueError(f"skip_first must be a non-negative integer, got {skip_first!r}")
    wanted = select_steps(trace, steps)
    keys = [k for k in trace.step_keys()
            if (wanted is None or k[1] in wanted) and (include_predict or trace.is_training(k))]
    numbers = sorted({k[1] for k in keys})
    skipped = numbers[:skip_first]
    keys = [k for k in keys if k[1] not in skipped]
    if not keys:
        kind = "steps" if include_predict else "training steps"
        hint = "" if include_predict else " (pass include_predict=True / --include-predict to cover forward-only steps)"
        extra = f" after skipping the first {skip_first}" if skip_first else ""
        raise ValueError(f"{trace.source} has no {kind} to report{extra}{hint}")
    by_key: dict[tuple[int, int], list[Event]] = {}
    for e in trace.events:
        by_key.setdefault((e.replica, e.step), []).append(e)
    stats = [_step_stats(trace, key, by_key.get(key, [])) for key in keys]
    totals = _stage_totals(trace.n_stages, stats)
    return Report(
        schedule=str(trace.meta.get("schedule", "?")), n_stages=trace.n_stages, replicas=trace.replicas,
        include_predict=include_predict, skipped=skipped, steps=stats, stages=totals,
        bubble=sum(s.bubble for s in stats) / len(stats),
        ideal_bubble=sum(s.ideal_bubble for s in stats) / len(stats),
        slowest_stage=max(totals, key=lambda t: t.compute_us).stage,
    )


def _step_wall(trace: Trace, key: tuple[int, int], events: list[Event]) -> float:
    """First start to last end of the step's stage events (waits for input excepted): the
    step's own period.

    Not the driver's span: the driver sends step s+1 as soon as the last stage reports step s's
    loss, while the first stages are still in step s's last backwards, so its span would count
    that tail twice. The driver's span is the fallback for a step with no stage events.
    """
    # compute and sends: a stage idling into the step (waiting for its first input) is not its start
    busy = [e for e in events if e.cat in ("forward", "backward", "step", "send")]
    if busy:
        return max(e.end_us for e in busy) - min(e.start_us for e in busy)
    if key in trace.driver:
        return trace.driver[key][1]
    return 0.0


def _step_stats(trace: Trace, key: tuple[int, int], events: list[Event]) -> StepStats:
    wall = _step_wall(trace, key, events)
    rows = [StageStep(key[0], key[1], k, wall) for k in range(trace.n_stages)]
    for e in events:
        row = rows[e.stage]
        if e.cat in COMPUTE_CATS:
            row.compute_us += e.dur_us
        elif e.cat == SEND_CAT:
            row.send_us += e.dur_us
            row.bytes_sent += e.bytes
        elif e.cat == WAIT_CAT:
            row.wait_us += e.dur_us
    _count_received(rows, events)
    for row in rows:
        row.idle_us = max(0.0, wall - row.compute_us - row.send_us - row.wait_us)
    m = len({e.microbatch for e in events if e.stage == 0 and e.cat == "forward"})
    if m == 0:  # stage 0 untraced: the run's setting, else the most forwards any stage ran
        m = trace.meta.get("microbatches") or max(
            (len({e.microbatch for e in events if e.stage == k and e.cat == "forward"})
             for k in range(trace.n_stages)), default=0)
    return StepStats(
        replica=key[0], step=key[1], training=trace.is_training(key), wall_us=wall,
        microbatches=int(m), stages=rows,
        bubble=sum(r.bubble for r in rows) / len(rows),
        ideal_bubble=ideal_bubble(trace.n_stages, int(m)),
        slowest_stage=max(rows, key=lambda r: r.compute_us).stage,
    )


def _message(e: Event) -> str | None:
    """"act" or "grad": the kind of message a send or wait event moves (None: neither)."""
    if e.op in ("SEND_ACT", "WAIT_ACT"):
        return "act"
    if e.op in ("SEND_GRAD", "WAIT_GRAD"):
        return "grad"
    words = e.name.split()
    return words[1] if len(words) > 1 and words[0] in ("send", "wait") and words[1] in ("act", "grad") else None


def _count_received(rows: list[StageStep], events: list[Event]) -> None:
    """Bytes received: the payloads of a stage's wait events; a message the stage recorded no
    wait for is counted from its sender's send event (activations come from stage k-1, gradients
    from k+1)."""
    waited: set[tuple[int, str, int]] = set()
    for e in events:
        if e.cat == WAIT_CAT and (kind := _message(e)):
            rows[e.stage].bytes_received += e.bytes
            waited.add((e.stage, kind, e.microbatch))
    for e in events:
        if e.cat != SEND_CAT or not (kind := _message(e)):
            continue
        dst = e.stage + 1 if kind == "act" else e.stage - 1
        if 0 <= dst < len(rows) and (dst, kind, e.microbatch) not in waited:
            rows[dst].bytes_received += e.bytes


def _stage_totals(n_stages: int, stats: list[StepStats]) -> list[StageTotals]:
    totals = [StageTotals(k) for k in range(n_stages)]
    for s in stats:
        for row in s.stages:
            t = totals[row.stage]
            t.steps += 1
            t.wall_us += row.wall_us
            t.compute_us += row.compute_us
            t.send_us += row.send_us
            t.wait_us += row.wait_us
            t.idle_us += row.idle_us
            t.bytes_sent += row.bytes_sent
            t.bytes_received += row.bytes_received
    return totals


# ---------------------------------------------------------------- the text


def format_report(report: Report) -> str:
    """A fixed-width text report: per stage, per step, then the slowest stage and the bubble."""
    return "\n".join(_heading(report) + [""] + _stage_table(report) + [""] + _step_table(report)
                     + [""] + _summary(report))


def _heading(report: Report) -> list[str]:
    n = len({s.step for s in report.steps})
    kind = ("step" if report.include_predict else "training step") + ("s" if n != 1 else "")
    ms = report.microbatches
    m = str(ms[0]) if len(ms) == 1 else "/".join(map(str, ms))
    replicas = f", {report.replicas} replicas" if report.replicas > 1 else ""
    line = (f"pipeq trace: {report.schedule}, {report.n_stages} stages x {m} microbatches{replicas}; "
            f"{n} {kind}")
    if report.skipped:
        line += f" (skipped the first {len(report.skipped)}: step {_span_text(report.skipped)})"
    return [line]


def _stage_table(report: Report) -> list[str]:
    n = len({s.step for s in report.steps})
    over = f"{n} step{'s' if n != 1 else ''}"
    if report.replicas > 1:
        over += f" x {len({s.replica for s in report.steps})} replicas"
    lines = [f"per stage (ms per step, mean over {over}; MB moved = sent + received per step)",
             f"{'stage':>5} {'compute':>9} {'send':>8} {'wait':>8} {'idle':>8} {'compute%':>9} {'bubble%':>8} {'MB moved':>9}"]
    for t in report.stages:
        moved = t.per_step(t.bytes_sent + t.bytes_received) / 1e6
        lines.append(
            f"{t.stage:>5} {t.per_step(t.compute_us) / 1e3:>9.2f} {t.per_step(t.send_us) / 1e3:>8.2f} "
            f"{t.per_step(t.wait_us) / 1e3:>8.2f} {t.per_step(t.idle_us) / 1e3:>8.2f} "
            f"{100 * t.compute_fraction:>8.1f}% {100 * t.bubble:>7.1f}% {moved:>9.3f}")
    return lines


def _step_table(report: Report) -> list[str]:
    many = report.replicas > 1
    kinds = report.include_predict
    head = f"{'step':>6} " + (f"{'replica':>7} " if many else "") + (f"{'kind':>7} " if kinds else "")
    lines = ["per step", head + f"{'wall ms':>9} {'bubble%':>8} {'ideal%':>7} {'slowest':>7}"]
    steps = report.steps
    shown: list[StepStats | None] = list(steps) if len(steps) <= 20 else [*steps[:10], None, *steps[-5:]]
    for s in shown:
        if s is None:
            lines.append(f"{'...':>6}")
            continue
        row = f"{s.step:>6} " + (f"{s.replica:>7} " if many else "")
        row += f"{'train' if s.training else 'predict':>7} " if kinds else ""
        lines.append(row + f"{s.wall_us / 1e3:>9.2f} {100 * s.bubble:>7.1f}% {100 * s.ideal_bubble:>6.1f}% "
                           f"{s.slowest_stage:>7}")
    return lines


def _summary(report: Report) -> list[str]:
    slow = report.stages[report.slowest_stage]
    ms = report.microbatches
    m = str(ms[0]) if len(ms) == 1 else "/".join(map(str, ms))
    return [
        f"slowest stage: {slow.stage} ({100 * slow.compute_fraction:.0f}% of the step time computing)",
        f"bubble: measured {100 * report.bubble:.1f}% vs ideal {100 * report.ideal_bubble:.1f}% "
        f"((N-1)/(m+N-1) for N={report.n_stages}, m={m})",
    ]


# ---------------------------------------------------------------- the plan


def planned_trace(schedule: str | schedules.ScheduleFn, n_stages: int, n_microbatches: int,
                  backward_cost: int = 2, unit_us: float = 1000.0) -> dict[str, Any]:
    """A schedule's planned step (its dry run) as a trace dict in the traced runs' format.

    Forward and optimizer step take one time unit (``unit_us`` microseconds), backward
    ``backward_cost`` units, communication none. Draw it with :func:`plot_trace`, keep it with
    :func:`save_trace`.
    """
    if type(backward_cost) is not int or backward_cost < 1:
        raise ValueError(f"backward_cost is in forward time units, a positive integer; got {backward_cost!r}")
    if not unit_us > 0:
        raise ValueError(f"unit_us must be positive, got {unit_us!r}")
    lowered = schedules.build(schedule, n_stages, n_microbatches)
    timeline = schedules.dry_run(lowered, cost={Op.BACKWARD: backward_cost})
    name = schedules.schedule_name(schedule)
    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": f"plan: {name}"}}]
    for k in range(n_stages + 1):
        label = "driver" if k == n_stages else f"stage {k}"
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": k, "args": {"name": label}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": k, "args": {"sort_index": k}})
    end = 0
    for k, row in enumerate(timeline):
        for t, a in row:
            units = backward_cost if a.op is Op.BACKWARD else 1
            end = max(end, t + units)
            events.append(_planned_event(k, t, units, a, unit_us))
    events.append({"ph": "X", "name": "step 0", "cat": DRIVER_CAT, "pid": 0, "tid": n_stages, "ts": 0.0,
                   "dur": end * unit_us, "args": {"step": 0, "replica": 0, "training": True,
                                                  "microbatches": n_microbatches}})
    meta = {"pipeq_trace_version": TRACE_VERSION, "schedule": name, "n_stages": n_stages,
            "microbatches": n_microbatches, "replicas": 1, "clock_offsets_us": [0.0] * n_stages,
            "planned": True, "backward_cost": backward_cost, "unit_us": unit_us}
    return {"displayTimeUnit": "ms", "otherData": meta, "traceEvents": events}


def _planned_event(stage: int, t: int, units: int, a: schedules.Action, unit_us: float) -> dict[str, Any]:
    cat = {Op.FORWARD: "forward", Op.BACKWARD: "backward", Op.STEP: "step"}[a.op]
    return {"ph": "X", "name": str(a), "cat": cat, "pid": 0, "tid": stage, "ts": t * unit_us,
            "dur": units * unit_us,
            "args": {"stage": stage, "replica": 0, "step": 0, "microbatch": a.microbatch, "bytes": 0,
                     "op": a.op.value, "training": True}}


def save_trace(trace_dict: dict[str, Any], path: str | os.PathLike[str]) -> str:
    """Write a trace dict (e.g. :func:`planned_trace`'s) as JSON; return the path."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(trace_dict, f)
        f.write("\n")
    return os.fspath(path)


# ---------------------------------------------------------------- the picture

_STEP_COLOUR = "#3a3a3a"
_SEND_COLOUR = "#8a9bb0"  # slate: neutral, told apart from the optimizer step's dark grey
_OTHER_COLOUR = "#c8c8c8"


def plot_trace(trace: Trace | dict[str, Any], path: str | os.PathLike[str], steps: StepSelection = None,
               title: str | None = None) -> str:
    """Draw a stage x time picture of a trace (PNG); return the path.

    Stages are rows (stage 0 on top; with several replicas one group of rows per replica,
    "r1 s0"), time runs left to right in ms from the first event drawn. Forward boxes are light,
    backward boxes dark and hatched, both coloured by microbatch; the optimizer step is dark
    grey, sends thin slate boxes, unknown categories light grey; white is idle or waiting.
    ``steps``: None (default) the last training step, "all", a step number or numbers.
    """
    try:
        from matplotlib.figure import Figure  # pyplot-free: no display, the global backend is untouched
    except ImportError as exc:
        raise RuntimeError("pip install 'pipeq[plot]' (matplotlib) to draw pipeline timelines") from exc
    if isinstance(trace, dict):
        trace = trace_from_dict(trace)
    wanted = select_steps(trace, steps)
    events = [e for e in trace.events if wanted is None or e.step in wanted]
    if not events:
        raise ValueError(f"{trace.source} has no stage events in step {_span_text(sorted(wanted or []))}")
    replicas = sorted({e.replica for e in events})
    row_of = {(r, k): i * trace.n_stages + k for i, r in enumerate(replicas) for k in range(trace.n_stages)}
    t0 = min(e.start_us for e in events)
    span_ms = max(max(e.end_us for e in events) - t0, 1e-3) / 1e3
    n_rows = len(row_of)
    width_in = 13.0
    fig = Figure(figsize=(width_in, 1.4 + 0.55 * n_rows), dpi=120)
    ax = fig.add_subplot(1, 1, 1)
    px_per_ms = width_in * 120 * 0.8 / span_ms
    _draw_boxes(ax, events, row_of, t0, px_per_ms)
    _draw_step_marks(ax, trace, wanted, events, t0)
    labels = [f"stage {k}" if len(replicas) == 1 else f"r{r} s{k}" for (r, k) in row_of]
    ax.set_yticks(range(n_rows))
    ax.set_yticklabels(labels)
    ax.set_ylim(n_rows - 0.5, -0.5)  # stage 0 on top
    ax.set_xlim(0, span_ms * 1.01)
    ax.set_xlabel("time (ms from the first event drawn)")
    ax.grid(axis="x", color="#e6e6e6", linewidth=0.6)
    ax.set_axisbelow(True)
    ax.set_title(title or _default_title(trace, wanted, events), loc="left", fontsize=10)
    ax.legend(handles=_legend_handles(events), loc="upper left", bbox_to_anchor=(1.005, 1.0),
              frameon=False, fontsize=8)
    fig.savefig(path, format="png", dpi=120, bbox_inches="tight")
    return os.fspath(path)


def _colour(j: int) -> tuple[float, float, float]:
    from matplotlib import colormaps

    r, g, b, _ = colormaps["tab10"](j % 10 if j >= 0 else 7)
    return (r, g, b)


def _mix(colour: tuple[float, float, float], white: float) -> tuple[float, float, float]:
    """``colour`` moved ``white`` of the way to white (negative: towards black)."""
    target = 1.0 if white >= 0 else 0.0
    w = abs(white)
    return tuple(c + (target - c) * w for c in colour)  # type: ignore[return-value]


def _box_style(e: Event) -> tuple[str, Any, Any, str | None, float]:
    """(group, face, edge, hatch, height) of an event's box."""
    if e.cat == "forward":
        c = _colour(e.microbatch)
        return ("forward", _mix(c, 0.55), _mix(c, -0.15), None, 0.8)
    if e.cat == "backward":
        c = _colour(e.microbatch)
        return ("backward", c, _mix(c, -0.45), "//", 0.8)
    if e.cat == "step":
        return ("step", _STEP_COLOUR, _STEP_COLOUR, None, 0.8)
    if e.cat == SEND_CAT:
        return ("send", _SEND_COLOUR, _SEND_COLOUR, None, 0.22)
    if e.cat == WAIT_CAT:
        return ("wait", None, None, None, 0.0)
    return ("other", _OTHER_COLOUR, "#a0a0a0", None, 0.5)


def _draw_boxes(ax: Any, events: list[Event], row_of: dict[tuple[int, int], int], t0: float,
                px_per_ms: float) -> None:
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    groups: dict[tuple[str, str | None], tuple[list[Any], list[Any], list[Any]]] = {}
    for e in events:
        kind, face, edge, hatch, height = _box_style(e)
        if face is None:
            continue  # waits are left white, like idle time
        y = row_of[(e.replica, e.stage)]
        x, w = (e.start_us - t0) / 1e3, e.dur_us / 1e3
        top = y + 0.4 - height if kind == "send" else y - height / 2  # sends: a strip at the row's foot
        patches, faces, edges = groups.setdefault((kind, hatch), ([], [], []))
        patches.append(Rectangle((x, top), w, height))
        faces.append(face)
        edges.append(edge)
        _label(ax, e, kind, x, w, y, px_per_ms)
    for (kind, hatch), (patches, faces, edges) in groups.items():
        ax.add_collection(PatchCollection(patches, facecolors=faces, edgecolors=edges, linewidths=0.6,
                                          hatch=hatch, zorder=2))


def _label(ax: Any, e: Event, kind: str, x: float, w: float, y: int, px_per_ms: float) -> None:
    """Write "F3" / "B3" inside a forward or backward box that is wide enough."""
    if kind not in ("forward", "backward", "step"):
        return
    text = "ST" if kind == "step" else f"{'F' if kind == 'forward' else 'B'}{e.microbatch}"
    if w * px_per_ms < 7.5 * len(text) + 4:
        return
    colour = "black" if kind == "forward" else "white"
    ax.text(x + w / 2, y, text, ha="center", va="center", fontsize=7, color=colour, zorder=3,
            fontweight="bold" if kind == "backward" else "normal", clip_on=True)


def _draw_step_marks(ax: Any, trace: Trace, wanted: set[int] | None, events: list[Event], t0: float) -> None:
    """A dotted line where each drawn step starts, when more than one is drawn."""
    starts: dict[int, float] = {}
    for e in events:
        starts[e.step] = min(starts.get(e.step, e.start_us), e.start_us)
    if len(starts) < 2:
        return
    for (_, step), (start, _dur) in trace.driver.items():
        if step in starts:
            starts[step] = min(starts[step], max(start, t0))
    label = len(starts) <= 30
    for step, start in sorted(starts.items()):
        x = (start - t0) / 1e3
        ax.axvline(x, color="#9a9a9a", linestyle=":", linewidth=0.8, zorder=1)
        if label:
            ax.annotate(f"step {step}", (x, 0), xycoords=("data", "axes fraction"), xytext=(2, 2),
                        textcoords="offset points", fontsize=7, color="#606060")


def _legend_handles(events: list[Event]) -> list[Any]:
    from matplotlib.patches import Patch

    c = _colour(0)
    handles = [Patch(facecolor=_mix(c, 0.55), edgecolor=_mix(c, -0.15), label="forward"),
               Patch(facecolor=c, edgecolor=_mix(c, -0.45), hatch="//", label="backward"),
               Patch(facecolor=_STEP_COLOUR, label="optimizer step"),
               Patch(facecolor=_SEND_COLOUR, label="send")]
    cats = {e.cat for e in events}
    if cats - set(COMPUTE_CATS) - {SEND_CAT, WAIT_CAT}:
        handles.append(Patch(facecolor=_OTHER_COLOUR, edgecolor="#a0a0a0", label="other"))
    handles.append(Patch(facecolor="white", edgecolor="#bbbbbb", label="idle / waiting"))
    return handles


def _default_title(trace: Trace, wanted: set[int] | None, events: list[Event]) -> str:
    meta = trace.meta
    head = "plan" if meta.get("planned") else "pipeq trace"
    what = f"{head}: {meta.get('schedule', '?')}, {trace.n_stages} stages x {meta.get('microbatches', '?')} microbatches"
    if meta.get("planned"):
        return what + f" (backward = {meta.get('backward_cost', '?')} x forward)"
    drawn = sorted({e.step for e in events})
    return what + f", step {_span_text(drawn)}" if wanted is not None else what + f", steps {_span_text(drawn)}"
