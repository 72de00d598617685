"""The zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, arXiv 2401.10241).

The backward is split into ``I`` (the input gradient, what stage k-1 waits for) and ``W`` (the
weight gradients, which nothing waits for), and the Ws fill the bubbles:

- :func:`zb_h1` (ZB-H1, torch's "ZB1P"): 1F1B's peak memory, a third of its bubble;
- :func:`zb_h2` (ZB-H2): twice 1F1B's activation memory, the pipeline kept full;
- :func:`zbv` / :class:`ZBV` (ZB-V): two model stages per process placed in a V.

Pure: no I/O.
"""

from __future__ import annotations

from pipeq.errors import ScheduleError
from pipeq.schedules.actions import STEP, Action, F, I, Op, Schedule, W
from pipeq.schedules.basic import check_counts
from pipeq.schedules.interleaved import chunk_steps
from pipeq.schedules.protocol import SchedulePolicy

__all__ = ["zb_h1", "zb_h1_stage", "zb_h2", "zb_h2_limit", "ZBV", "zbv", "zbv_process"]


def zb_h1_stage(k: int, n_stages: int, n_microbatches: int) -> list[Action]:
    """Stage ``k``'s ZB-H1 compute actions (see :func:`zb_h1`), STEP last."""
    m = n_microbatches
    warm = min(m, n_stages - 1 - k)
    acts = [F(j) for j in range(warm)]
    for i in range(m):
        if warm + i < m:
            acts.append(F(warm + i))
        acts.append(I(i))
        if i >= k:
            acts.append(W(i - k))
    first_left = max(0, m - k)
    return acts + [W(j) for j in range(first_left, m)] + [STEP]


def zb_h1(n_stages: int, n_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with the backward split into I and W, the Ws placed to fill 1F1B's bubbles.

    The paper's handcrafted schedule ZB-H1, in the order of torch's
    ``ScheduleInterleavedZeroBubble`` with one stage per rank (its "ZB1P"). Stage k of N warms up
    with min(m, N-1-k) forwards; then, for every microbatch i, a forward (while any are left), the
    input gradient ``I i`` (what stage k-1 waits for) and, from the (k+1)-th on, the weight gradient
    ``W (i-k)``: stage k defers k weight gradients, which fill the cool-down's gaps between the
    input gradients, and are done last. At most N microbatches are in flight on any stage
    (forwarded, weight gradient not yet done): 1F1B's peak memory, which is stage 0's. At F = I = W
    the bubble is (N-1) units against 1F1B's 3(N-1), so the step takes 3m + N - 1 units
    (1F1B: 3(m + N - 1)). 4 stages x 8 microbatches, F = I = W = 1::

        stage 0 | F0 F1 F2 F3 .  .  .  I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 W7 ST
        stage 1 | .  F0 F1 F2 .  .  I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 F6 I4 W3 F7 I5 W4 I6 W5 I7 W6 W7 ST
        stage 2 | .  .  F0 F1 .  I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 F6 I5 W3 F7 I6 W4 I7 W5 W6 W7 ST
        stage 3 | .  .  .  F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7 ST

    It drains every step (no stream across batches). Stage 0's ``I`` sends nothing (it has no input
    gradient): the executor keeps what its ``W`` needs and the ``W`` does the whole backward.
    """
    check_counts(n_stages, n_microbatches)
    return [zb_h1_stage(k, n_stages, n_microbatches) for k in range(n_stages)]


def zb_h2_limit(n_stages: int) -> int:
    """The microbatches a ZB-H2 stage holds in flight at most: 2N - 1."""
    return 2 * n_stages - 1


def zb_h2(n_stages: int, n_microbatches: int) -> Schedule:
    """ZB-H2: twice 1F1B's activation memory traded for a pipeline kept full.

    The paper's handcrafted ZB-H2 (section 2.2): with the backward split into ``I`` (input gradient,
    what stage k-1 waits for) and ``W`` (weight gradients, which nothing waits for), stage k warms
    up with as many forwards as fit before its first input gradient can arrive, min(m, 2N-1-2k), so
    the pipeline is full; then it runs, each time unit, an ``I`` whose gradient has arrived, else a
    forward (while fewer than 2N-1 microbatches are in flight, i.e. forwarded and their W not done),
    else the oldest deferred ``W``. The Ws thus fill the tail, which turns 1F1B's trapezoid into a
    parallelogram: at F = I = W every stage works without a gap from its first forward to its last W
    (stage k from time k to 3m + k), the paper's "zero bubble" once the optimizer step no longer
    synchronizes the stages (under ``runner.stream`` a stage starts the next batch as soon as it is
    done). With a synchronized STEP the step is 3m + N - 1 units, the floor for any schedule at
    these costs (the last stage starts at N - 1 and has 3m units of work), which ZB-H1 reaches too:
    ZB-H2's gain shows when W costs less than F + I (ZB-H1's bubble is (N-1)(F + I - W), ZB-H2's
    about (N-1)F), and when batches stream. Peak memory: 2N-1 microbatches in flight (ZB-H1: N).

    The order is the one this rule gives at unit costs (a list schedule, computed here step by step);
    any costs run it without deadlock, since the order only has to respect the data dependencies.
    4 stages x 8 microbatches, F = I = W = 1::

        stage 0 | F0 F1 F2 F3 F4 F5 F6 I0 W0 I1 F7 I2 W1 I3 W2 I4 W3 I5 W4 I6 W5 W6 I7 W7 ST
        stage 1 | .  F0 F1 F2 F3 F4 I0 F5 I1 F6 I2 W0 I3 F7 I4 W1 I5 W2 I6 W3 W4 I7 W5 W6 W7 ST
        stage 2 | .  .  F0 F1 F2 I0 F3 I1 F4 I2 F5 I3 F6 I4 W0 I5 F7 I6 W1 W2 I7 W3 W4 W5 W6 W7 ST
        stage 3 | .  .  .  F0 I0 F1 I1 F2 I2 F3 I3 F4 I4 F5 I5 F6 I6 W0 F7 I7 W1 W2 W3 W4 W5 W6 W7 ST

    One stage per process; it drains every step.
    """
    check_counts(n_stages, n_microbatches)
    n, m, limit = n_stages, n_microbatches, zb_h2_limit(n_stages)
    acts: list[list[Action]] = [[] for _ in range(n)]
    f_end = [[-1] * m for _ in range(n)]  # the time unit a stage's F (I) of a microbatch is over, -1: not yet
    i_end = [[-1] * m for _ in range(n)]
    done_f, done_i, done_w = [0] * n, [0] * n, [0] * n  # per stage: Fs, Is, Ws listed so far (in order)

    def ready(ends: list[int], j: int, t: int) -> bool:
        return 0 <= ends[j] <= t

    t = 0
    while any(w < m for w in done_w):
        if t > 4 * m * n + 4 * n:  # pragma: no cover - the rule always progresses
            raise ScheduleError(f"zb-h2 made no progress with {n} stages x {m} microbatches")
        for k in range(n):
            j = done_i[k]
            if j < done_f[k] and ready(f_end[k], j, t) and (k == n - 1 or ready(i_end[k + 1], j, t)):
                acts[k].append(I(j))
                i_end[k][j], done_i[k] = t + 1, j + 1
                continue
            j = done_f[k]
            if j < m and (k == 0 or ready(f_end[k - 1], j, t)) and done_f[k] - done_w[k] < limit:
                acts[k].append(F(j))
                f_end[k][j], done_f[k] = t + 1, j + 1
            elif done_w[k] < done_i[k] and ready(i_end[k], done_w[k], t):
                acts[k].append(W(done_w[k]))
                done_w[k] += 1
        t += 1
    return [a + [STEP] for a in acts]


class _Counts:
    """The next microbatch of each (op, chunk) a process appends, and the list it appends to."""

    def __init__(self) -> None:
        self.acts: list[Action] = []
        self.next: dict[tuple[Op, int], int] = {}

    def add(self, op: Op, chunk: int) -> None:
        j = self.next.get((op, chunk), 0)
        self.next[op, chunk] = j + 1
        self.acts.append(Action(op, j, chunk))

    def count(self, op: Op, chunk: int) -> int:
        return self.next.get((op, chunk), 0)


def zbv_process(p: int, n_processes: int, n_microbatches: int) -> list[Action]:
    """Process ``p``'s ZBV actions (the phases of :func:`zbv`), its two STEPs last."""
    n, padded = n_processes, max(n_microbatches, 2 * n_processes - 1)
    FWD, IN, WT = Op.FORWARD, Op.INPUT_GRAD, Op.WEIGHT_GRAD
    run = _Counts()
    for _ in range(2 * (n - p) - 1):
        run.add(FWD, 0)
    for _ in range(p):
        run.add(FWD, 1)
        run.add(FWD, 0)
    for _ in range(n - p):
        for op in (FWD, IN, WT):
            run.add(op, 1)
    while run.count(FWD, 1) < run.count(FWD, 0) or run.count(FWD, 0) < padded:
        if run.count(FWD, 0) < padded:
            run.add(FWD, 0)
        for op, c in ((IN, 0), (WT, 0), (FWD, 1), (IN, 1), (WT, 1)):
            run.add(op, c)
    for _ in range(p):
        run.add(IN, 0)
        run.add(IN, 1)
    for _ in range(n - p):
        run.add(IN, 0)
        run.add(WT, 0)
    for c in (1, 0):
        while run.count(WT, c) < run.count(IN, c):
            run.add(WT, c)
    kept = [a for a in run.acts if a.microbatch < n_microbatches]
    return kept + chunk_steps(2)


def zbv(n_processes: int, n_microbatches: int) -> Schedule:
    """ZBV: zero-bubble pipelining with two model stages per process placed in a V, the backward split.

    The paper's ZB-V (section 6), in the order of torch's ``ScheduleZBVZeroBubble``. Process p of N
    holds stage p (chunk 0) and stage 2N-1-p (chunk 1), so the forward goes down the chunk 0s and
    back up the chunk 1s, and process 0 computes the loss. Process p runs, with m' = max(m, 2N-1)
    microbatches:

    1. 2(N-p)-1 forwards of chunk 0;
    2. p times: a forward of chunk 1, a forward of chunk 0;
    3. N-p times: a forward, I and W of chunk 1;
    4. until every forward is done: a forward of chunk 0 (while any are left), I and W of chunk 0,
       a forward, I and W of chunk 1;
    5. p times: I of chunk 0, I of chunk 1; N-p times: I of chunk 0 and the oldest W of chunk 0;
       then the weight gradients left, chunk 1's first.

    The actions of microbatches m..m'-1 (padding that keeps the pipeline full) are dropped, so any
    m >= 1 is taken. At F = I = W the bubble is about zero, at 1F1B's peak activation memory.
    2 processes (stages 0..3) x 3 microbatches::

        process 0 | F0 F1 F2 F0.c1 I0.c1 W0.c1 F1.c1 I1.c1 W1.c1 I0 W0 F2.c1 I2.c1 W2.c1 I1 W1 I2 W2 STEP STEP.c1
        process 1 | F0 F0.c1 F1 F1.c1 I0.c1 W0.c1 F2 I0 W0 F2.c1 I1.c1 W1.c1 I1 I2.c1 I2 W1 W2.c1 W2 STEP STEP.c1
    """
    check_counts(n_processes, n_microbatches)
    return [zbv_process(p, n_processes, n_microbatches) for p in range(n_processes)]


class ZBV(SchedulePolicy):
    """ZB-V (torch's ``ScheduleZBVZeroBubble``): two stages per process in a V, split backward."""

    name = "zbv"
    stages_per_process = 2
    placement = "v"

    def plan(self, n_stages: int, n_microbatches: int) -> Schedule:
        """One list per process (``n_stages`` is the number of processes N; 2N model stages)."""
        return zbv(n_stages, n_microbatches)
