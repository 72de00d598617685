"""ZBV: zero-bubble pipelining with two model stages per process placed in a V, the backward split.

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024, arXiv 2401.10241, section 6, ZB-V), in
the order of torch's ``ScheduleZBVZeroBubble``. Process p of N holds stage p (chunk 0) and stage
2N-1-p (chunk 1), so the forward goes down the chunk 0s and back up the chunk 1s, and process 0
computes the loss. Process p runs, with m' = max(m, 2N-1) microbatches:

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

Pure: no I/O.
"""

from __future__ import annotations

from pipeq.schedules.actions import Action, Op, Schedule
from pipeq.schedules.basic import check_counts
from pipeq.schedules.interleaved import chunk_steps
from pipeq.schedules.protocol import SchedulePolicy

__all__ = ["ZBV", "zbv", "zbv_process"]


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
    """Process ``p``'s ZBV actions (the phases of the module docstring), its two STEPs last."""
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
    """ZBV: one list per process, two model stages each (V placement)."""
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
