"""A schedule's validated plan: consistency, lowering, a deadlock-free dry run, and its table.

:func:`build` is what the runner, the stages and ``pipeq schedule`` call: the schedule's plan of
one step (or of ``predict``), checked for consistency (every microbatch forwarded and backwarded
once, a STEP where the schedule says), lowered into sends and receives, and dry-run, so that a
schedule that would deadlock is refused with a :class:`~pipeq.ScheduleError` naming the stage and
action at fault, before any process starts. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any, Sequence

from pipeq.errors import ScheduleError
from pipeq.schedules.actions import COMPUTE_OPS, Action, Op, Schedule, lower
from pipeq.schedules.basic import forward_only
from pipeq.schedules.dryrun import check_consistency, dry_run
from pipeq.schedules.registry import resolve, schedule_name

__all__ = ["build", "format_table", "table_costs"]


def build(schedule: Any, n_stages: int, n_microbatches: int, *, training: bool = True) -> Schedule:
    """The validated, lowered action lists of one step (dry run included).

    ``schedule`` is a registered name, a schedule object or a schedule function; its output is
    checked like any other (consistency, then a deadlock-free dry run) and refused with a
    :class:`ScheduleError` naming the stage and action at fault.
    """
    policy = resolve(schedule)
    decode = False
    if training:
        sched = policy.plan(n_stages, n_microbatches)
    else:
        decoded = policy.inference_plan(n_stages, n_microbatches)
        decode = decoded is not None  # e.g. Associated Learning decodes back down
        sched = decoded if decode else forward_only(n_stages, n_microbatches)
    if not isinstance(sched, list) or not all(
        isinstance(acts, list) and all(isinstance(a, Action) for a in acts) for acts in sched
    ):
        raise ScheduleError(f"schedule {schedule_name(schedule)!r} must return one list of Action per stage")
    given_lowered = any(a.op not in COMPUTE_OPS for acts in sched for a in acts)
    compute = [[a for a in acts if a.op in COMPUTE_OPS] for acts in sched] if given_lowered else sched
    if not decode:  # an inference plan with a decode path is checked by its dry run alone
        check_consistency(compute, n_stages, n_microbatches, training,
                          per_microbatch_steps=training and policy.per_microbatch_steps)
    # a schedule that routes its own messages (interlocking) gives them; dry_run checks them
    lowered = sched if given_lowered or decode else lower(sched)
    dry_run(lowered)
    return lowered


def table_costs(costs: Sequence[int] | None, backward_cost: int = 1) -> dict[Op, int]:
    """The whole time units a table draws each compute action with: ``costs`` = (F, I, W), with
    ``B`` = I + W; or, without, F 1, B ``backward_cost`` and I, W about half of it (at least 1)."""
    if costs is None:
        i = max(1, backward_cost // 2)
        return {Op.FORWARD: 1, Op.BACKWARD: backward_cost, Op.INPUT_GRAD: i,
                Op.WEIGHT_GRAD: max(1, backward_cost - i), Op.STEP: 1}
    if len(costs) != 3 or not all(type(c) is int and c >= 1 for c in costs):
        raise ScheduleError(f"costs are F,I,W: three positive integers (time units), got {tuple(costs)!r}")
    f, i, w = costs
    return {Op.FORWARD: f, Op.INPUT_GRAD: i, Op.WEIGHT_GRAD: w, Op.BACKWARD: i + w, Op.STEP: 1}


def format_table(name: Any, n_stages: int, n_microbatches: int, *, backward_cost: int = 1,
                 costs: Sequence[int] | None = None) -> str:
    """The stage x time table of a schedule's dry run (one column per time unit). ``costs``:
    (F, I, W) time units (B = I + W); the table then ends with the step's length and bubble."""
    lowered = build(name, n_stages, n_microbatches)
    cost = table_costs(costs, backward_cost)
    timeline = dry_run(lowered, cost=cost)
    end = max(t + cost[a.op] for row in timeline for t, a in row)
    width = max(3, len(str(n_microbatches - 1)) + 2)
    head = f"{schedule_name(name)}: {n_stages} stages x {n_microbatches} microbatches"
    if costs is not None:
        head += f" (F={cost[Op.FORWARD]} I={cost[Op.INPUT_GRAD]} W={cost[Op.WEIGHT_GRAD]}, B=I+W)"
    lines = [head]
    for k, row in enumerate(timeline):
        cells = ["."] * end
        for t, a in row:
            label = "ST" if a.op is Op.STEP else str(a)
            for u in range(t, t + cost[a.op]):
                cells[u] = label
        lines.append(f"stage {k} | " + " ".join(c.ljust(width - 1) for c in cells).rstrip())
    if costs is not None:
        lines.append(_bubble_line(timeline, cost, end))
    return "\n".join(lines)


def _bubble_line(timeline: list[list[tuple[int, Action]]], cost: dict[Op, int], end: int) -> str:
    """The step's length (up to its last STEP's start) and its idle share over every stage."""
    span = max((t for row in timeline for t, a in row if a.op is Op.STEP), default=end)
    busy = sum(cost[a.op] for row in timeline for t, a in row if a.op is not Op.STEP)
    idle = span * len(timeline) - busy
    return f"step {span} units before STEP; bubble {idle / (span * len(timeline)):.1%} ({idle} idle units)"
