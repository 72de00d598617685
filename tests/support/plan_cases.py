"""Plan cases: what a stage's action list holds at its peak (not a test module)."""

from __future__ import annotations

from pipeq.schedules import Op


def peak_in_flight(acts) -> int:
    """Microbatches forwarded and not yet through their W (or B): the activations a stage holds."""
    live = peak = 0
    for a in acts:
        live += a.op is Op.FORWARD
        live -= a.op in (Op.BACKWARD, Op.WEIGHT_GRAD)
        peak = max(peak, live)
    return peak
