"""Analysing a pipeq trace: where each stage's time went and how big the pipeline bubble was.

A traced run (``PipelineRunner(..., trace="run.json")`` or ``pipeq launch --trace run.json``)
writes one Chrome trace-event file (its format, and reading it back: :mod:`pipeq.trace`). This
module turns it into numbers and text::

    trace = load_trace("run.json")                        # pipeq.trace
    print(format_report(analyze(trace, skip_first=1)))   # or: pipeq report run.json --skip-first 1

(pictures of it: :mod:`pipeq.trace.plot`). Compute is the ``forward``, ``backward`` and ``step``
events, then come ``send`` and ``wait`` (blocked on an input); other categories are left out of
the numbers. A step's wall time runs from its first stage event's start to its last one's end
(the driver's ``"step S"`` spans are used for steps without stage events).

Bubble: the share of a step's wall time a stage does not compute, averaged over the stages. The
ideal is the traced schedule's own: its dry run's at F = I = W = 1 on every stage (B = 2),
free communication and no optimizer step ((N-1)/(m+N-1) for fill-drain and 1F1B; a schedule
this module cannot rebuild, your own function, gets that too). The report ends with the
advice of :mod:`pipeq.trace.advice`: what 1F1B, ZB-H1 and ZBV would take with the measured costs.

Throughput: training steps per second in the steady state (between the ends of the first and
the last step covered), beside the schedule's bound (:mod:`pipeq.schedules.bounds`) with each stage's
measured mean forward, backward and optimizer-step times: the streamed bound for a
``runner.stream`` run (the driver sent a step before the previous one's loss was back), the
``step``-loop bound otherwise. Nothing here starts a process or opens a socket.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Iterable, Union

from pipeq import schedules
from pipeq.schedules.bounds import stream_bound
from pipeq.schedules.plan import process_stages
from pipeq.errors import ScheduleError
from pipeq.schedules import Op
from pipeq.schedules.dryrun import step_bubble
from pipeq.trace.advice import advice_line
from pipeq.trace.format import (BACKWARD_CAT, COMPUTE_CATS, FORWARD_CAT, PARALLEL_CAT, SEND_CAT, STEP_CAT, WAIT_CAT,
                                Event, Trace)

StepSelection = Union[int, str, Iterable[int], None]


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
    parallel_us: float = 0.0  # its parallel layers: FSDP's gathers and frees, the reductions

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
    ideal_bubble: float  # the schedule's dry run's (see ideal_bubble)
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
    parallel_us: float = 0.0

    @property
    def compute_fraction(self) -> float:
        return self.compute_us / self.wall_us if self.wall_us > 0 else 0.0

    @property
    def bubble(self) -> float:
        return _bubble(self.compute_us, self.wall_us)

    def per_step(self, total: float) -> float:
        return total / self.steps if self.steps else 0.0


@dataclass
class Throughput:
    """Training steps per second over the steps covered, and what the schedule allows."""

    steps_per_s: float
    streamed: bool  # a runner.stream run: steps were sent before the previous loss was back
    bound_steps_per_s: float | None  # None: a schedule this module cannot rebuild (your own function)
    costs_ms: list[tuple[float, float, float]]  # per stage: mean forward, backward, step (ms)


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
    ideal_bubble: float  # mean over steps of the schedule's ideal (see ideal_bubble)
    slowest_stage: int  # the stage with the most compute over the run
    throughput: Throughput | None = None  # None: fewer than two training steps covered
    advice: str | None = None  # which schedule the measured costs favour (pipeq.trace.advice)

    @property
    def microbatches(self) -> list[int]:
        """The distinct microbatch counts of the steps analysed."""
        return sorted({s.microbatches for s in self.steps})


def _bubble(compute_us: float, wall_us: float) -> float:
    return min(1.0, max(0.0, 1.0 - compute_us / wall_us)) if wall_us > 0 else 0.0


def ideal_bubble(n_stages: int, n_microbatches: int, schedule: Any = None) -> float:
    """The bubble of ``schedule``'s dry run at F = I = W = 1 (B = 2) on ``n_stages`` model stages,
    free communication, up to the STEP: the mean over the processes of their idle share (a
    process's stages share its time), as :func:`analyze` measures it. Without a schedule (or one that cannot be rebuilt at
    these counts): (N-1)/(m+N-1), fill-drain's and 1F1B's."""
    if schedule is not None and n_microbatches > 0:
        try:
            return _planned_bubble(schedule, n_stages, n_microbatches)
        except (ScheduleError, ValueError):
            pass
    return (n_stages - 1) / (n_microbatches + n_stages - 1) if n_microbatches > 0 else 0.0


@functools.lru_cache(maxsize=64)
def _planned_bubble(schedule: Any, n_stages: int, m: int) -> float:
    """:func:`ideal_bubble` from the dry run (cached: every step of a run asks it)."""
    unit = {Op.FORWARD: 1, Op.INPUT_GRAD: 1, Op.WEIGHT_GRAD: 1, Op.BACKWARD: 2, Op.STEP: 0}
    lowered = schedules.build(schedule, n_stages, m)
    where = process_stages(schedule, n_stages)
    timeline = schedules.dry_run(lowered, cost=unit, stages=where)
    return step_bubble(timeline, cost=unit, stages=where)[1]


def _process_groups(trace: Trace) -> list[list[int]]:
    """The stages each process of the traced run held (one each, unless the schedule the trace
    names holds several per process)."""
    schedule = schedule_of(str(trace.meta.get("schedule", "")))
    if schedule is not None and schedule.stages_per_process > 1:
        try:
            return process_stages(schedule, trace.n_stages)
        except (ScheduleError, ValueError):
            pass
    return [[k] for k in range(trace.n_stages)]


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
        raise ValueError(f"{trace.source} has no step {span_text(sorted(wanted))}; its steps are "
                         f"{span_text(present)}")
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


def span_text(values: list[int]) -> str:
    """Step numbers as text: "3-7" for a run, else "1, 4, 9" (at most 8, then "..."), "(none)"."""
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
        throughput=_throughput(trace, [k for k in keys if k[0] == 0 and trace.is_training(k)], by_key),
        advice=advice_line(trace),
    )


def _throughput(trace: Trace, keys: list[tuple[int, int]], by_key: dict[tuple[int, int], list[Event]]
                ) -> Throughput | None:
    """Replica 0's training steps per second, and the schedule's bound with their measured costs."""
    ends = sorted(max(e.end_us for e in by_key[k]) for k in keys if by_key.get(k))
    if len(ends) < 2 or ends[-1] <= ends[0]:
        return None
    rate = (len(ends) - 1) / ((ends[-1] - ends[0]) / 1e6)
    spans = sorted((trace.driver[k] for k in keys if k in trace.driver))
    streamed = any(later[0] < earlier[0] + earlier[1] for earlier, later in zip(spans, spans[1:]))
    costs = []
    split: list[dict[Op, float]] = []  # a split backward's I and W, each its own cost
    for k in range(trace.n_stages):
        mean = []
        for cat in (FORWARD_CAT, BACKWARD_CAT, STEP_CAT):
            durs = [e.dur_us for key in keys for e in by_key.get(key, []) if e.stage == k and e.cat == cat]
            mean.append(sum(durs) / len(durs) / 1e3 if durs else 0.0)
        costs.append(tuple(mean))
        split.append({})
        for op in (Op.INPUT_GRAD, Op.WEIGHT_GRAD):
            durs = [e.dur_us for key in keys for e in by_key.get(key, []) if e.stage == k and e.op == op.value]
            if durs:
                split[k][op] = sum(durs) / len(durs) / 1e3
    bound = None
    schedule = schedule_of(str(trace.meta.get("schedule", "")))
    m = trace.meta.get("microbatches")
    if schedule is not None and type(m) is int and m > 0:
        per_stage = [{Op.FORWARD: f, Op.BACKWARD: b, Op.STEP: st, **iw} for (f, b, st), iw in zip(costs, split)]
        try:
            seconds = stream_bound(schedule, trace.n_stages, m, per_stage)
            per_batch_ms = seconds.stream if streamed else seconds.step
            bound = 1e3 / per_batch_ms if per_batch_ms > 0 else None
        except (ScheduleError, ValueError):
            bound = None
    return Throughput(rate, streamed, bound, costs)  # type: ignore[arg-type]


def schedule_of(label: str) -> Any:
    """The schedule a trace's label names (None for your own schedule functions)."""
    return schedules.from_label(label)


def _step_wall(trace: Trace, key: tuple[int, int], events: list[Event]) -> float:
    """First start to last end of the step's stage events (waits for input excepted): the
    step's own period.

    Not the driver's span: the driver sends step s+1 as soon as the last stage reports step s's
    loss, while the first stages are still in step s's last backwards, so its span would count
    that tail twice. The driver's span is the fallback for a step with no stage events.
    """
    # compute and sends: a stage idling into the step (waiting for its first input) is not its start
    busy = [e for e in events if e.cat in (*COMPUTE_CATS, SEND_CAT)]
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
        elif e.cat == PARALLEL_CAT:
            row.parallel_us += e.dur_us
    _count_received(rows, events)
    for row in rows:
        row.idle_us = max(0.0, wall - row.compute_us - row.send_us - row.wait_us - row.parallel_us)
    m = len({e.microbatch for e in events if e.stage == 0 and e.cat == FORWARD_CAT})
    if m == 0:  # stage 0 untraced: the run's setting, else the most forwards any stage ran
        m = trace.meta.get("microbatches") or max(
            (len({e.microbatch for e in events if e.stage == k and e.cat == FORWARD_CAT})
             for k in range(trace.n_stages)), default=0)
    groups = _process_groups(trace)  # a process's stages share its time (virtual stages)
    return StepStats(
        replica=key[0], step=key[1], training=trace.is_training(key), wall_us=wall,
        microbatches=int(m), stages=rows,
        bubble=sum(_bubble(sum(rows[k].compute_us for k in g), wall) for g in groups) / len(groups),
        ideal_bubble=ideal_bubble(trace.n_stages, int(m), schedule_of(str(trace.meta.get("schedule", "")))),
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
            t.parallel_us += row.parallel_us
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
        line += f" (skipped the first {len(report.skipped)}: step {span_text(report.skipped)})"
    return [line]


def _stage_table(report: Report) -> list[str]:
    n = len({s.step for s in report.steps})
    over = f"{n} step{'s' if n != 1 else ''}"
    if report.replicas > 1:
        over += f" x {len({s.replica for s in report.steps})} replicas"
    parallel = any(t.parallel_us for t in report.stages)  # (a column only for a run with parallel layers)
    lines = [f"per stage (ms per step, mean over {over}; MB moved = sent + received per step"
             + ("; parallel: gathers, frees and reductions)" if parallel else ")"),
             f"{'stage':>5} {'compute':>9} {'send':>8} {'wait':>8} " + (f"{'parallel':>9} " if parallel else "")
             + f"{'idle':>8} {'compute%':>9} {'bubble%':>8} {'MB moved':>9}"]
    for t in report.stages:
        moved = t.per_step(t.bytes_sent + t.bytes_received) / 1e6
        lines.append(
            f"{t.stage:>5} {t.per_step(t.compute_us) / 1e3:>9.2f} {t.per_step(t.send_us) / 1e3:>8.2f} "
            f"{t.per_step(t.wait_us) / 1e3:>8.2f} " + (f"{t.per_step(t.parallel_us) / 1e3:>9.2f} " if parallel else "")
            + f"{t.per_step(t.idle_us) / 1e3:>8.2f} "
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
    known = schedule_of(report.schedule) is not None
    how = f"{report.schedule}'s dry run at F=I=W=1" if known else "(N-1)/(m+N-1)"
    policy = schedule_of(report.schedule)
    v = policy.stages_per_process if policy is not None else 1
    shape = f"N={report.n_stages}" if v == 1 else f"{report.n_stages // v} processes x {v} stages"
    return [
        f"slowest stage: {slow.stage} ({100 * slow.compute_fraction:.0f}% of the step time computing)",
        f"bubble: measured {100 * report.bubble:.1f}% vs ideal {100 * report.ideal_bubble:.1f}% "
        f"({how} for {shape}, m={m})",
    ] + _throughput_lines(report.throughput) + ([report.advice] if report.advice else [])


def _throughput_lines(t: Throughput | None) -> list[str]:
    if t is None:
        return []
    how = "streamed" if t.streamed else "step loop"
    line = f"throughput: {t.steps_per_s:.2f} steps/s ({how})"
    if t.bound_steps_per_s is not None:
        line += (f"; the schedule's {how} bound with these costs: {t.bound_steps_per_s:.2f} steps/s "
                 f"({100 * t.steps_per_s / t.bound_steps_per_s:.0f}% of it)")
    costs = ", ".join(f"{f:.2f}/{b:.2f}/{st:.2f}" for f, b, st in t.costs_ms)
    return [line, f"  mean forward/backward/step ms per stage: {costs}"]

