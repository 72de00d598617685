"""Checking a schedule before any process starts: consistency, and a symbolic dry run.

:func:`check_consistency` makes sure every stage runs each microbatch's forward once, its
backward once after it (a ``B``, or an ``I`` then a ``W``), and its optimizer steps where the
schedule kind says. :func:`dry_run` executes lowered action lists symbolically (with costs,
optionally bounded queues) and refuses a schedule that would deadlock, naming every blocked
stage; its timeline is what ``pipeq schedule`` prints and what the benchmarks' ideal times come
from. Pure: no I/O.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from pipeq.schedules.actions import COMPUTE_OPS, WEIGHT_DONE_OPS, Action, Op, Schedule
from pipeq.errors import ScheduleError


def check_consistency(
    schedule: Schedule, n_stages: int, n_microbatches: int, training: bool, per_microbatch_steps: bool = False
) -> None:
    """Every stage runs each microbatch's forward once, then its backward once: one ``B``, or one
    ``I`` and one ``W`` after it; then one STEP after every backward and weight gradient
    (``per_microbatch_steps``: a STEP right after every ``B`` or ``W`` instead). Refusals name the
    stage, the action's position in the stage's list and the action."""
    if len(schedule) != n_stages:
        raise ScheduleError(f"schedule has {len(schedule)} stage lists for {n_stages} stages")
    for k, acts in enumerate(schedule):
        _check_stage(k, acts, n_microbatches, training, per_microbatch_steps)


def _check_stage(k: int, acts: list[Action], m: int, training: bool, per_microbatch_steps: bool) -> None:
    """:func:`check_consistency` of stage ``k``'s list."""
    seen: dict[Op, set[int]] = {Op.FORWARD: set(), Op.BACKWARD: set(), Op.INPUT_GRAD: set(), Op.WEIGHT_GRAD: set()}
    steps = 0
    i_at: dict[int, int] = {}  # microbatch -> the position of its I
    for pos, a in enumerate(acts):
        where = f"stage {k}, action {pos} ({a})"
        if a.op not in COMPUTE_OPS:
            raise ScheduleError(f"{where}: schedules list compute actions only (F, B, I, W, STEP)")
        if a.op is Op.STEP:
            steps += 1
            if per_microbatch_steps:
                if pos == 0 or acts[pos - 1].op not in WEIGHT_DONE_OPS:
                    raise ScheduleError(f"{where}: each STEP must follow a backward (B or W)")
            elif pos != len(acts) - 1:
                raise ScheduleError(f"{where}: STEP must be the stage's last action")
            continue
        j = a.microbatch
        if not 0 <= j < m:
            raise ScheduleError(f"{where}: microbatch {j} is out of range 0..{m - 1}")
        problem = _out_of_order(a.op, j, seen)
        if problem:
            raise ScheduleError(f"{where}: {problem}")
        seen[a.op].add(j)
        if a.op is Op.INPUT_GRAD:
            i_at[j] = pos
    _check_complete(k, seen, steps, m, training, per_microbatch_steps, i_at)


_NAMES = {Op.FORWARD: "forward", Op.BACKWARD: "backward", Op.INPUT_GRAD: "input gradient (I)",
          Op.WEIGHT_GRAD: "weight gradient (W)"}


def _out_of_order(op: Op, j: int, seen: dict[Op, set[int]]) -> str:
    """Why ``op`` of microbatch ``j`` cannot come after what ``seen`` holds ('' if it can)."""
    if j in seen[op]:
        return f"{_NAMES[op]} of microbatch {j} appears twice"
    if op is Op.FORWARD:
        return ""
    if j not in seen[Op.FORWARD]:
        return f"{_NAMES[op]} of microbatch {j} before its forward"
    if op is Op.BACKWARD and (j in seen[Op.INPUT_GRAD] or j in seen[Op.WEIGHT_GRAD]):
        return f"microbatch {j} has a split backward (I, W) already; B is both"
    if op is Op.INPUT_GRAD and j in seen[Op.BACKWARD]:
        return f"microbatch {j} has its backward (B) already, which includes its I"
    if op is Op.WEIGHT_GRAD and j not in seen[Op.INPUT_GRAD]:
        what = "which includes its W" if j in seen[Op.BACKWARD] else "W must come after its I"
        return f"weight gradient (W) of microbatch {j} before its input gradient (I): {what}"
    return ""


def _check_complete(k: int, seen: dict[Op, set[int]], steps: int, m: int, training: bool,
                    per_microbatch_steps: bool, i_at: dict[int, int]) -> None:
    """Stage ``k`` ran every forward, and (training) every backward and its STEPs."""
    if len(seen[Op.FORWARD]) != m:
        missing = sorted(set(range(m)) - seen[Op.FORWARD])
        raise ScheduleError(f"stage {k}: no forward for microbatch(es) {missing}")
    split = seen[Op.INPUT_GRAD] | seen[Op.WEIGHT_GRAD]
    if not training:
        if seen[Op.BACKWARD] or split or steps:
            raise ScheduleError(f"stage {k}: a forward-only schedule has no backward or STEP")
        return
    no_w = sorted(seen[Op.INPUT_GRAD] - seen[Op.WEIGHT_GRAD])
    if no_w:
        j = no_w[0]
        raise ScheduleError(f"stage {k}, action {i_at[j]} (I{j}): no weight gradient (W) of microbatch {j} "
                            f"follows it" + (f" (nor of microbatch(es) {no_w[1:]})" if no_w[1:] else ""))
    done = seen[Op.BACKWARD] | seen[Op.WEIGHT_GRAD]
    if len(done) != m:
        missing = sorted(set(range(m)) - done)
        raise ScheduleError(f"stage {k}: no backward for microbatch(es) {missing}")
    want = m if per_microbatch_steps else 1
    if steps != want:
        need = "one STEP" if want == 1 else f"{want} STEPs (one after each backward)"
        raise ScheduleError(f"stage {k}: a training step needs exactly {need}, found {steps}")


def stage_costs(
    cost: "Mapping[Op, float] | Sequence[Mapping[Op, float]] | None", n_stages: int
) -> list[dict[Op, float]]:
    """One complete cost mapping per stage from what :func:`dry_run` accepts: None, one mapping
    for every stage, or one mapping per stage. F, B and STEP cost 1 unless given; a split
    backward costs as much as the whole: given ``I`` and ``W``, ``B`` is ``I + W`` (unless
    given), else ``I`` and ``W`` are half of ``B`` each."""
    per_stage = [cost] * n_stages if cost is None or isinstance(cost, Mapping) else list(cost)
    if len(per_stage) != n_stages:
        raise ScheduleError(f"cost has {len(per_stage)} per-stage mappings for {n_stages} stages")
    return [_complete(c or {}) for c in per_stage]


def _complete(c: Mapping[Op, float]) -> dict[Op, float]:
    """One stage's costs with the defaults :func:`stage_costs` describes."""
    full: dict[Op, float] = {Op.FORWARD: 1, Op.STEP: 1}
    if Op.INPUT_GRAD in c or Op.WEIGHT_GRAD in c:
        i, w = c.get(Op.INPUT_GRAD, 1), c.get(Op.WEIGHT_GRAD, 1)
        full.update({Op.INPUT_GRAD: i, Op.WEIGHT_GRAD: w, Op.BACKWARD: i + w})
    else:
        b = c.get(Op.BACKWARD, 1)
        full.update({Op.BACKWARD: b, Op.INPUT_GRAD: b / 2, Op.WEIGHT_GRAD: b / 2})
    full.update(c)
    return full


def _channel(k: int, a: Action) -> tuple[int, int, str, int]:
    """(source stage, destination stage, kind, microbatch) of the message a comm action of
    stage ``k`` moves."""
    if a.op is Op.SEND_ACT:
        return (k, k + 1, "act", a.microbatch)
    if a.op is Op.RECV_ACT:
        return (k - 1, k, "act", a.microbatch)
    if a.op is Op.SEND_GRAD:
        return (k, k - 1, "grad", a.microbatch)
    return (k + 1, k, "grad", a.microbatch)


def step_bubble(timeline: list[list[tuple[int, Action]]], *,
                cost: "Mapping[Op, float] | Sequence[Mapping[Op, float]] | None" = None,
                stages: Sequence[Sequence[int]] | None = None, end: float = 0) -> tuple[float, float]:
    """A dry run's step and bubble, the one definition pipeq uses (``pipeq.schedules.choose``'s search, the
    trace report's ideal bubble, ``pipeq schedule``'s tables): the step lasts until the last process
    starts its first STEP (``end`` for a process without one), and the bubble is the share of
    step x processes that no action fills. ``cost`` and ``stages``: as :func:`dry_run` was given
    them; a STEP counts as no work."""
    where = [list(w) for w in stages] if stages is not None else [[k] for k in range(len(timeline))]
    costs = stage_costs(cost, sum(len(w) for w in where))
    span = max((min((t for t, a in row if a.op is Op.STEP), default=end) for row in timeline), default=end)
    busy = sum(costs[where[k][a.chunk]][a.op] for k, row in enumerate(timeline) for _, a in row if a.op is not Op.STEP)
    return span, (1 - busy / (span * len(timeline)) if span > 0 else 0.0)


def dry_run(
    lowered: Schedule, *, cost: "Mapping[Op, float] | Sequence[Mapping[Op, float]] | None" = None,
    capacity: int | None = None, start: Sequence[float] | None = None,
    stages: Sequence[Sequence[int]] | None = None, hop: float = 0,
) -> list[list[tuple[int, Action]]]:
    """Execute lowered action lists symbolically; return each stage's (start time, action) list.

    ``stages``: with virtual stages, ``lowered`` has one list per *process* and ``stages[k][c]``
    is the model stage chunk c of process k runs (messages go between model stages; a process
    runs its list in order, whatever chunk each action is for; ``cost`` per stage is then per
    model stage). Default: process k is stage k.

    Compute actions take ``cost[op]`` time units (forward 1, backward 1, step 1 by default; ``I``
    and ``W`` see :func:`stage_costs`), or
    ``cost[k][op]`` on stage k when ``cost`` is a list of one mapping per stage (stages of
    unequal cost); communication is instantaneous, but a message sent at time t can be received
    from t on. A send blocks while its receiver already holds ``capacity`` unconsumed messages
    from that sender (None: unbounded). ``start``: the time each stage is free to begin (default
    0 on every stage). ``hop``: the latency of a message between two processes (a message sent at t
    is received from t + hop on; between two stages of one process, from t). Raises :class:`ScheduleError` naming every blocked stage if no stage can
    move.
    """
    n = len(lowered)
    where = [list(s) for s in stages] if stages is not None else [[k] for k in range(n)]
    if len(where) != n:
        raise ScheduleError(f"stages names {len(where)} processes for {len(lowered)} action lists")
    costs = stage_costs(cost, sum(len(w) for w in where))
    owner = {s: k for k, w in enumerate(where) for s in w}  # model stage -> its process
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
                s = where[k][a.chunk]
                if a.op in COMPUTE_OPS:
                    timeline[k].append((clock[k], a))
                    clock[k] += costs[s][a.op]
                elif a.op in (Op.SEND_ACT, Op.SEND_GRAD):
                    ch = _channel(s, a)
                    if not 0 <= ch[1] < len(costs):
                        raise ScheduleError(f"stage {s}: {a} sends to stage {ch[1]}, which does not exist")
                    if capacity is not None and pending.get(ch[:2], 0) >= capacity:
                        break
                    if ch in sent:
                        raise ScheduleError(f"stage {s}: {a} sends the same message twice")
                    sent[ch] = clock[k] + (hop if owner.get(ch[1], k) != k else 0)
                    pending[ch[:2]] = pending.get(ch[:2], 0) + 1
                else:
                    ch = _channel(s, a)
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
                    me = where[k][a.chunk]
                    who = f"stage {me}" if stages is None else f"process {k} (stage {me})"
                    s, d, kind, j = _channel(me, a)
                    if a.op in (Op.RECV_ACT, Op.RECV_GRAD):
                        blocked.append(f"{who} waits for the {kind} of microbatch {j} from stage {s}")
                    else:
                        blocked.append(f"{who} cannot send the {kind} of microbatch {j} to stage {d} (queue full)")
            raise ScheduleError("schedule deadlocks: " + "; ".join(blocked))
