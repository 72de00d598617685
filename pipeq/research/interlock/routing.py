"""Interlocking backprop's gradient routing: which loss trains which stage, and what goes down.

With distance d, stage k's main module is trained by L_t(k), t(k) = min(k + d, N - 1); stage k
sends down the gradients (with respect to its input) of the losses the stages below it are
trained by. Pure: shared by the schedule (its plan) and the executor (its backward).
"""

from __future__ import annotations

__all__ = ["trained_by", "sends_down", "receives", "sends_early"]


def trained_by(k: int, n_stages: int, distance: int) -> int:
    """The loss that trains stage k's main module: L_min(k+d, N-1)."""
    return min(k + distance, n_stages - 1)


def sends_down(k: int, n_stages: int, distance: int) -> list[int]:
    """The losses whose gradient (w.r.t. its input) stage k sends to stage k-1, in order."""
    return sorted({trained_by(i, n_stages, distance) for i in range(max(0, k - distance), k)})


def receives(k: int, n_stages: int, distance: int) -> list[int]:
    """The losses whose gradient (w.r.t. its output) stage k receives from stage k+1, in order."""
    return sends_down(k + 1, n_stages, distance) if k + 1 < n_stages else []


def sends_early(k: int, n_stages: int, distance: int) -> bool:
    """Stage k's downward message is its own head's gradient only: sent right after its forward."""
    return 0 < k < n_stages - 1 and sends_down(k, n_stages, distance) == [k]
