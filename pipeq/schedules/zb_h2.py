"""ZB-H2: the zero-bubble schedule that trades twice 1F1B's activation memory for a pipeline kept full.

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024, arXiv 2401.10241, section 2.2, the
handcrafted ZB-H2): with the backward split into ``I`` (input gradient, what stage k-1 waits for)
and ``W`` (weight gradients, which nothing waits for), stage k warms up with as many forwards as
fit before its first input gradient can arrive, min(m, 2N-1-2k), so the pipeline is full; then it
runs, each time unit, an ``I`` whose gradient has arrived, else a forward (while fewer than 2N-1
microbatches are in flight, i.e. forwarded and their W not done), else the oldest deferred ``W``.
The Ws thus fill the tail, which turns 1F1B's trapezoid into a parallelogram: at F = I = W
every stage works without a gap from its first forward to its last W (stage k from time k to
3m + k), the paper's "zero bubble" once the optimizer step no longer synchronizes the stages
(under ``runner.stream`` a stage starts the next batch as soon as it is done). With a
synchronized STEP the step is 3m + N - 1 units, the floor for any schedule at these costs (the
last stage starts at N - 1 and has 3m units of work), which ZB-H1 reaches too: ZB-H2's gain shows
when W costs less than F + I (ZB-H1's bubble is (N-1)(F + I - W), ZB-H2's about (N-1)F), and
when batches stream. Peak memory: 2N-1 microbatches in flight (ZB-H1: N).

The order is the one this rule gives at unit costs (a list schedule, computed here step by step);
any costs run it without deadlock, since the order only has to respect the data dependencies.
4 stages x 8 microbatches, F = I = W = 1::

    stage 0 | F0 F1 F2 F3 F4 F5 F6 I0 W0 I1 F7 I2 W1 I3 W2 I4 W3 I5 W4 I6 W5 W6 I7 W7 ST
    stage 1 | .  F0 F1 F2 F3 F4 I0 F5 I1 F6 I2 W0 I3 F7 I4 W1 I5 W2 I6 W3 W4 I7 W5 W6 W7 ST
    stage 2 | .  .  F0 F1 F2 I0 F3 I1 F4 I2 F5 I3 F6 I4 W0 I5 F7 I6 W1 W2 I7 W3 W4 W5 W6 W7 ST
    stage 3 | .  .  .  F0 I0 F1 I1 F2 I2 F3 I3 F4 I4 F5 I5 F6 I6 W0 F7 I7 W1 W2 W3 W4 W5 W6 W7 ST

One stage per process; it drains every step. Pure: no I/O.
"""

from __future__ import annotations

from pipeq.errors import ScheduleError
from pipeq.schedules.actions import STEP, Action, F, I, Schedule, W
from pipeq.schedules.basic import check_counts

__all__ = ["zb_h2", "zb_h2_limit"]


def zb_h2_limit(n_stages: int) -> int:
    """The microbatches a ZB-H2 stage holds in flight at most: 2N - 1."""
    return 2 * n_stages - 1


def zb_h2(n_stages: int, n_microbatches: int) -> Schedule:
    """ZB-H2: every stage's actions for one training step (see the module docstring)."""
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
