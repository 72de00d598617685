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
from pipeq.schedules.actions import COMPUTE_OPS, Action, Op, Schedule, lower, lower_process
from pipeq.schedules.bubbles import formula_of
from pipeq.schedules.basic import forward_only
from pipeq.schedules.dryrun import check_consistency, dry_run, step_bubble
from pipeq.schedules.placement import n_processes, stages_of
from pipeq.schedules.registry import resolve, schedule_name

__all__ = ["build", "format_table", "table_costs", "process_stages"]


def build(schedule: Any, n_stages: int, n_microbatches: int, *, training: bool = True) -> Schedule:
    """The validated, lowered action lists of one step (dry run included).

    ``schedule`` is a registered name, a schedule object or a schedule function; its output is
    checked like any other (consistency, then a deadlock-free dry run) and refused with a
    :class:`ScheduleError` naming the stage and action at fault.
    """
    policy = resolve(schedule)
    if policy.stages_per_process > 1:
        return _build_chunked(policy, n_stages, n_microbatches, training)
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


def process_stages(schedule: Any, n_stages: int) -> list[list[int]]:
    """The model stages each process holds, by chunk (``[[k] for k in range(n_stages)]`` for a
    schedule of one stage per process): see :mod:`pipeq.schedules.placement`."""
    policy = resolve(schedule)
    v, placement = policy.stages_per_process, policy.placement
    n = n_processes(n_stages, v, placement)
    return [stages_of(p, n, v, placement) for p in range(n)]


def _build_chunked(policy: Any, n_stages: int, m: int, training: bool) -> Schedule:
    """:func:`build` of a schedule whose processes hold several stages: one lowered list per
    process, checked per model stage (consistency), then dry-run across processes."""
    where = process_stages(policy, n_stages)
    n, v = len(where), policy.stages_per_process
    if training:
        plan = policy.plan(n, m)
    else:  # forwards only: each process runs its chunks' forwards in stage order
        plan = [[Action(Op.FORWARD, j, c) for c in range(v) for j in range(m)] for _ in range(n)]
    name = schedule_name(policy)
    if not isinstance(plan, list) or len(plan) != n or not all(
            isinstance(acts, list) and all(isinstance(a, Action) and a.op in COMPUTE_OPS for a in acts)
            for acts in plan):
        raise ScheduleError(f"schedule {name!r} must return one list of compute actions per process ({n})")
    per_stage: Schedule = [[] for _ in range(n_stages)]
    for p, acts in enumerate(plan):
        for a in acts:
            if not 0 <= a.chunk < v:
                raise ScheduleError(f"process {p}: {a} names chunk {a.chunk}; processes hold {v} stages")
            per_stage[where[p][a.chunk]].append(Action(a.op, a.microbatch))
        if training:
            _check_steps_last(name, p, acts, v)
    check_consistency(per_stage, n_stages, m, training)
    lowered = [lower_process(acts, where[p], n_stages) for p, acts in enumerate(plan)]
    dry_run(lowered, stages=where)
    return lowered


def _check_steps_last(name: str, p: int, acts: list[Action], v: int) -> None:
    """A process's STEPs are its last v actions, one per chunk (the stages step together)."""
    tail = acts[-v:]
    if len(acts) < v or sorted(a.chunk for a in tail if a.op is Op.STEP) != list(range(v)):
        raise ScheduleError(f"schedule {name!r}, process {p}: its last {v} actions must be one STEP per chunk "
                            "(a process's stages take their optimizer steps together)")


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
    """The process x time table of a schedule's dry run (one column per time unit). ``n_stages``
    counts processes (pipeline ranks): a schedule of v stages per process cuts the model into
    v·N stages, and its actions show their chunk (``F3.c1``). ``costs``: (F, I, W) time units
    (B = I + W); the table then ends with the step's length and bubble."""
    v = resolve(name).stages_per_process
    lowered = build(name, n_stages * v, n_microbatches)
    where = process_stages(name, n_stages * v)
    split = any(a.op in (Op.INPUT_GRAD, Op.WEIGHT_GRAD) for acts in lowered for a in acts)
    if costs is None and split:  # a split backward: B's cost shared by its I and W
        costs = (1, max(1, backward_cost // 2), max(1, backward_cost - backward_cost // 2))
    cost = table_costs(costs, backward_cost)
    timeline = dry_run(lowered, cost=cost, stages=where)
    end = max(t + cost[a.op] for row in timeline for t, a in row)
    labels = [["ST" if a.op is Op.STEP else str(a) for _, a in row] for row in timeline]
    width = max(3, len(str(n_microbatches - 1)) + 2, *(len(x) + 1 for row in labels for x in row))
    what = f"{n_stages} stages" if v == 1 else f"{n_stages} processes x {v} stages ({resolve(name).placement} placement)"
    head = f"{schedule_name(name)}: {what} x {n_microbatches} microbatches"
    if costs is not None:
        head += f" (F={cost[Op.FORWARD]} I={cost[Op.INPUT_GRAD]} W={cost[Op.WEIGHT_GRAD]}, B=I+W"
        head += ")" if v == 1 else " per stage)"
    lines = [head]
    row_name = "stage" if v == 1 else "proc"
    for k, row in enumerate(timeline):
        cells = ["."] * end
        for (t, a), label in zip(row, labels[k]):
            for u in range(t, t + cost[a.op]):
                cells[u] = label
        lines.append(f"{row_name} {k} | " + " ".join(c.ljust(width - 1) for c in cells).rstrip())
    if costs is not None:
        lines.append(_bubble_line(timeline, cost, where, end))
        lines.append(_formula_line(schedule_name(name), timeline, cost, n_stages))
    return "\n".join(lines)


def _bubble_line(timeline: list[list[tuple[int, Action]]], cost: dict[Op, int], where: Sequence[Sequence[int]],
                 end: int) -> str:
    """The step's length (to the last process's first STEP) and its idle share over every process."""
    span, bubble = step_bubble(timeline, cost=cost, stages=where, end=end)
    idle = round(bubble * span * len(timeline))
    return f"step {span} units before STEP; bubble {bubble:.1%} ({idle} idle units)"


def _formula_line(name: str, timeline: list[list[tuple[int, Action]]], cost: dict[Op, int], n: int) -> str:
    """The bubble per process (the step minus one process's work) beside its closed form."""
    span = max(min((t for t, a in row if a.op is Op.STEP), default=0) for row in timeline)
    work = max(sum(cost[a.op] for _, a in row if a.op is not Op.STEP) for row in timeline)
    line = f"bubble per process: {span - work} units"
    found = formula_of(name)
    if found is not None:
        value = found.value(n, cost[Op.FORWARD], cost[Op.INPUT_GRAD], cost[Op.WEIGHT_GRAD], cost[Op.BACKWARD])
        line += f"; formula {found.text} = {value:g} units (pipeq.schedules.bubbles)"
    return line
