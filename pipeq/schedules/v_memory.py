"""V-shape schedules with controllable memory: V-Half and V-Min (Qi et al., "Pipeline
Parallelism with Controllable Memory", NeurIPS 2024, arXiv 2405.15362).

Process p of N holds stage p (chunk 0) and stage 2N-1-p (chunk 1), as in ZBV, with the backward
split into ``I`` and ``W``. The paper shows a device's peak activation memory is the lifespan of
its passes divided by the interval between microbatches: ZBV keeps about 2N chunks (N
microbatches, 1F1B's peak) in flight; holding fewer, at some bubble, gives V-Half (about half of
1F1B's) and V-Min (about a third).

Here the order comes from one list scheduler over that placement, in the spirit of the paper's
greedy construction (not its building blocks): at unit costs, time step by time step, each
process runs an ``I`` whose gradient has arrived (oldest first), else a forward of chunk 1, else
a forward of chunk 0 (a new microbatch entering the process), else the oldest deferred ``W``. A
forward runs only while the process's chunks in flight (forwarded, ``W`` not yet done) stay
within a cap, :func:`v_cap`, and a chunk 0 forward takes the last chunk of room only if no
microbatch on the process waits for its chunk 1 forward. So the oldest unfinished microbatch
always finds room for its next forward (what a process holds besides is newer, and leaves it a
chunk): no cap and no microbatch count deadlocks, and the peak is the cap. The order only has
to respect the data dependencies, so any costs run it.

Pure: no I/O.
"""

from __future__ import annotations

from collections import deque

from pipeq.errors import ScheduleError
from pipeq.schedules.actions import Action, Op, Schedule
from pipeq.schedules.basic import check_counts
from pipeq.schedules.interleaved import chunk_steps
from pipeq.schedules.protocol import SchedulePolicy

__all__ = ["v_cap", "capped_v", "VHalf", "VMin"]


def v_cap(n_processes: int, divisor: int) -> int:
    """The chunks a process may hold in flight: ``2N / divisor`` (1F1B's peak, N microbatches, is
    2N chunks) to the nearest whole chunk, and at least 2 (one microbatch's two chunks)."""
    return max(2, (4 * n_processes + divisor) // (2 * divisor))


class _Timeline:
    """The list scheduler's state: when each stage's F and I of each microbatch end (-1: not yet)."""

    def __init__(self, n: int, m: int) -> None:
        self.n, self.m = n, m
        self.f_end = [[-1] * m for _ in range(2 * n)]
        self.i_end = [[-1] * m for _ in range(2 * n)]
        self.nf, self.ni = [0] * (2 * n), [0] * (2 * n)  # per stage: forwards, input gradients so far

    def stage(self, p: int, chunk: int) -> int:
        return p if chunk == 0 else 2 * self.n - 1 - p

    def can_forward(self, s: int, t: int) -> bool:
        j = self.nf[s]
        return j < self.m and (s == 0 or 0 <= self.f_end[s - 1][j] <= t)

    def can_grad(self, s: int, t: int) -> bool:
        j = self.ni[s]
        return (j < self.nf[s] and 0 <= self.f_end[s][j] <= t
                and (s == 2 * self.n - 1 or 0 <= self.i_end[s + 1][j] <= t))


def capped_v(n_processes: int, n_microbatches: int, cap: int) -> Schedule:
    """The list schedule described above: one list per process, at most ``cap`` chunks in flight
    on any process (``cap`` >= 2)."""
    check_counts(n_processes, n_microbatches)
    if type(cap) is not int or cap < 2:
        raise ScheduleError(f"a V schedule holds at least one microbatch's two chunks: cap >= 2, got {cap!r}")
    n, m = n_processes, n_microbatches
    tl = _Timeline(n, m)
    acts: list[list[Action]] = [[] for _ in range(n)]
    level = [0] * n  # chunks in flight per process
    deferred: list[deque[tuple[int, int, int]]] = [deque() for _ in range(n)]  # (I's end, microbatch, chunk)
    t = 0
    while any(sum(a is not None for a in row) < 6 * m for row in acts):
        if t > 12 * m * n + 12 * n:  # pragma: no cover - the oldest microbatch always moves
            raise ScheduleError(f"v schedule (cap {cap}) made no progress at {n} processes x {m} microbatches")
        for p in range(n):
            acts[p].append(_pick(tl, p, t, cap, level, deferred[p]))
        t += 1
    return [[a for a in row if a is not None] + chunk_steps(2) for row in acts]  # type: ignore[misc]


def _pick(tl: _Timeline, p: int, t: int, cap: int, level: list[int], deferred: deque) -> Action | None:
    """What process ``p`` runs in time unit ``t`` (None: it idles), its state updated."""
    grads = [(tl.ni[s], c, s) for c in (1, 0) if tl.can_grad(s := tl.stage(p, c), t)]
    if grads:
        j, c, s = min(grads)
        tl.i_end[s][j], tl.ni[s] = t + 1, j + 1
        deferred.append((t + 1, j, c))
        return Action(Op.INPUT_GRAD, j, c)
    # the last chunk of room goes to a chunk 0 forward only if no microbatch here waits for its chunk 1
    waiting = tl.nf[tl.stage(p, 0)] > tl.nf[tl.stage(p, 1)]
    for c in (1, 0):
        s = tl.stage(p, c)
        if tl.can_forward(s, t) and level[p] + 1 + (c == 0 and waiting) <= cap:
            j = tl.nf[s]
            tl.f_end[s][j], tl.nf[s] = t + 1, j + 1
            level[p] += 1
            return Action(Op.FORWARD, j, c)
    if deferred and deferred[0][0] <= t:
        _, j, c = deferred.popleft()
        level[p] -= 1
        return Action(Op.WEIGHT_GRAD, j, c)
    return None


class _VMemory(SchedulePolicy):
    """A V schedule whose activations in flight are capped at 1/``divisor`` of 1F1B's."""

    divisor = 2
    stages_per_process = 2
    placement = "v"

    def plan(self, n_stages: int, n_microbatches: int) -> Schedule:
        """One list per process (``n_stages`` is the number of processes N; 2N model stages)."""
        check_counts(n_stages, n_microbatches)
        return capped_v(n_stages, n_microbatches, v_cap(n_stages, self.divisor))


class VHalf(_VMemory):
    """V-Half (arXiv 2405.15362): about half of 1F1B's activation memory, two stages per process in a V."""

    name = "v-half"
    divisor = 2


class VMin(_VMemory):
    """V-Min (arXiv 2405.15362): about a third of 1F1B's activation memory, at more bubble."""

    name = "v-min"
    divisor = 3
