"""Traces: the file every stage's timeline is written in, what it says, and pictures of it.

A traced run (``PipelineRunner(..., trace="run.json")``, ``pipeq launch --trace run.json``) writes
one Chrome trace-event file (Perfetto, chrome://tracing): a track per stage (``tid``: the stage,
``pid``: the replica) and the driver's, every stage's events on the driver's clock; a schedule's
plan (its dry run) is written in the same format (:func:`planned_trace`)::

    trace = pipeq.trace.load_trace("run.json")                            # checked and indexed
    print(pipeq.trace.format_report(pipeq.trace.analyze(trace, skip_first=1)))   # = pipeq report
    pipeq.trace.plot_trace(trace, "run.png")                              # the last training step
    pipeq.trace.plot_trace(pipeq.trace.planned_trace("1f1b", 4, 8), "plan.png", steps="all")

:func:`analyze` says per step and stage where the time went (compute: the ``forward``,
``backward`` and ``step`` events; ``send``; ``wait``, blocked on an input; idle) and the bubble
(the share of a step's wall time a stage does not compute, averaged over the stages) beside the
schedule's own ideal, the throughput beside the schedule's bound, and what other schedules would
take with the measured costs. :func:`plot_trace` draws a stage x time picture (needs matplotlib,
imported only then).

The file format (version :data:`VERSION`) is the trace-format module's (pipeq/trace/format.py,
imported with this package); the report and the pictures are imported when first named here.
"""

from typing import TYPE_CHECKING

from pipeq.lazy import lazy_getattr
from pipeq.trace.format import (VERSION, Event, Trace, TraceMeta, load_trace, planned_trace, save_trace,
                                trace_from_dict)

if TYPE_CHECKING:  # what __getattr__ imports on first use, for type checkers and the API reference
    from pipeq.trace.plot import draw_trace, plot_trace
    from pipeq.trace.report import (Report, StageTotals, StepStats, Throughput, analyze, format_report,
                                    ideal_bubble, parse_steps)

#: The report's and the pictures' names (the control plane's modules), imported on first use:
#: name -> its module.
_LAZY: dict[str, tuple[str, str | None]] = {
    **{name: ("pipeq.trace.report", name) for name in ("analyze", "format_report", "parse_steps", "ideal_bubble",
                                                       "Report", "StageTotals", "StepStats", "Throughput")},
    "plot_trace": ("pipeq.trace.plot", "plot_trace"), "draw_trace": ("pipeq.trace.plot", "draw_trace")}

__all__ = ["VERSION", "Trace", "Event", "TraceMeta", "load_trace", "trace_from_dict", "planned_trace", "save_trace",
           "analyze", "format_report", "parse_steps", "ideal_bubble", "Report", "StageTotals", "StepStats", "Throughput",
           "plot_trace", "draw_trace"]


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
