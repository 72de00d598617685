"""A traced run's measured costs, and which schedule they favour (``pipeq report``'s advice line).

:func:`measured_costs` reads each model stage's mean forward, input-gradient, weight-gradient and
backward times (ms) from a trace's training steps (the first left out when there are more, it
includes lazy set-up), and a hop: the mean time of a send (an estimate of one message's cost).
:func:`choice_of` hands them to :func:`pipeq.schedules.choose.choose` at the run's process count
(a schedule of v stages per process: each process's stages summed), :func:`advice_line` says
in one line what 1F1B, ZB-H1 and ZBV would take with them. Nothing here starts a process.
"""

from __future__ import annotations

from typing import Any

from pipeq import schedules
from pipeq.errors import ScheduleError
from pipeq.schedules import Op
from pipeq.schedules.choose import Choice, choose
from pipeq.schedules.dryrun import stage_costs
from pipeq.schedules.plan import process_stages
from pipeq.trace.format import SEND_CAT, Trace

__all__ = ["measured_costs", "choice_of", "advice_line"]

_OPS = {op.value: op for op in (Op.FORWARD, Op.BACKWARD, Op.INPUT_GRAD, Op.WEIGHT_GRAD)}  # an event's op -> Op


def measured_costs(trace: Trace) -> tuple[list[dict[Op, float]], float]:
    """Per model stage, the mean F, B, I and W times it traced (ms; an op it never ran is left
    out: B = I + W, or I = W = B / 2, see :func:`pipeq.schedules.dryrun.stage_costs`), and the
    mean send time (ms) as the hop."""
    steps = sorted({e.step for e in trace.events if e.training})
    keep = set(steps[1:] if len(steps) > 1 else steps)
    sums: list[dict[Op, list[float]]] = [{} for _ in range(trace.n_stages)]
    sends: list[float] = []
    for e in trace.events:
        if e.step not in keep or not e.training:
            continue
        if e.op in _OPS:
            sums[e.stage].setdefault(_OPS[e.op], []).append(e.dur_us / 1e3)
        elif e.cat == SEND_CAT and e.op in ("SEND_ACT", "SEND_GRAD"):
            sends.append(e.dur_us / 1e3)
    costs = [{op: sum(v) / len(v) for op, v in per.items()} for per in sums]
    if not any(costs):
        raise ValueError(f"{trace.source} has no traced forward or backward to take costs from")
    for c in costs:  # a stage without a forward event: its neighbours' mean is the best guess
        c.setdefault(Op.FORWARD, 0.0)
    return costs, (sum(sends) / len(sends) if sends else 0.0)


def _process_costs(trace: Trace, costs: list[dict[Op, float]]) -> list[dict[Op, float]]:
    """One stage's worth per process: a run of v stages per process sums each process's stages."""
    schedule = schedules.from_label(str(trace.meta.get("schedule", "")))
    if schedule is None or schedule.stages_per_process == 1:
        return costs
    full = stage_costs(costs, len(costs))
    out = []
    for group in process_stages(schedule, trace.n_stages):
        out.append({op: sum(full[s][op] for s in group) for op in (Op.FORWARD, Op.INPUT_GRAD, Op.WEIGHT_GRAD)})
    return out


def choice_of(trace: Trace, **options: Any) -> Choice:
    """:func:`~pipeq.schedules.choose.choose` with the trace's measured costs and hop, at its
    process count and microbatches (``options``: ``memory_limit``, ``hop``...)."""
    costs, hop = measured_costs(trace)
    per_process = _process_costs(trace, costs)
    m = trace.meta.get("microbatches")
    if type(m) is not int or m < 1:
        raise ValueError(f"{trace.source} does not say its microbatches per step")
    options.setdefault("hop", hop)
    return choose(per_process, len(per_process), m, **options)


def advice_line(trace: Trace) -> str | None:
    """"this run's measured costs: 1F1B X ms, ZB-H1 Y ms, ZBV Z ms (best: NAME)" (None: the trace
    cannot say, e.g. no microbatch count)."""
    try:
        choice = choice_of(trace)
    except (ScheduleError, ValueError):
        return None
    rows = {r.name: r for r in choice.rows}
    parts = [f"{shown} {rows[name].step_ms:.2f} ms" for name, shown in (("1f1b", "1F1B"), ("zb-h1", "ZB-H1"),
                                                                         ("zbv", "ZBV"))
             if name in rows and rows[name].step_ms is not None]
    return f"this run's measured costs: {', '.join(parts)} (best: {choice.name})"
