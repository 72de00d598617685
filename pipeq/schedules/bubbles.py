"""Each built-in schedule's bubble in closed form, beside what its dry run gives.

The bubble here is a step's idle time per process: the step's length (to the STEP) minus one
process's own work, in the units of the costs F, I and W of one model stage (B = I + W; with
virtual stages, of one chunk). Every schedule takes the STEP in sync, so a process idles at least
(N-1)·F: the last stage's first forward waits for every stage before it. The zero-bubble
paper's ZB-H2 and ZB-V figures ((N-1)(F+I-2W), about 0 at F = I = W) remove that ramp with an
optimizer step that does not wait (its "post-validation"), which pipeq does not do; its formulas
below keep it. Sources: GPipe (arXiv 1811.06965), 1F1B (arXiv 2006.09503), interleaving
(Narayanan et al. 2021, arXiv 2104.04473), zero bubble (Qi et al. 2024, arXiv 2401.10241),
DualPipe (DeepSeek-V3, arXiv 2412.19437). Pure: no I/O.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

__all__ = ["Formula", "FORMULAS", "formula_of"]


class Formula(NamedTuple):
    """A bubble's closed form: its text, and its value at (N, F, I, W, B)."""

    text: str
    value: Callable[[int, float, float, float, float], float]


def _1f1b(n: int, f: float, i: float, w: float, b: float) -> float:
    return (n - 1) * (f + b)


_ONE_F_ONE_B = Formula("(N-1)(F+B)", _1f1b)
_ZB_H1 = Formula("(N-1)·max(F, F+I-W)", lambda n, f, i, w, b: (n - 1) * max(f, f + i - w))
_ZB_H2 = Formula("(N-1)·max(F, F+I-2W)", lambda n, f, i, w, b: (n - 1) * max(f, f + i - 2 * w))

#: by registered name (aliases too); the virtual schedules' in one chunk's costs
FORMULAS: dict[str, Formula] = {
    "fill-drain": _ONE_F_ONE_B, "gpipe": _ONE_F_ONE_B, "1f1b": _ONE_F_ONE_B,
    "interleaved-1f1b": _ONE_F_ONE_B, "interleaved": _ONE_F_ONE_B, "looped-bfs": _ONE_F_ONE_B,
    "zb-h1": _ZB_H1, "zb1p": _ZB_H1, "zb-h2": _ZB_H2, "zbv": _ZB_H2,
    "dualpipev": Formula("(N/2-1)(F&B+B-3W), F&B overlapped (pipeq runs the pair in turn)",
                         lambda n, f, i, w, b: (n / 2 - 1) * ((f + b) + b - 3 * w)),
}


def formula_of(name: str) -> Formula | None:
    """The closed form of the schedule registered as ``name`` (None: none known)."""
    base = name.split("(")[0]
    return FORMULAS.get(base)
