"""The critical path of a traced step, slot by slot: where each slot's time went.

A step ends when its last action ends; walking back from it, each compute action (F, B, I, W, the
optimizer step) was released either by the previous compute action of its own process or by a
message from another process, whichever came later (a message counts from the moment its sender's
send returned). That chain is the critical path, and each of its links is a *slot*: from the end
of the action before to the end of this one. A slot's time is split into parts, from the trace's
own timestamps:

    compute    the action's compute span (with ``inner`` spans: only the time inside them, the
               stage's own work, at most its nominal cost)
    late       (``inner`` only) the inner spans' time beyond their nominal cost (a sleep's overshoot)
    autograd   (``inner`` only) the action's span outside its inner spans: the executor's and the
               autograd engine's entry and exit
    interp     on the path's process, time in no recorded span: the event loop's and the
               interpreter's bookkeeping between actions
    send       send spans on the path (encode and the send's system calls; ``codec`` moves the
               encoding out)
    sent-wait  the critical message was sent, and its receiver had not begun to wait for it yet
    wake       the receiver waited before the message was sent: from the send's end to the wait's
               end (the wake-up, the read and the decoding; ``codec`` moves the decoding out)
    recv       waits on the path whose message was sent before they began (read and decode, or a
               queue's pop)
    blocked    waits on the path for a message sent later that this action does not take
    codec      (with ``codec``) the encoding and decoding of the path's messages, estimated per
               message size by the caller
    start      (a step's first slot) from the driver's step start to the first action: the
               command's delivery and the batch's set-up
    other      another compute span inside a gap, and what the clocks leave unaccounted

The first slot of a step counts from the driver's step start, or from the end of its process's
last action of the step before when that came later (the driver's step ends with the last
stage's loss; the other stages' last actions overlap the next step): ``start``, the command's
delivery and the batch's set-up. On one host every process reads the same monotonic clock: the path is
read on the stages' own clocks (``host_clock``), free of the alignment's estimate (up to half a
control round trip, tens of microseconds), using the file's ``clock_samples``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

from pipeq import schedules
from pipeq.trace.format import COMPUTE_CATS, SEND_CAT, WAIT_CAT, ClockSample, Event, Trace, _offset_at

__all__ = ["PARTS", "Slot", "CriticalPath", "critical_path", "format_critical", "host_clock", "stage_clock"]

PARTS = ("start", "compute", "late", "autograd", "interp", "send", "sent-wait", "wake", "recv", "blocked", "codec",
         "other")


class Inner(Protocol):
    """The stages' own compute spans on the trace's time axis (a benchmark's stages log them)."""

    def within(self, stage: int, t0: float, t1: float) -> Sequence[tuple[float, float, float]]:
        """Stage ``stage``'s spans starting in [t0, t1): (start us, end us, nominal us) each."""
#: message size (bytes) -> (encode us, decode us)
Codec = Callable[[int], tuple[float, float]]


@dataclass
class Slot:
    """One link of the critical path: ``action`` (op and microbatch) on ``stage`` (of ``process``),
    released by the previous compute action of its process (``edge`` "local"), by a message from
    another process ("msg"), or by the step's start ("start")."""

    process: int
    stage: int
    op: str
    microbatch: int
    edge: str
    slot_us: float
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return f"{self.op} {self.edge}"


@dataclass
class CriticalPath:
    """Per analysed step: its slots in path order, its wall time and the start and end gaps."""

    schedule: str
    n_stages: int
    steps: dict[int, list[Slot]]
    wall_us: dict[int, float]
    start_us: dict[int, float]  # driver's step start -> the path's first action's start
    end_us: dict[int, float]  # the path's last action's end -> the driver's step end
    host_clock: bool


# ---------------------------------------------------------------- clocks


def stage_clock(meta: Mapping[str, Any], stage: int) -> Callable[[float], float] | None:
    """Replica 0's stage ``stage``'s trace times (``ts``, us) mapped back onto its own clock, in
    us from the file's ``clock_origin_ns``; None when the file keeps no ``clock_samples``."""
    samples, origin = meta.get("clock_samples"), meta.get("clock_origin_ns")
    if not isinstance(samples, list) or origin is None or stage >= len(samples):
        return None
    mine = [ClockSample(int(a), float(o), int(r)) for a, o, r in samples[stage]]
    if not mine:
        return lambda ts: ts
    first = mine[0].offset_ns

    def back(ts: float) -> float:  # format's to_driver(t) = t - offset_at(t - first), solved for t
        d = ts * 1e3 + origin
        t = d + first
        for _ in range(3):
            t = d + _offset_at(mine, t - first)
        return (t - origin) / 1e3

    return back


def host_clock(trace: Trace) -> Trace | None:
    """``trace`` with replica 0's stage events on the stages' own clock (one host: one clock);
    None when the file has no ``clock_samples`` (an older trace, a plan) or names several hosts."""
    if len(set(trace.meta.get("hosts") or ())) > 1:
        return None  # several hosts, several clocks: the aligned times are the best there are
    maps = [stage_clock(trace.meta, k) for k in range(trace.n_stages)]
    if any(m is None for m in maps):
        return None
    events = []
    for e in trace.events:
        if e.replica != 0:
            continue
        back = maps[e.stage]
        t0, t1 = back(e.start_us), back(e.end_us)  # type: ignore[misc]
        events.append(replace(e, start_us=t0, dur_us=max(0.0, t1 - t0)))
    events.sort(key=lambda e: (e.start_us, e.stage))
    return replace(trace, events=events)


# ---------------------------------------------------------------- the path


def _processes(trace: Trace) -> list[int]:
    """Each stage's process (a schedule of several stages per process places them; else one each)."""
    n = trace.n_stages
    try:
        held = schedules.process_stages(str(trace.meta.get("schedule")), n)
    except Exception:  # a schedule this pipeq does not know (a function's label...): one stage each
        return list(range(n))
    proc = list(range(n))
    for p, stages in enumerate(held):
        for k in stages:
            proc[k] = p
    return proc


class _Step:
    """One step's events of replica 0, indexed for the walk."""

    def __init__(self, events: list[Event], proc: list[int], n: int, tails: dict[int, float]) -> None:
        self.proc, self.n = proc, n
        self.tails = tails  # per process, the end of its last compute action of the step before
        self.timeline: dict[int, list[Event]] = {}
        self.compute: dict[int, list[Event]] = {}
        self.msgs: dict[tuple[str, int, int], Event] = {}
        for e in events:
            p = proc[e.stage]
            if e.cat in COMPUTE_CATS:
                comp = self.compute.setdefault(p, [])
                if e.op == "STEP" and comp and comp[-1].op == "STEP" and comp[-1].start_us == e.start_us:
                    continue  # one optimizer step of a process's chunks, one row per chunk
                comp.append(e)
            if e.cat in (SEND_CAT, WAIT_CAT):
                self.msgs[(e.op, e.stage, e.microbatch)] = e
            self.timeline.setdefault(p, []).append(e)

    def message(self, x: Event) -> tuple[Event, Event] | None:
        """The (send, wait) of the message compute action ``x`` takes from another process, if any."""
        k, j = x.stage, x.microbatch
        if x.op == "F" and k > 0 and self.proc[k - 1] != self.proc[k]:
            send, wait = self.msgs.get(("SEND_ACT", k - 1, j)), self.msgs.get(("WAIT_ACT", k, j))
        elif x.op in ("B", "I") and k < self.n - 1 and self.proc[k + 1] != self.proc[k]:
            send, wait = self.msgs.get(("SEND_GRAD", k + 1, j)), self.msgs.get(("WAIT_GRAD", k, j))
        else:
            return None
        return (send, wait) if send is not None and wait is not None else None

    def sent_end(self, wait: Event) -> float | None:
        """When the message ``wait`` waited for was sent (its send's end), if it is in the trace."""
        k, j = wait.stage, wait.microbatch
        send = self.msgs.get(("SEND_ACT", k - 1, j) if wait.op == "WAIT_ACT" else ("SEND_GRAD", k + 1, j))
        return send.end_us if send is not None else None

    def before(self, p: int, t: float) -> Event | None:
        """Process ``p``'s last compute action that ended by ``t``."""
        best = None
        for e in self.compute.get(p, []):
            if e.end_us <= t + 1e-3:
                best = e
        return best

    def gap(self, p: int, t0: float, t1: float, parts: dict[str, float]) -> None:
        """Add process ``p``'s time from ``t0`` to ``t1``, by what its spans say, to ``parts``."""
        covered = 0.0
        for e in self.timeline.get(p, []):
            a, b = max(t0, e.start_us), min(t1, e.end_us)
            if b <= a:
                continue
            covered += b - a
            if e.cat == SEND_CAT:
                _add(parts, "send", b - a)
            elif e.cat == WAIT_CAT:
                sent = self.sent_end(e)
                cut = min(max(a, sent if sent is not None else a), b)
                _add(parts, "blocked", cut - a)
                _add(parts, "recv", b - cut)
            else:
                _add(parts, "other", b - a)
        _add(parts, "interp", max(0.0, (t1 - t0) - covered))


def _add(parts: dict[str, float], key: str, us: float) -> None:
    if us > 0:
        parts[key] = parts.get(key, 0.0) + us


def _compute_parts(x: Event, inner: Inner | None, parts: dict[str, float]) -> None:
    spans = inner.within(x.stage, x.start_us, x.end_us) if inner is not None else None
    if spans is None:
        _add(parts, "compute", x.dur_us)
        return
    measured = sum(max(0.0, min(b, x.end_us) - max(a, x.start_us)) for a, b, _ in spans)
    nominal = sum(n for _, _, n in spans)
    _add(parts, "compute", min(measured, nominal))
    _add(parts, "late", measured - min(measured, nominal))
    _add(parts, "autograd", x.dur_us - measured)


def _codec_parts(parts: dict[str, float], codec: Codec, sent: Sequence[int], received: Sequence[int]) -> None:
    """Move the estimated encoding (of ``sent`` messages, by size) out of ``send`` and the decoding
    (of ``received``) out of ``wake``/``recv`` into ``codec``, never more than they hold."""
    moved = _take(parts, ("send",), sum(codec(b)[0] for b in sent))
    moved += _take(parts, ("wake", "recv"), sum(codec(b)[1] for b in received))
    _add(parts, "codec", moved)


def _take(parts: dict[str, float], keys: Sequence[str], us: float) -> float:
    """Up to ``us`` taken out of ``parts[keys]``, in order (a part emptied is dropped); how much."""
    taken = 0.0
    for key in keys:
        d = min(us - taken, parts.get(key, 0.0))
        if d > 0:
            parts[key] -= d
            taken += d
            if parts[key] <= 0:
                del parts[key]
    return taken


def _begin(st: _Step, p: int, pred: Event | None, step_start: float) -> float:
    """Where a slot after ``pred`` on process ``p`` begins: its end; before the process's first
    action of the step, the step's start, or the end of the process's last action of the step
    before when that came later (the steps overlap: it was still busy)."""
    if pred is not None:
        return pred.end_us
    return max(step_start, st.tails.get(p, step_start))


def _gap_or_start(st: _Step, p: int, pred: Event | None, t0: float, t1: float, parts: dict[str, float]) -> None:
    """A gap after ``pred`` on process ``p``; before the process's first action: ``start``."""
    if pred is None:
        _add(parts, "start", t1 - t0)
    else:
        st.gap(p, t0, t1, parts)


def _walk(st: _Step, step_start: float, inner: Inner | None, codec: Codec | None) -> list[Slot]:
    """The critical path of one step, last slot first, then reversed."""
    ends = [e for comp in st.compute.values() for e in comp]
    if not ends:
        return []
    x: Event | None = max(ends, key=lambda e: e.end_us)
    slots: list[Slot] = []
    while x is not None:
        p = st.proc[x.stage]
        comp = st.compute[p]
        i = comp.index(x)
        prev = comp[i - 1] if i > 0 else None
        msg = st.message(x)
        parts: dict[str, float] = {}
        sent, received = [], []
        if msg is not None and (prev is None or msg[0].end_us > prev.end_us):
            send, wait = msg
            q = st.proc[send.stage]
            pred = st.before(q, send.start_us)
            begin = _begin(st, q, pred, step_start)
            _gap_or_start(st, q, pred, begin, send.start_us, parts)
            _add(parts, "send", send.dur_us)
            sent.append(send.bytes)
            received.append(wait.bytes)
            if wait.start_us >= send.end_us:
                _add(parts, "sent-wait", wait.start_us - send.end_us)
                _add(parts, "recv", wait.dur_us)
            else:
                _add(parts, "wake", wait.end_us - send.end_us)
            st.gap(p, max(wait.end_us, send.end_us), x.start_us, parts)
            edge = "msg"
        else:
            pred = prev
            begin = _begin(st, p, pred, step_start)
            _gap_or_start(st, p, pred, begin, x.start_us, parts)
            edge = "local" if pred is not None else "start"
        _compute_parts(x, inner, parts)
        if codec is not None:
            _codec_parts(parts, codec, sent, received)
        slot_us = x.end_us - begin
        rest = slot_us - sum(parts.values())
        if abs(rest) > 0.05:
            parts["other"] = parts.get("other", 0.0) + rest
        slots.append(Slot(p, x.stage, x.op, x.microbatch, edge, slot_us, parts))
        x = pred
    slots.reverse()
    return slots


def critical_path(trace: Trace, skip_first: int = 1, inner: Inner | None = None, codec: Codec | None = None,
                  use_host_clock: bool = True, steps: Iterable[int] | None = None) -> CriticalPath:
    """Every training step's critical path (replica 0), after the first ``skip_first`` steps (or
    the ``steps`` named).
    ``inner``: the stages' own compute spans (see the module); ``codec``: a message size's
    encoding and decoding cost in us; ``use_host_clock``: read the path on the stages' own clock
    (one host; falls back to the file's aligned times when it keeps no clock samples)."""
    on_host = host_clock(trace) if use_host_clock else None
    tr = on_host if on_host is not None else trace
    proc = _processes(tr)
    by_step: dict[int, list[Event]] = {}
    for e in tr.events:
        if e.replica == 0 and e.training:
            by_step.setdefault(e.step, []).append(e)
    keys = sorted(s for s in by_step if tr.is_training((0, s)))
    keys = [s for s in keys if s in set(steps)] if steps is not None else keys[skip_first:]
    out = CriticalPath(str(tr.meta.get("schedule")), tr.n_stages, {}, {}, {}, {}, on_host is not None)
    for s in keys:
        events = by_step[s]
        tails: dict[int, float] = {}
        for e in by_step.get(s - 1, ()):
            if e.cat in COMPUTE_CATS:
                tails[proc[e.stage]] = max(tails.get(proc[e.stage], e.end_us), e.end_us)
        span = tr.driver.get((0, s))
        first = min(e.start_us for e in events)
        start = span[0] if span is not None else first
        slots = _walk(_Step(events, proc, tr.n_stages, tails), start, inner, codec)
        if not slots:
            continue
        out.steps[s] = slots
        last = max(e.end_us for e in events if e.cat in COMPUTE_CATS)
        out.wall_us[s] = span[1] if span is not None else last - first
        out.start_us[s] = slots[0].parts.get("start", 0.0)
        out.end_us[s] = (span[0] + span[1] - last) if span is not None else 0.0
    return out


# ---------------------------------------------------------------- the table


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def format_critical(cp: CriticalPath, per_slot: bool = False) -> str:
    """The table: per kind of slot (op and what released it), the median us of each part per slot;
    the median over every slot; the mean per step of each part's sum over the path (these add up
    to the path's length). ``per_slot``: also every slot of the last step, in path order."""
    if not cp.steps:
        return "no training step to analyse (did the run trace any after the skipped ones?)"
    used = [p for p in PARTS if any(sl.parts.get(p) for slots in cp.steps.values() for sl in slots)]
    n_steps = len(cp.steps)
    kinds: dict[str, list[Slot]] = {}
    for slots in cp.steps.values():
        for sl in slots:
            kinds.setdefault(sl.kind, []).append(sl)
    head = ["slot", "n/step", "slot us", *used]
    rows = []
    for kind in sorted(kinds, key=lambda k: -len(kinds[k])):
        sls = kinds[kind]
        rows.append([kind, f"{len(sls) / n_steps:.1f}", f"{_median([s.slot_us for s in sls]):.0f}",
                     *(f"{_median([s.parts.get(p, 0.0) for s in sls]):.0f}" for p in used)])
    every = [sl for slots in cp.steps.values() for sl in slots]
    rows.append(["all (median)", f"{len(every) / n_steps:.1f}", f"{_median([s.slot_us for s in every]):.0f}",
                 *(f"{_median([s.parts.get(p, 0.0) for s in every]):.0f}" for p in used)])
    rows.append(["all (mean)", "", f"{statistics.fmean(s.slot_us for s in every):.0f}",
                 *(f"{statistics.fmean(s.parts.get(p, 0.0) for s in every):.0f}" for p in used)])
    sums = {p: statistics.fmean(sum(s.parts.get(p, 0.0) for s in slots) for slots in cp.steps.values()) for p in used}
    path = statistics.fmean(sum(s.slot_us for s in slots) for slots in cp.steps.values())
    rows.append(["sum per step", "", f"{path:.0f}", *(f"{sums[p]:.0f}" for p in used)])
    lines = [f"critical path: {cp.schedule}, {cp.n_stages} stages, {n_steps} steps "
             f"({'the stages own clock, one host' if cp.host_clock else 'clocks aligned to the driver'}); "
             "us", _grid(head, rows),
             f"step wall {_median(list(cp.wall_us.values())) / 1e3:.2f} ms (median); path {path / 1e3:.2f} ms; "
             f"before the path {statistics.fmean(cp.start_us.values()):.0f} us, after it "
             f"{statistics.fmean(cp.end_us.values()):.0f} us (means)"]
    if per_slot:
        s = max(cp.steps)
        lines.append(f"step {s}, slot by slot (us)")
        rows = [[str(i), str(sl.process), str(sl.stage), sl.op + (str(sl.microbatch) if sl.microbatch >= 0 else ""),
                 sl.edge, f"{sl.slot_us:.0f}", *(f"{sl.parts.get(p, 0.0):.0f}" for p in used)]
                for i, sl in enumerate(cp.steps[s])]
        lines.append(_grid(["#", "proc", "stage", "action", "edge", "slot", *used], rows))
    return "\n".join(lines)


def _grid(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(("{:<%d}" if i == 0 else "{:>%d}") % w for i, w in enumerate(widths))
    return "\n".join(fmt.format(*r) for r in [head, *rows])
