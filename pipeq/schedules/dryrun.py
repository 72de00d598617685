"""Checking a schedule before any process starts: consistency, and a symbolic dry run.

:func:`check_consistency` makes sure every stage runs each microbatch's forward once, its
backward once after it, and its optimizer steps where the schedule kind says. :func:`dry_run`
executes lowered action lists symbolically (with costs, optionally bounded queues) and refuses
a schedule that would deadlock, naming every blocked stage; its timeline is what
``pipeq schedule`` prints and what the benchmarks' ideal times come from. Pure: no I/O.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from pipeq.schedules.actions import COMPUTE_OPS, Action, Op, Schedule
from pipeq.errors import ScheduleError


def check_consistency(
    schedule: Schedule, n_stages: int, n_microbatches: int, training: bool, per_microbatch_steps: bool = False
) -> None:
    """Every stage runs each microbatch's forward once, its backward once after it, then one STEP
    (``per_microbatch_steps``: a STEP right after every backward instead)."""
    if len(schedule) != n_stages:
        raise ScheduleError(f"schedule has {len(schedule)} stage lists for {n_stages} stages")
    m = n_microbatches
    for k, acts in enumerate(schedule):
        seen_f: set[int] = set()
        seen_b: set[int] = set()
        steps = 0
        for pos, a in enumerate(acts):
            where = f"stage {k}, action {pos} ({a})"
            if a.op not in COMPUTE_OPS:
                raise ScheduleError(f"{where}: schedules list compute actions only (F, B, STEP)")
            if a.op is Op.STEP:
                steps += 1
                if per_microbatch_steps:
                    if pos == 0 or acts[pos - 1].op is not Op.BACKWARD:
                        raise ScheduleError(f"{where}: each STEP must follow a backward")
                elif pos != len(acts) - 1:
                    raise ScheduleError(f"{where}: STEP must be the stage's last action")
                continue
            j = a.microbatch
            if not 0 <= j < m:
                raise ScheduleError(f"{where}: microbatch {j} is out of range 0..{m - 1}")
            if a.op is Op.FORWARD:
                if j in seen_f:
                    raise ScheduleError(f"{where}: forward of microbatch {j} appears twice")
                seen_f.add(j)
            else:
                if j not in seen_f:
                    raise ScheduleError(f"{where}: backward of microbatch {j} before its forward")
                if j in seen_b:
                    raise ScheduleError(f"{where}: backward of microbatch {j} appears twice")
                seen_b.add(j)
        if len(seen_f) != m:
            missing = sorted(set(range(m)) - seen_f)
            raise ScheduleError(f"stage {k}: no forward for microbatch(es) {missing}")
        if training:
            if len(seen_b) != m:
                missing = sorted(set(range(m)) - seen_b)
                raise ScheduleError(f"stage {k}: no backward for microbatch(es) {missing}")
            want = m if per_microbatch_steps else 1
            if steps != want:
                need = "one STEP" if want == 1 else f"{want} STEPs (one after each backward)"
                raise ScheduleError(f"stage {k}: a training step needs exactly {need}, found {steps}")
        elif seen_b or steps:
            raise ScheduleError(f"stage {k}: a forward-only schedule has no backward or STEP")


def stage_costs(
    cost: "Mapping[Op, float] | Sequence[Mapping[Op, float]] | None", n_stages: int
) -> list[dict[Op, float]]:
    """One complete cost mapping per stage (F, B and STEP 1 unless given) from what
    :func:`dry_run` accepts: None, one mapping for every stage, or one mapping per stage."""
    per_stage = [cost] * n_stages if cost is None or isinstance(cost, Mapping) else list(cost)
    if len(per_stage) != n_stages:
        raise ScheduleError(f"cost has {len(per_stage)} per-stage mappings for {n_stages} stages")
    return [{Op.FORWARD: 1, Op.BACKWARD: 1, Op.STEP: 1, **(c or {})} for c in per_stage]


def _channel(k: int, a: Action) -> tuple[int, int, str, int]:
    """(source stage, destination stage, kind, microbatch) of the message a comm action moves."""
    if a.op is Op.SEND_ACT:
        return (k, k + 1, "act", a.microbatch)
    if a.op is Op.RECV_ACT:
        return (k - 1, k, "act", a.microbatch)
    if a.op is Op.SEND_GRAD:
        return (k, k - 1, "grad", a.microbatch)
    return (k + 1, k, "grad", a.microbatch)


def dry_run(
    lowered: Schedule, *, cost: "Mapping[Op, float] | Sequence[Mapping[Op, float]] | None" = None,
    capacity: int | None = None, start: Sequence[float] | None = None,
) -> list[list[tuple[int, Action]]]:
    """Execute lowered action lists symbolically; return each stage's (start time, action) list.

    Compute actions take ``cost[op]`` time units (forward 1, backward 1, step 1 by default), or
    ``cost[k][op]`` on stage k when ``cost`` is a list of one mapping per stage (stages of
    unequal cost); communication is instantaneous, but a message sent at time t can be received
    from t on. A send blocks while its receiver already holds ``capacity`` unconsumed messages
    from that sender (None: unbounded). ``start``: the time each stage is free to begin (default
    0 on every stage). Raises :class:`ScheduleError` naming every blocked stage if no stage can
    move.
    """
    n = len(lowered)
    costs = stage_costs(cost, n)
    if start is not None and len(start) != n:
        raise ScheduleError(f"start has {len(start)} times for {n} stages")
    pc = [0] * n
    clock = list(start) if start is not None else [0] * n  # time at which stage k is free
    sent: dict[tuple[int, int, str, int], int] = {}  # message -> time it is available
    pending: dict[tuple[int, int], int] = {}  # (src, dst) -> unconsumed messages
    timeline: list[list[tuple[int, Action]]] = [[] for _ in range(n)]
    while True:
        progressed = False
        for k in range(n):
            while pc[k] < len(lowered[k]):
                a = lowered[k][pc[k]]
                if a.op in COMPUTE_OPS:
                    timeline[k].append((clock[k], a))
                    clock[k] += costs[k][a.op]
                elif a.op in (Op.SEND_ACT, Op.SEND_GRAD):
                    ch = _channel(k, a)
                    if not 0 <= ch[1] < n:
                        raise ScheduleError(f"stage {k}: {a} sends to stage {ch[1]}, which does not exist")
                    if capacity is not None and pending.get(ch[:2], 0) >= capacity:
                        break
                    if ch in sent:
                        raise ScheduleError(f"stage {k}: {a} sends the same message twice")
                    sent[ch] = clock[k]
                    pending[ch[:2]] = pending.get(ch[:2], 0) + 1
                else:
                    ch = _channel(k, a)
                    if ch not in sent:
                        break
                    clock[k] = max(clock[k], sent.pop(ch))
                    pending[ch[:2]] -= 1
                pc[k] += 1
                progressed = True
        if all(pc[k] == len(lowered[k]) for k in range(n)):
            if sent:
                extra = ", ".join(f"{kind} {j} from stage {s} to {d}" for s, d, kind, j in sent)
                raise ScheduleError(f"messages sent but never received: {extra}")
            return timeline
        if not progressed:
            blocked = []
            for k in range(n):
                if pc[k] < len(lowered[k]):
                    a = lowered[k][pc[k]]
                    s, d, kind, j = _channel(k, a)
                    if a.op in (Op.RECV_ACT, Op.RECV_GRAD):
                        blocked.append(f"stage {k} waits for the {kind} of microbatch {j} from stage {s}")
                    else:
                        blocked.append(f"stage {k} cannot send the {kind} of microbatch {j} to stage {d} (queue full)")
            raise ScheduleError("schedule deadlocks: " + "; ".join(blocked))
