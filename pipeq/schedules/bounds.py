"""What a schedule can reach: the plan a stage runs under ``runner.stream`` and the time per
batch its dry run allows, streamed and in a ``step`` loop (benchmarks and ``pipeq report``
measure against these). Pure: no I/O.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

from pipeq.schedules.actions import COMPUTE_OPS, Action, Op, Schedule, ScheduleFn
from pipeq.schedules.dryrun import dry_run, stage_costs
from pipeq.errors import ScheduleError
from pipeq.schedules.plan import build
from pipeq.schedules.registry import resolve


def stream_plan(schedule: str | ScheduleFn, n_stages: int, n_microbatches: int, n_batches: int) -> Schedule:
    """What each stage runs under ``runner.stream``: the lowered lists of ``n_batches`` batches
    back to back, batch b's microbatch j renumbered ``b * m + j`` (STEP keeps -1), as one plan
    that :func:`dry_run` runs like any other. Asynchronous 1F1B does not drain between batches:
    its stream is its plan for all the stream's microbatches at once (so is any schedule that
    :attr:`~pipeq.schedules.SchedulePolicy.streams_across_batches`)."""
    if type(n_batches) is not int or n_batches < 1:
        raise ScheduleError(f"need at least one batch, got n_batches={n_batches!r}")
    m = n_microbatches
    if resolve(schedule).streams_across_batches:  # no drain between batches: one long plan
        return build(schedule, n_stages, m * n_batches)
    return [[a if a.microbatch < 0 else Action(a.op, b * m + a.microbatch, a.chunk) for b in range(n_batches)
             for a in acts]
            for acts in build(schedule, n_stages, m)]


class StreamBound(NamedTuple):
    """Steady-state time per batch (cost units): under ``runner.stream``, and of a ``runner.step``
    loop; ``busy``: the busiest stage's own work in one batch, a floor for any schedule."""

    stream: float
    step: float
    busy: float


def stream_bound(schedule: str | ScheduleFn, n_stages: int, n_microbatches: int,
                 cost: "Mapping[Op, float] | Sequence[Mapping[Op, float]] | None" = None) -> StreamBound:
    """Time per batch from dry runs (``cost`` as in :func:`dry_run`; STEP costs 1 unless given).

    ``stream``: the slope of :func:`stream_plan`'s makespan between 8 and 16 batches (enough
    batches in flight that none holds a stage back). ``step``: a ``step`` loop, where stage k
    starts batch b+1 once it is free and the last stage has returned batch b's loss, so the tail
    of one batch can still overlap the start of the next: one batch's makespan or a little less.
    """
    n, lo, hi = n_stages, 8, 16
    costs = stage_costs(cost, n)

    def ends(timeline: list[list[tuple[int, Action]]], start: Sequence[float]) -> list[float]:
        return [row[-1][0] + costs[k][row[-1][1].op] if row else start[k] for k, row in enumerate(timeline)]

    def makespan(n_batches: int) -> float:
        return max(ends(dry_run(stream_plan(schedule, n, n_microbatches, n_batches), cost=costs), [0] * n))

    one = build(schedule, n, n_microbatches)
    clock: list[float] = [0.0] * n
    loss_back = []
    for _ in range(hi):
        end = ends(dry_run(one, cost=costs, start=clock), clock)
        loss_back.append(end[-1])
        clock = [max(e, end[-1]) for e in end]
    busy = max(sum(costs[k][a.op] for a in acts if a.op in COMPUTE_OPS) for k, acts in enumerate(one))
    return StreamBound(stream=(makespan(hi) - makespan(lo)) / (hi - lo),
                       step=(loss_back[hi - 1] - loss_back[lo - 1]) / (hi - lo), busy=busy)
