"""Choosing a schedule from measured costs: every candidate's dry-run step time, under an activation-memory limit.

``choose(costs, N, m)`` ranks the plain-backprop schedules pipeq has at N processes and m
microbatches by the step time their dry run predicts (the makespan up to the STEP) with the
given per-stage costs (F, I, W in ms; B = I + W) and a latency ``hop`` per message between two
processes, keeps those whose peak activation memory fits the limit (default: 1F1B's), and picks
the fastest. Memory is counted in whole stages' microbatches: on each process, a microbatch is in
flight from its forward to its B (or W), each of chunk c's weighing 1/v (v stages per process);
the peak is the busiest process's (1F1B's: N microbatches, on stage 0). Given what each stage
was measured to hold (a :class:`~pipeq.schedules.memory.Footprint`) and a limit in bytes per
process instead, a candidate fits when every process's predicted peak in bytes does
(:func:`~pipeq.schedules.memory.process_bytes`: ``schedule="auto"`` with ``auto_memory_limit``).

Candidates: fill-drain, 1F1B, ZB-H1 and ZB-H2 with one stage per process (S = N model stages);
interleaved 1F1B, looped BFS, ZBV, DualPipeV, V-Half and V-Min with two (the model cut into 2N stages: each
process's cost halved, an estimate, unless the caller gives 2N stage costs); and ``zb-search``,
a search over I/W placements for one stage per process (arXiv 2401.10241, section 3's greedy: an
``I`` as soon as its gradient is there, a forward while the memory allows, a ``W`` when the stage
would otherwise idle or its memory is full; a few variants, with ZB-H1 and ZB-H2 as seeds; the best
that fits). It is a :class:`SearchedSchedule`, a schedule the runner runs like any other.
:func:`format_choice` prints the ranking. Pure: no I/O, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from pipeq.errors import ScheduleError
from pipeq.schedules.actions import STEP, Action, Op, Schedule
from pipeq.schedules.dryrun import dry_run, step_bubble, stage_costs
from pipeq.schedules.memory import Footprint, process_bytes, process_peaks, size
from pipeq.schedules.plan import build, process_stages
from pipeq.schedules.protocol import SchedulePolicy
from pipeq.schedules.registry import resolve
from pipeq.schedules.zero_bubble import zb_h1, zb_h2

__all__ = ["ONE_STAGE", "V_STAGE", "SEARCHED", "Budget", "Row", "Choice", "SearchedSchedule", "stage_cost",
           "peak_in_flight", "predict", "search", "choose", "format_choice", "why"]

#: the built-in candidates with one stage per process, and with v stages per process
ONE_STAGE = ("fill-drain", "1f1b", "zb-h1", "zb-h2")
V_STAGE = ("interleaved-1f1b", "looped-bfs", "zbv", "dualpipev", "v-half", "v-min")
#: the searched plan's name
SEARCHED = "zb-search"
_EPS = 1e-9
Costs = "Mapping[Op, float] | Sequence[Mapping[Op, float]]"


def stage_cost(f: float, i: float, w: float, b: float | None = None) -> dict[Op, float]:
    """One stage's costs (ms): forward, input gradient, weight gradient, and B = I + W unless given."""
    return {Op.FORWARD: f, Op.INPUT_GRAD: i, Op.WEIGHT_GRAD: w, Op.BACKWARD: i + w if b is None else b}


def _complete(costs: Sequence[Mapping[Op, float]]) -> list[dict[Op, float]]:
    """Each stage's full costs (:func:`~pipeq.schedules.dryrun.stage_costs`), the STEP free: a
    step's time is measured up to its STEP."""
    full = stage_costs(list(costs), len(costs))
    for c in full:
        c[Op.STEP] = 0.0
    return full


def peak_in_flight(lowered: Schedule, v: int = 1) -> float:
    """The busiest process's peak of microbatches in flight (forwarded, B or W not yet done), each
    of a chunk weighing 1/v: 1F1B's is N (stage 0). See :mod:`pipeq.schedules.memory`."""
    return max(process_peaks(lowered, lambda p, c: 1 / v), default=0.0)


def predict(schedule: Any, n_processes: int, n_microbatches: int, costs: Sequence[Mapping[Op, float]],
            hop: float = 0.0) -> tuple[float, float, float]:
    """(step time, bubble share, peak memory) of ``schedule``'s dry run at N processes, with one
    cost mapping per *model* stage (v·N of them) and ``hop`` per message between processes."""
    return _predict(schedule, n_processes, n_microbatches, costs, hop)[:3]


def _predict(schedule: Any, n_processes: int, n_microbatches: int, costs: Sequence[Mapping[Op, float]],
             hop: float = 0.0, footprint: Footprint | None = None) -> tuple[float, float, float, float | None]:
    """:func:`predict`'s figures and, with ``footprint`` (one per model stage), the busiest
    process's peak bytes (:func:`~pipeq.schedules.memory.process_bytes`)."""
    policy = resolve(schedule)
    v = policy.stages_per_process
    lowered = build(policy, n_processes * v, n_microbatches)
    where = process_stages(policy, n_processes * v)
    full = _complete(costs)
    timeline = dry_run(lowered, cost=full, stages=where, hop=hop)
    step, bubble = step_bubble(timeline, cost=full, stages=where)
    held = max(process_bytes(lowered, where, footprint)) if footprint is not None else None
    return step, bubble, peak_in_flight(lowered, v), held


# ---------------------------------------------------------------- the search


class _Greedy:
    """The zero-bubble paper's greedy list schedule for one stage per process, in time order."""

    def __init__(self, costs: Sequence[Mapping[Op, float]], hop: float, m: int, caps: list[int],
                 i_first: bool, gap: bool) -> None:
        self.c, self.hop, self.m, self.caps, self.i_first, self.gap = costs, hop, m, caps, i_first, gap
        n = self.n = len(costs)
        self.acts: Schedule = [[] for _ in range(n)]
        self.clock = [0.0] * n
        self.nf, self.ni, self.nw = [0] * n, [0] * n, [0] * n
        self.act_at: list[dict[int, float]] = [{} for _ in range(n)]  # microbatch -> its activation's arrival
        self.grad_at: list[dict[int, float]] = [{} for _ in range(n)]

    def arrivals(self, k: int) -> tuple[float | None, float | None]:
        """When stage k's next I and next F can start (None: not known yet, or not allowed)."""
        t, n = self.clock[k], self.n
        i_at = f_at = None
        if self.ni[k] < self.nf[k]:
            i_at = t if k == n - 1 else self.grad_at[k].get(self.ni[k])
        if self.nf[k] < self.m and self.nf[k] - self.nw[k] < self.caps[k]:
            f_at = t if k == 0 else self.act_at[k].get(self.nf[k])
        return i_at, f_at

    def pick(self, k: int) -> Op | None:
        """What stage k does now (None: it waits)."""
        t = self.clock[k]
        i_at, f_at = self.arrivals(k)
        can_i, can_f = i_at is not None and i_at <= t, f_at is not None and f_at <= t
        if can_i and (self.i_first or not can_f):
            return Op.INPUT_GRAD
        if can_f:
            return Op.FORWARD
        if self.nw[k] < self.ni[k]:
            soon = [x for x in (i_at, f_at) if x is not None]
            if not self.gap or not soon or min(soon) >= t + self.c[k][Op.WEIGHT_GRAD] - _EPS:
                return Op.WEIGHT_GRAD
        return None

    def run(self, k: int, op: Op) -> None:
        """Stage k runs ``op`` on its next microbatch."""
        t, c, n = self.clock[k], self.c[k], self.n
        if op is Op.FORWARD:
            j = self.nf[k]
            self.nf[k] += 1
            if k < n - 1:
                self.act_at[k + 1][j] = t + c[op] + self.hop
        elif op is Op.INPUT_GRAD:
            j = self.ni[k]
            self.ni[k] += 1
            if k > 0:
                self.grad_at[k - 1][j] = t + c[op] + self.hop
        else:
            j = self.nw[k]
            self.nw[k] += 1
        self.acts[k].append(Action(op, j))
        self.clock[k] = t + c[op]

    def plan(self) -> Schedule:
        """Every stage's actions, STEP last."""
        left = [k for k in range(self.n)]
        while left:
            t = min(self.clock[k] for k in left)
            tied = [k for k in left if self.clock[k] <= t + _EPS]
            for k in tied:
                op = self.pick(k)
                if op is not None:
                    self.run(k, op)
                    break
            else:  # nothing can start at t: the tied stages wait for the next thing that can change
                later = [x for k in tied for x in self.arrivals(k) if x is not None and x > t + _EPS]
                later += [self.clock[j] for j in left if self.clock[j] > t + _EPS]
                if not later:
                    raise ScheduleError(f"{SEARCHED}: stages {tied} stall at {t}")
                for k in tied:
                    self.clock[k] = min(later)
            left = [k for k in left if self.nw[k] < self.m]
        return [acts + [STEP] for acts in self.acts]


#: the search's variants: the seeds, then (I before F, W only in gaps it fits, per-stage caps tapered)
VARIANTS: tuple[str, ...] = ("zb-h1", "zb-h2") + tuple(
    f"greedy:{i}{g}{tp}" for i in "if" for g in "eg" for tp in "ut")


class SearchedSchedule(SchedulePolicy):
    """A plan the search found: one variant of the greedy (or a seed) for the costs it was
    searched with; its plan for other counts is the same variant's (uniform costs if the stage
    count differs). Plain backprop, one stage per process."""

    name = SEARCHED

    def __init__(self, costs: Sequence[tuple[float, float, float]], hop: float = 0.0, limit: int = 0,
                 variant: str = "zb-h1") -> None:
        if variant not in VARIANTS:
            raise ValueError(f"{SEARCHED}: unknown variant {variant!r}; one of {', '.join(VARIANTS)}")
        self.costs = tuple(tuple(float(x) for x in c) for c in costs)
        self.hop, self.limit, self.variant = float(hop), int(limit), variant

    @property
    def options(self) -> dict[str, Any]:
        return {"costs": self.costs, "hop": self.hop, "limit": self.limit, "variant": self.variant}

    @property
    def label(self) -> str:
        return f"{SEARCHED}({self.variant})"

    def plan(self, n_stages: int, n_microbatches: int) -> Schedule:
        if self.variant == "zb-h1":
            return zb_h1(n_stages, n_microbatches)
        if self.variant == "zb-h2":
            return zb_h2(n_stages, n_microbatches)
        per = self.costs if len(self.costs) == n_stages else [self.costs[0] if self.costs else (1, 1, 1)] * n_stages
        costs = _complete([stage_cost(*c) for c in per])
        limit = self.limit or n_stages
        i_first, gap, tapered = self.variant[7] == "i", self.variant[8] == "g", self.variant[9] == "t"
        caps = [max(1, limit - k) if tapered else limit for k in range(n_stages)]
        return _Greedy(costs, self.hop, n_microbatches, caps, i_first, gap).plan()


def search(costs: Sequence[Mapping[Op, float]], n_microbatches: int, *, hop: float = 0.0,
           limit: float | None = None) -> tuple[SearchedSchedule, float, float, float]:
    """The best plan of the search (one stage per process, ``len(costs)`` of them) whose peak
    memory is at most ``limit`` microbatches (default N): (schedule, step, bubble, peak)."""
    n = len(costs)
    cap = n if limit is None else limit
    full = _complete(costs)
    triples = [(c[Op.FORWARD], c[Op.INPUT_GRAD], c[Op.WEIGHT_GRAD]) for c in full]
    best: tuple[SearchedSchedule, float, float, float] | None = None
    for variant in VARIANTS:
        policy = SearchedSchedule(triples, hop, max(1, int(cap + _EPS)), variant)
        try:
            step, bubble, peak = predict(policy, n, n_microbatches, full, hop)
        except ScheduleError:
            continue
        if peak <= cap + _EPS and (best is None or step < best[1] - _EPS):
            best = (policy, step, bubble, peak)
    if best is None:
        raise ScheduleError(f"{SEARCHED}: no plan within {cap} microbatches in flight")
    return best


# ---------------------------------------------------------------- the choice


@dataclass(frozen=True)
class Budget:
    """A limit in bytes per process (``limit``) and what each model stage holds (``footprint``,
    measured): a candidate fits when its every process's predicted peak is within the limit."""

    limit: float
    footprint: Footprint

    def cap(self, stages: Sequence[int]) -> float:
        """The most microbatches in flight on each of ``stages`` (one per process) within the limit."""
        fp = self.footprint
        each = [max(b.forward, b.waiting or 0.0) for b in fp.per_stage]
        return min((self.limit - fp.static[s]) / each[s] if each[s] > 0 else float("inf") for s in stages)


@dataclass
class Row:
    """One candidate: its predicted step (ms), bubble share, peak memory relative to 1F1B's (and
    with a :class:`Budget`, the busiest process's predicted bytes)."""

    name: str
    step_ms: float | None
    bubble: float | None
    memory: float | None
    fits: bool
    note: str = ""
    schedule: SchedulePolicy | None = field(default=None, repr=False)
    bytes: float | None = None


@dataclass
class Choice:
    """The chosen schedule (a policy the runner takes), its prediction, and every candidate's row."""

    schedule: SchedulePolicy
    name: str
    step_ms: float
    bubble: float
    rows: list[Row]
    n_processes: int
    microbatches: int
    memory_limit: float  # relative to 1F1B's peak
    hop: float = 0.0
    costs: list[dict[Op, float]] = field(default_factory=list)  # per process (one stage each)
    budget: Budget | None = None  # the limit in bytes per process, instead of memory_limit


def _candidates(v: int) -> list[SchedulePolicy]:
    """The built-in schedules of ``v`` stages per process."""
    if v == 1:
        return [resolve(name) for name in ONE_STAGE]
    if v == 2:
        return [resolve(name) for name in V_STAGE]
    from pipeq.schedules.interleaved import Interleaved1F1B, LoopedBFS

    return [Interleaved1F1B(v), LoopedBFS(v)]


def _model_costs(policy: SchedulePolicy, proc: Sequence[Mapping[Op, float]]) -> list[dict[Op, float]]:
    """Per model stage: its process's cost divided among the process's v stages."""
    v, n = policy.stages_per_process, len(proc)
    where = process_stages(policy, n * v)
    owner = {s: p for p, stages in enumerate(where) for s in stages}
    return [{op: t / v for op, t in proc[owner[s]].items()} for s in range(n * v)]


def _row(policy: SchedulePolicy, n: int, m: int, costs: list[dict[Op, float]], hop: float, ref: float,
         limit: float, budget: Budget | None = None, note: str = "") -> Row:
    """A candidate's row (a schedule that cannot run these counts: a row saying why)."""
    try:
        step, bubble, peak, held = _predict(policy, n, m, costs, hop, budget.footprint if budget else None)
    except ScheduleError as exc:
        return Row(policy.label, None, None, None, False, str(exc).split(";")[0][:60], policy)
    fits = held <= budget.limit if budget is not None and held is not None else peak <= limit * ref + _EPS
    return Row(policy.label, step, bubble, peak / ref, fits, note, policy, held)


def choose(costs: "Mapping[Op, float] | Sequence[Mapping[Op, float]]", n_processes: int, n_microbatches: int, *,
           hop: float = 0.0, memory_limit: float = 1.0, stages_per_process: int | None = None,
           search_plans: bool = True, budget: Budget | None = None) -> Choice:
    """Rank the candidates (see the module docstring) and choose the fastest that fits.

    ``costs``: one mapping for every stage, or one per model stage: N of them (one stage per
    process; then two-stage schedules are compared too, each process's cost halved, unless
    ``stages_per_process`` says which v the caller has) or v·N (v stages per process, those only).
    ``memory_limit``: peak activation memory allowed, relative to 1F1B's; or ``budget``: bytes per
    process and what each model stage holds (then only the schedules of the given cut compete:
    the footprint is the given stages'). ``hop``: ms per message between processes."""
    n, m = n_processes, n_microbatches
    given = [dict(costs)] * n if isinstance(costs, Mapping) else [dict(c) for c in costs]
    if n < 1 or len(given) % n:
        raise ScheduleError(f"{len(given)} stage costs for {n} processes: give N or v·N of them")
    v_given = len(given) // n
    vs = [stages_per_process or v_given] if (stages_per_process or v_given > 1 or budget) else [1, 2]
    if budget is not None and len(budget.footprint.static) != len(given):
        raise ScheduleError(f"a footprint of {len(budget.footprint.static)} stages for {len(given)} stage costs")
    ref = peak_in_flight(build("1f1b", n, m))
    rows: list[Row] = []
    proc = _complete(given) if v_given == 1 else []
    for v in vs:
        for policy in _candidates(v):
            per_stage = _complete(given) if v == v_given else _model_costs(policy, proc)
            rows.append(_row(policy, n, m, per_stage, hop, ref, memory_limit, budget))
    if search_plans and 1 in vs:
        cap = memory_limit * ref if budget is None else min(budget.cap(range(n)), float(m))
        try:
            found = search(proc, m, hop=hop, limit=cap)[0] if cap >= 1 else None
            row = (_row(found, n, m, proc, hop, ref, memory_limit, budget, found.variant) if found else
                   Row(SEARCHED, None, None, None, False, "no microbatch fits beside the static bytes"))
            row.name = SEARCHED
            rows.append(row)
        except ScheduleError as exc:
            rows.append(Row(SEARCHED, None, None, None, False, str(exc)[:60]))
    fitting = [r for r in rows if r.fits]
    if not fitting:
        within = (f"{memory_limit:g}x 1F1B's activation memory" if budget is None else
                  f"{size(budget.limit)} per process (the least any needs: "
                  f"{size(min((r.bytes for r in rows if r.bytes is not None), default=0))})")
        raise ScheduleError(f"no schedule fits {within} at {n} processes x {m} microbatches")
    best = min(fitting, key=lambda r: r.step_ms)  # the first of equals: built-ins before the search
    assert best.schedule is not None and best.step_ms is not None and best.bubble is not None
    return Choice(best.schedule, best.name, best.step_ms, best.bubble, rows, n, m, memory_limit, hop, proc, budget)


def format_choice(choice: Choice) -> str:
    """The ranking as a table: schedule, predicted step ms, bubble %, peak memory vs 1F1B, chosen."""
    c = choice.costs
    if c and all(x == c[0] for x in c):
        what = f"F={c[0][Op.FORWARD]:g} I={c[0][Op.INPUT_GRAD]:g} W={c[0][Op.WEIGHT_GRAD]:g} ms per stage"
    elif c:
        what = "F/I/W ms per stage " + ", ".join(
            f"{x[Op.FORWARD]:.3g}/{x[Op.INPUT_GRAD]:.3g}/{x[Op.WEIGHT_GRAD]:.3g}" for x in c)
    else:
        what = "costs per model stage"
    held = choice.budget is not None
    lines = [f"auto: {choice.n_processes} processes x {choice.microbatches} microbatches, {what}, hop "
             f"{choice.hop:g} ms; memory limit {_limit(choice)}",
             f"  {'schedule':<22} {'step ms':>9} {'bubble':>7} {'memory':>7}" + (f" {'peak':>10}" if held else "")]
    for r in sorted(rows_ranked(choice.rows)):
        row = choice.rows[r[1]]
        mark = "*" if row.schedule is choice.schedule and row.name == choice.name else " "
        if row.step_ms is None:
            lines.append(f"{mark} {row.name:<22} {'-':>9} {'-':>7} {'-':>7}  ({row.note})")
            continue
        extra = "" if row.fits else "  over the memory limit"
        extra += f"  ({row.note})" if row.note and row.name == SEARCHED else ""
        peak = f" {size(row.bytes):>10}" if held and row.bytes is not None else ""
        lines.append(f"{mark} {row.name:<22} {row.step_ms:>9.2f} {100 * row.bubble:>6.1f}% "
                     f"{row.memory:>6.2f}x{peak}{extra}")
    if (not held and any(r.schedule is not None and r.schedule.stages_per_process > 1 for r in choice.rows)
            and choice.costs):
        lines.append("  (two stages per process: the model cut into 2N stages, each process's cost halved)")
    lines.append(why(choice))
    return "\n".join(lines)


def _limit(choice: Choice) -> str:
    if choice.budget is not None:
        return f"{size(choice.budget.limit)} per process"
    return f"{choice.memory_limit:g}x 1F1B's"


def why(choice: Choice) -> str:
    """What ``auto`` chose and why, in one line: the fastest within the limit, and the faster ones over it."""
    best = next(r for r in choice.rows if r.schedule is choice.schedule and r.name == choice.name)
    held = f", peak {size(best.bytes)}" if best.bytes is not None else ""
    over = sorted((r for r in choice.rows if not r.fits and r.step_ms is not None and r.step_ms < choice.step_ms),
                  key=lambda r: r.step_ms or 0.0)
    said = ", ".join(f"{r.name} ({size(r.bytes) if r.bytes is not None else f'{r.memory:.2f}x'})"
                     for r in over)
    return (f"chosen: {choice.name} ({choice.step_ms:.2f} ms per step, bubble {100 * choice.bubble:.1f}%{held}): "
            f"the fastest within {_limit(choice)}" + (f"; faster but over it: {said}" if said else ""))


def rows_ranked(rows: Sequence[Row]) -> list[tuple[float, int]]:
    """(sort key, index) of each row: the fitting ones by step time, then the others, then the failed."""
    return [((0 if r.fits else 1) * 1e18 + (r.step_ms if r.step_ms is not None else 2e18), i)
            for i, r in enumerate(rows)]
