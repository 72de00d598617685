"""The plain-backprop schedules: fill-drain (GPipe), 1F1B (PipeDream-Flush) and forward-only inference.

Fill-drain, 4 stages x 4 microbatches, unit-time forward and backward::

    stage 0 | F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3 ST
    stage 3 | .  .  .  F0 F1 F2 F3 B0 B1 B2 B3 ST

1F1B: stage k warms up with min(m, N-k) forwards, then alternates B and F::

    stage 0 | F0 F1 F2 F3 .  .  .  B0 .  B1 .  B2 .  B3 ST
    stage 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 ST

GPipe: Huang et al., 2019 (arXiv 1811.06965). 1F1B: Narayanan et al., PipeDream (SOSP 2019) and
PipeDream-2BW/Flush (ICML 2021, arXiv 2006.09503). Pure: no I/O.
"""

from __future__ import annotations

from pipeq.errors import ScheduleError
from pipeq.schedules.actions import STEP, Action, B, F, Schedule

__all__ = ["check_counts", "fill_drain", "one_f_one_b", "forward_only", "warmup_order"]


def check_counts(n_stages: int, n_microbatches: int) -> None:
    """Refuse a stage or microbatch count that is not a positive integer."""
    if type(n_stages) is not int or n_stages < 1:
        raise ScheduleError(f"need at least one stage, got n_stages={n_stages!r}")
    if type(n_microbatches) is not int or n_microbatches < 1:
        raise ScheduleError(f"need at least one microbatch, got n_microbatches={n_microbatches!r}")


def fill_drain(n_stages: int, n_microbatches: int) -> Schedule:
    """GPipe: every forward, then every backward, then the optimizer step."""
    check_counts(n_stages, n_microbatches)
    m = n_microbatches
    return [[F(j) for j in range(m)] + [B(j) for j in range(m)] + [STEP] for _ in range(n_stages)]


def warmup_order(n_microbatches: int, warmup: int) -> list[Action]:
    """``warmup`` forwards, then one backward and one forward in turn, then the last backwards."""
    m = n_microbatches
    warm = min(m, warmup)
    order = [F(j) for j in range(warm)]
    for i in range(m - warm):
        order += [B(i), F(warm + i)]
    return order + [B(j) for j in range(m - warm, m)]


def one_f_one_b(n_stages: int, n_microbatches: int) -> Schedule:
    """PipeDream-Flush: min(m, N-k) warm-up forwards on stage k, then one backward, one forward."""
    check_counts(n_stages, n_microbatches)
    return [warmup_order(n_microbatches, n_stages - k) + [STEP] for k in range(n_stages)]


def forward_only(n_stages: int, n_microbatches: int) -> Schedule:
    """Inference (``predict``): forwards only, no backward, no step."""
    check_counts(n_stages, n_microbatches)
    return [[F(j) for j in range(n_microbatches)] for _ in range(n_stages)]
