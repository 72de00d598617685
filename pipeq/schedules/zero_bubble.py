"""ZB-H1: 1F1B with the backward split into I and W, the Ws placed to fill 1F1B's bubbles.

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024, arXiv 2401.10241), the handcrafted
schedule ZB-H1, in the order of torch's ``ScheduleInterleavedZeroBubble`` with one stage per rank
(its "ZB1P"). Stage k of N warms up with min(m, N-1-k) forwards; then, for every microbatch i,
a forward (while any are left), the input gradient ``I i`` (what stage k-1 waits for) and,
from the (k+1)-th on, the weight gradient ``W (i-k)``: stage k defers k weight gradients, which
fill the cool-down's gaps between the input gradients, and are done last. At most N microbatches
are in flight on any stage (forwarded, weight gradient not yet done): 1F1B's peak memory, which is
stage 0's. At F = I = W the bubble is (N-1) units against 1F1B's 3(N-1), so the step takes
3m + N - 1 units (1F1B: 3(m + N - 1)). 4 stages x 8 microbatches, F = I = W = 1::

    stage 0 | F0 F1 F2 F3 .  .  .  I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 W7 ST
    stage 1 | .  F0 F1 F2 .  .  I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 F6 I4 W3 F7 I5 W4 I6 W5 I7 W6 W7 ST
    stage 2 | .  .  F0 F1 .  I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 F6 I5 W3 F7 I6 W4 I7 W5 W6 W7 ST
    stage 3 | .  .  .  F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7 ST

It drains every step (no stream across batches). Stage 0's ``I`` sends nothing (it has no input
gradient): the executor keeps what its ``W`` needs and the ``W`` does the whole backward. Pure: no I/O.
"""

from __future__ import annotations

from pipeq.schedules.actions import STEP, Action, F, I, Schedule, W
from pipeq.schedules.basic import check_counts

__all__ = ["zb_h1", "zb_h1_stage"]


def zb_h1_stage(k: int, n_stages: int, n_microbatches: int) -> list[Action]:
    """Stage ``k``'s ZB-H1 compute actions (see the module docstring), STEP last."""
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
    """ZB-H1 (ZB1P): every stage's actions for one training step."""
    check_counts(n_stages, n_microbatches)
    return [zb_h1_stage(k, n_stages, n_microbatches) for k in range(n_stages)]
