"""Pictures of pipeq traces: a stage x time timeline of a traced run or of a schedule's plan.

::

    plot_trace(load_trace("run.json"), "run.png")           # the last training step
    plot_trace(planned_trace("1f1b", 4, 8), "plan.png", steps="all")   # a schedule's plan

(``pipeq report run.json --plot run.png``, ``pipeq schedule 1f1b --stages 4 --microbatches 8
--plot plan.png``; the traces come from :mod:`pipeq.trace`, the step selection from
:mod:`pipeq.trace.report`). Categories other than forward, backward, step, send and wait are drawn
grey. matplotlib is imported when a picture is drawn, never with this module, and is needed for
the pictures only (``pip install matplotlib``, or ``pip install -e ".[plot]"`` in pipeq's folder).
"""

from __future__ import annotations

import os
from typing import Any

from pipeq.trace.report import StepSelection, select_steps, span_text
from pipeq.trace.format import (BACKWARD_CAT, COMPUTE_CATS, FORWARD_CAT, SEND_CAT, STEP_CAT, WAIT_CAT, Event, Trace,
                    trace_from_dict)

_STEP_COLOUR = "#3a3a3a"
_SEND_COLOUR = "#8a9bb0"  # slate: neutral, told apart from the optimizer step's dark grey
_OTHER_COLOUR = "#c8c8c8"


def plot_trace(trace: Trace | dict[str, Any], path: str | os.PathLike[str], steps: StepSelection = None,
               title: str | None = None) -> str:
    """Draw a stage x time picture of a trace (PNG); return the path.

    Stages are rows (stage 0 on top; with several replicas one group of rows per replica,
    "r1 s0"), time runs left to right: in ms from the first event drawn for a traced run, in
    the plan's time units (a forward is 1, a backward ``backward_cost``) for a schedule's plan
    (:func:`~pipeq.trace.planned_trace`). Forward boxes are light, backward boxes dark and
    hatched, both coloured by microbatch; the optimizer step is dark grey, sends thin slate
    boxes, unknown categories light grey; white is idle or waiting.
    ``steps``: None (default) the last training step, "all", a step number or numbers.
    """
    fig = draw_trace(trace, steps, title)
    fig.savefig(path, format="png", dpi=120, bbox_inches="tight")
    return os.fspath(path)


def draw_trace(trace: Trace | dict[str, Any], steps: StepSelection = None, title: str | None = None) -> Any:
    """:func:`plot_trace`'s picture as a matplotlib ``Figure`` (not saved)."""
    try:
        from matplotlib.figure import Figure  # pyplot-free: no display, the global backend is untouched
    except ImportError as exc:
        raise RuntimeError("drawing pipeline timelines needs matplotlib: pip install matplotlib (or "
                           "pip install -e '.[plot]' in pipeq's folder)") from exc
    if isinstance(trace, dict):
        trace = trace_from_dict(trace)
    wanted = select_steps(trace, steps)
    events = [e for e in trace.events if wanted is None or e.step in wanted]
    if not events:
        raise ValueError(f"{trace.source} has no stage events in step {span_text(sorted(wanted or []))}")
    unit_us, xlabel = time_axis(trace)
    replicas = sorted({e.replica for e in events})
    held = process_rows(trace)
    row_of = {(r, s): i * len(held) + p for i, r in enumerate(replicas) for p, group in enumerate(held) for s in group}
    t0 = min(e.start_us for e in events)
    span = max(max(e.end_us for e in events) - t0, 1.0) / unit_us
    n_rows = len(replicas) * len(held)
    width_in = 13.0
    fig = Figure(figsize=(width_in, 1.4 + 0.55 * n_rows), dpi=120)
    ax = fig.add_subplot(1, 1, 1)
    px_per_unit = width_in * 120 * 0.8 / span
    later = {s for group in held for s in group[1:]}  # a process's later chunks: lower, thinner boxes
    _draw_boxes(ax, events, row_of, t0, unit_us, px_per_unit, later)
    _draw_step_marks(ax, trace, wanted, events, t0, unit_us)
    names = [f"stage {g[0]}" if len(g) == 1 else "proc " + "+".join(map(str, g)) for g in held]
    labels = [name if len(replicas) == 1 else f"r{r} {name}" for r in replicas for name in names]
    ax.set_yticks(range(n_rows))
    ax.set_yticklabels(labels)
    ax.set_ylim(n_rows - 0.5, -0.5)  # stage 0 on top
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel(xlabel)
    if trace.meta.get("planned"):  # whole slots
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(axis="x", color="#e6e6e6", linewidth=0.6)
    ax.set_axisbelow(True)
    ax.set_title(title or _default_title(trace, wanted, events), loc="left", fontsize=10)
    ax.legend(handles=_legend_handles(events), loc="upper left", bbox_to_anchor=(1.005, 1.0),
              frameon=False, fontsize=8)
    return fig


def process_rows(trace: Trace) -> list[list[int]]:
    """The stages each row shows: one per stage, or with virtual stages the stages of one process
    (from the schedule the trace names; one per stage when it names none pipeq knows)."""
    from pipeq import schedules

    n = trace.n_stages
    try:
        policy = schedules.from_label(str(trace.meta.get("schedule", "")))
        if policy is not None and policy.stages_per_process > 1:
            return schedules.process_stages(policy, n)
    except (ValueError, schedules.ScheduleError):
        pass
    return [[k] for k in range(n)]


def time_axis(trace: Trace) -> tuple[float, str]:
    """(microseconds per unit of the time axis, its label): ms for a run, the plan's own time
    unit (one forward) for a schedule's plan, whose times are slots of a dry run, not durations."""
    if trace.meta.get("planned"):
        cost = trace.meta.get("backward_cost", "?")
        costs = trace.meta.get("costs")
        if costs:
            f, i, w = costs
            return (float(trace.meta.get("unit_us", 1000.0)),
                    f"plan time units (F {f}, I {i}, W {w}, a backward B = I + W; sends take none)")
        return (float(trace.meta.get("unit_us", 1000.0)),
                f"plan time units (a forward takes 1 unit, a backward {cost}; sends take none)")
    return 1000.0, "time (ms from the first event drawn)"


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
    if e.cat == FORWARD_CAT:
        c = _colour(e.microbatch)
        return ("forward", _mix(c, 0.55), _mix(c, -0.15), None, 0.8)
    if e.cat == BACKWARD_CAT:
        c = _colour(e.microbatch)
        if e.op == "W":  # a split backward's weight gradients: lighter, crossed the other way
            return ("backward", _mix(c, 0.3), _mix(c, -0.45), "\\\\", 0.8)
        return ("backward", c, _mix(c, -0.45), "//", 0.8)
    if e.cat == STEP_CAT:
        return ("step", _STEP_COLOUR, _STEP_COLOUR, None, 0.8)
    if e.cat == SEND_CAT:
        return ("send", _SEND_COLOUR, _SEND_COLOUR, None, 0.22)
    if e.cat == WAIT_CAT:
        return ("wait", None, None, None, 0.0)
    return ("other", _OTHER_COLOUR, "#a0a0a0", None, 0.5)


def _draw_boxes(ax: Any, events: list[Event], row_of: dict[tuple[int, int], int], t0: float,
                unit_us: float, px_per_unit: float, later: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    groups: dict[tuple[str, str | None], tuple[list[Any], list[Any], list[Any]]] = {}
    for e in events:
        kind, face, edge, hatch, height = _box_style(e)
        if face is None:
            continue  # waits are left white, like idle time
        y = row_of[(e.replica, e.stage)]
        x, w = (e.start_us - t0) / unit_us, e.dur_us / unit_us
        if e.stage in later and kind != "send":  # a process's later stage (virtual stages): its lower part
            height *= 0.6
            top = y + 0.4 - height
        else:
            top = y + 0.4 - height if kind == "send" else y - height / 2  # sends: a strip at the row's foot
        patches, faces, edges = groups.setdefault((kind, hatch), ([], [], []))
        patches.append(Rectangle((x, top), w, height))
        faces.append(face)
        edges.append(edge)
        _label(ax, e, kind, x, w, y, px_per_unit)
    for (kind, hatch), (patches, faces, edges) in groups.items():
        ax.add_collection(PatchCollection(patches, facecolors=faces, edgecolors=edges, linewidths=0.6,
                                          hatch=hatch, zorder=2))


def _label(ax: Any, e: Event, kind: str, x: float, w: float, y: int, px_per_unit: float) -> None:
    """Write "F3" / "B3" inside a forward or backward box that is wide enough."""
    if kind not in ("forward", "backward", "step"):
        return
    op = e.op if e.op in ("I", "W") else "B"  # a split backward's boxes say which half they are
    text = "ST" if kind == "step" else f"{'F' if kind == 'forward' else op}{e.microbatch}"
    if w * px_per_unit < 7.5 * len(text) + 4:
        return
    colour = "black" if kind == "forward" else "white"
    ax.text(x + w / 2, y, text, ha="center", va="center", fontsize=7, color=colour, zorder=3,
            fontweight="bold" if kind == "backward" else "normal", clip_on=True)


def _draw_step_marks(ax: Any, trace: Trace, wanted: set[int] | None, events: list[Event], t0: float,
                     unit_us: float) -> None:
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
        x = (start - t0) / unit_us
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
        if meta.get("costs"):
            return what + " (F, I, W = {}, {}, {})".format(*meta["costs"])
        return what + f" (backward = {meta.get('backward_cost', '?')} x forward)"
    drawn = sorted({e.step for e in events})
    return what + f", step {span_text(drawn)}" if wanted is not None else what + f", steps {span_text(drawn)}"
