"""What a schedule's plan holds: each stage's peak of microbatches in flight, and each process's.

A stage keeps a microbatch's activations (what its backward needs: the tensors autograd saved,
the input it received, its output) from the microbatch's forward ``F`` until its backward is
done: a whole backward ``B`` frees them, and so does a weight gradient ``W``. An input gradient
``I`` frees nothing: it differentiates with respect to the stage's input and keeps the graph for
the ``W`` (:mod:`pipeq.stage.backprop`: ``torch.autograd.grad(..., retain_graph=True)``, freed by
the ``W``'s last call), so a zero-bubble schedule holds a microbatch from its ``F`` to its ``W``.

:func:`stage_in_flight` counts, walking each process's lowered actions in order, every model
stage's microbatches in flight and returns each stage's peak, in that stage's microbatches (1F1B
at N stages: N - k on stage k; fill-drain: m on every stage). A process holding several stages
(virtual stages: :mod:`pipeq.schedules.placement`) holds the sum of its chunks' levels at each
moment; :func:`process_peaks` gives each process's peak of that sum with a weight per chunk (a
chunk's bytes per microbatch gives bytes; ``1/v`` gives whole stages' microbatches, as
:func:`pipeq.schedules.choose.peak_memory` counts them). A process's peak is at most the sum of
its chunks' peaks, and less where they do not peak together (a V's chunk 0 peaks early, its
chunk 1 late).

:func:`in_flight_peaks` is the one-call form: a schedule (a name, an object or a function), the
model's stage count and the microbatches, as the runner and ``pipeq schedule NAME --memory`` use
it. Predicted activation bytes are these counts times the bytes one microbatch keeps, which the
stages measure (``runner.memory()``). Pure: no I/O.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

from pipeq.schedules.actions import Action, Op, Schedule
from pipeq.schedules.plan import build, process_stages

__all__ = ["FREES", "levels", "stage_in_flight", "process_peaks", "in_flight_peaks"]

#: the compute ops that free a microbatch's activations (an ``I`` keeps them for its ``W``)
FREES = (Op.BACKWARD, Op.WEIGHT_GRAD)


def levels(acts: Sequence[Action]) -> Iterator[tuple[int, int]]:
    """Walking one process's actions: after each forward and each freeing op, (chunk, the number
    of that chunk's microbatches in flight now)."""
    level: dict[int, int] = {}
    for a in acts:
        if a.op is Op.FORWARD:
            level[a.chunk] = level.get(a.chunk, 0) + 1
        elif a.op in FREES:
            level[a.chunk] = level.get(a.chunk, 0) - 1
        else:
            continue
        yield a.chunk, level[a.chunk]


def stage_in_flight(lowered: Schedule, stages: Sequence[Sequence[int]] | None = None) -> list[int]:
    """Each model stage's peak of microbatches in flight (forwarded, its ``B`` or ``W`` not yet
    done), in stage order. ``lowered``: one action list per process (:func:`~pipeq.schedules.build`'s);
    ``stages[p][c]``: the model stage chunk c of process p holds (default: process p holds stage p)."""
    where = stages if stages is not None else [[p] for p in range(len(lowered))]
    peak = [0] * sum(len(held) for held in where)
    for p, acts in enumerate(lowered):
        for c, level in levels(acts):
            k = where[p][c]
            peak[k] = max(peak[k], level)
    return peak


def process_peaks(lowered: Schedule, weight: Callable[[int, int], float] | None = None) -> list[float]:
    """Each process's peak of what its chunks hold together: the sum over chunk c of process p of
    ``weight(p, c)`` x (c's microbatches in flight), at its highest over the step (default weight
    1: microbatches of any chunk)."""
    out = []
    for p, acts in enumerate(lowered):
        held: dict[int, float] = {}
        peak = 0.0
        for c, level in levels(acts):
            held[c] = level * (weight(p, c) if weight is not None else 1.0)
            peak = max(peak, sum(held.values()))
        out.append(peak)
    return out


def in_flight_peaks(schedule: Any, n_stages: int, n_microbatches: int) -> list[int]:
    """Each model stage's peak of microbatches in flight in ``schedule``'s training plan at
    ``n_stages`` model stages (v·N for a schedule of v stages per process) and ``n_microbatches``:
    what ``pipeq schedule NAME --memory`` prints, and what ``runner.memory()`` predicts from."""
    return stage_in_flight(build(schedule, n_stages, n_microbatches), process_stages(schedule, n_stages))
