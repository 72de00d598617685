"""What a schedule's plan holds: each stage's peak of microbatches in flight, and each process's.

A stage keeps a microbatch's activations (what its backward needs: the tensors autograd saved,
the input it received, its output) from the microbatch's forward ``F`` until its backward is
done: a whole backward ``B`` frees them, and so does a weight gradient ``W``. An input gradient
``I`` frees part: it differentiates with respect to the stage's input and keeps for the ``W`` only
what the ``W`` computes from (:mod:`pipeq.stage.backprop`, :mod:`pipeq.stage.memory`: a Linear's
input, a LayerNorm's input and statistics) and the gradients the ``W`` starts from; so a
zero-bubble schedule holds a microbatch from its ``F`` to its ``W``, after its ``I`` with other
bytes than after its ``F`` (fewer where non-linear operations saved much, such as attention's
probabilities; more where the weight gradients' inputs dominate).

:func:`stage_in_flight` counts, walking each process's lowered actions in order, every model
stage's microbatches in flight and returns each stage's peak, in that stage's microbatches (1F1B
at N stages: N - k on stage k; fill-drain: m on every stage); :func:`in_flight_peaks` is its
one-call form (a schedule, the model's stage count and the microbatches), as ``pipeq schedule
NAME --memory`` and the runner use it. A process holding several stages (virtual stages:
:mod:`pipeq.schedules.placement`) holds the sum of its chunks' at each moment; its peak is at most
the sum of its chunks' peaks, and less where they do not peak together (a V's chunk 0 peaks
early, its chunk 1 late).

In bytes (:func:`peak_bytes`), a stage's microbatch weighs what it holds after its ``F``, what it
holds after its ``I`` until its ``W``, and, while its ``B`` or ``I`` runs, what the backward adds
on top (a recomputed forward; an ``I``'s gradients for the ``W`` beside its outputs, for a moment):
:class:`StageBytes`; the stages measure each (``runner.memory()``). :func:`peaks` is
the walk they all share, with any weighing. With each stage's static bytes too (parameters,
gradients, optimizer state: a :class:`Footprint`), :func:`process_bytes` predicts each process's
whole peak, what ``schedule="auto"`` holds against ``auto_memory_limit``. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

from pipeq.schedules.actions import Op, Schedule
from pipeq.schedules.plan import build, process_stages
from pipeq.schedules.registry import resolve, schedule_name

__all__ = ["Weigh", "StageBytes", "Footprint", "peaks", "stage_in_flight", "process_peaks", "in_flight_peaks",
           "peak_bytes", "process_bytes", "format_memory", "size"]

#: what a stage holds: ``weigh(stage, forwarded, waiting, running)``, with ``forwarded`` its
#: microbatches forwarded and not yet backpropagated, ``waiting`` those past their ``I`` and
#: waiting for their ``W``, and ``running`` the ``B`` or ``I`` of it that runs now (``Op.BACKWARD``,
#: ``Op.INPUT_GRAD``; the microbatch still counts as forwarded), else None
Weigh = Callable[[int, int, int, "Op | None"], float]


def _count(stage: int, forwarded: int, waiting: int, running: Op | None) -> float:
    return forwarded + waiting


def peaks(lowered: Schedule, stages: Sequence[Sequence[int]] | None = None,
          weigh: Weigh = _count) -> tuple[list[float], list[float]]:
    """(each model stage's peak, each process's peak) of what ``weigh`` says it holds, walking
    each process's lowered actions (``lowered``: one list per process, :func:`~pipeq.schedules.build`'s)
    in order; ``stages[p][c]``: the model stage chunk c of process p holds (default: its own
    number, ``p * v + c``). A process's value at a moment is the sum of its chunks'. Default
    weighing: microbatches in flight."""
    v = 1 + max((a.chunk for acts in lowered for a in acts), default=0)
    where = stages if stages is not None else [[p * v + c for c in range(v)] for p in range(len(lowered))]
    stage_peak = [0.0] * (1 + max((k for held in where for k in held), default=-1))
    process_peak = []
    for p, acts in enumerate(lowered):
        fwd: dict[int, int] = {}
        wait: dict[int, int] = {}
        held: dict[int, float] = {}  # chunk -> what it holds now
        top = 0.0
        for a in acts:
            op, c = a.op, a.chunk
            if op not in (Op.FORWARD, Op.BACKWARD, Op.INPUT_GRAD, Op.WEIGHT_GRAD):
                continue
            k = where[p][c]
            f, w = fwd.get(c, 0), wait.get(c, 0)
            if op is Op.FORWARD:
                f += 1
            elif op is not Op.WEIGHT_GRAD:  # while a B or an I runs
                during = weigh(k, f, w, op)
                stage_peak[k] = max(stage_peak[k], during)
                top = max(top, sum(held.values()) - held.get(c, 0.0) + during)
                f, w = f - 1, w + (op is Op.INPUT_GRAD)
            else:
                w -= 1
            fwd[c], wait[c] = f, w
            held[c] = now = weigh(k, f, w, None)
            stage_peak[k] = max(stage_peak[k], now)
            top = max(top, sum(held.values()))
        process_peak.append(top)
    return stage_peak, process_peak


def stage_in_flight(lowered: Schedule, stages: Sequence[Sequence[int]] | None = None) -> list[int]:
    """Each model stage's peak of microbatches in flight (forwarded, its ``B`` or ``W`` not yet
    done), in stage order (see :func:`peaks` for the arguments)."""
    return [int(x) for x in peaks(lowered, stages)[0]]


def process_peaks(lowered: Schedule, weight: Callable[[int, int], float] | None = None) -> list[float]:
    """Each process's peak of its chunks' microbatches in flight together, chunk c of process p
    weighing ``weight(p, c)`` (default 1; ``1/v``: in whole stages' microbatches, as
    :func:`pipeq.schedules.choose.peak_in_flight` counts them)."""
    if weight is None:
        return peaks(lowered)[1]
    v = 1 + max((a.chunk for acts in lowered for a in acts), default=0)
    return peaks(lowered, None, lambda k, f, w, b: (f + w) * weight(k // v, k % v))[1]


def in_flight_peaks(schedule: Any, n_stages: int, n_microbatches: int) -> list[int]:
    """Each model stage's peak of microbatches in flight in ``schedule``'s training plan at
    ``n_stages`` model stages (v·N for a schedule of v stages per process) and ``n_microbatches``:
    what ``pipeq schedule NAME --memory`` prints, and what ``runner.memory()`` predicts from."""
    return stage_in_flight(build(schedule, n_stages, n_microbatches), process_stages(schedule, n_stages))


class StageBytes(NamedTuple):
    """What one microbatch of a stage holds, in bytes: after its ``F`` (``forward``), after its
    ``I`` until its ``W`` (``waiting``; None: as after its ``F``), and on top of its ``F``'s while
    its ``B`` runs (``in_backward``: a recomputed forward) or as its ``I`` ends (``in_input_grad``:
    a recomputed forward, the gradients kept for the ``W`` beside the outputs not yet freed)."""

    forward: float
    waiting: float | None = None
    in_backward: float = 0.0
    in_input_grad: float = 0.0


class Footprint(NamedTuple):
    """What each model stage was measured to hold: ``static[k]`` bytes all step (its parameters,
    their gradients, its optimizer state) and ``per_stage[k]``, what each of its microbatches in
    flight holds (:class:`StageBytes`)."""

    static: Sequence[float]
    per_stage: Sequence[StageBytes]


def _weigh(per_stage: Sequence[StageBytes]) -> Weigh:
    def weigh(k: int, f: int, w: int, running: Op | None) -> float:
        b = per_stage[k]
        extra = b.in_backward if running is Op.BACKWARD else b.in_input_grad if running is Op.INPUT_GRAD else 0.0
        return f * b.forward + w * (b.forward if b.waiting is None else b.waiting) + extra

    return weigh


def peak_bytes(schedule: Any, n_stages: int, n_microbatches: int,
               per_stage: Sequence[StageBytes]) -> tuple[list[float], list[float]]:
    """(each model stage's, each process's) predicted activation peak in bytes: ``schedule``'s
    plan walked (:func:`peaks`) with each stage's microbatch weighing ``per_stage[k]``."""
    return peaks(build(schedule, n_stages, n_microbatches), process_stages(schedule, n_stages), _weigh(per_stage))


def process_bytes(lowered: Schedule, where: Sequence[Sequence[int]], footprint: Footprint) -> list[float]:
    """Each process's predicted peak in bytes under ``lowered`` (``where[p]``: process p's model
    stages): its stages' static bytes plus the peak of their activations (as :func:`peak_bytes`);
    what ``schedule="auto"`` holds against ``auto_memory_limit`` (:mod:`pipeq.schedules.choose`)."""
    acts = peaks(lowered, where, _weigh(footprint.per_stage))[1]
    return [sum(footprint.static[k] for k in held) + a for held, a in zip(where, acts)]


def size(n: int | float | None) -> str:
    """Bytes as people read them: ``512 B``, ``1.5 KiB``, ``3.2 MiB``, ``2.0 GiB``; ``-`` for None."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_memory(schedule: Any, n_processes: int, n_microbatches: int) -> str:
    """What ``pipeq schedule NAME --stages N --microbatches M --memory`` prints: each model stage's
    peak of microbatches in flight and, with several stages per process, each process's peak of
    its stages together in whole stages' microbatches (a chunk of v weighs 1/v) beside 1F1B's on
    the same N processes (min(N, M), on stage 0)."""
    policy = resolve(schedule)
    v = policy.stages_per_process
    lowered = build(policy, n_processes * v, n_microbatches)
    where = process_stages(policy, n_processes * v)
    per_stage = stage_in_flight(lowered, where)
    what = f"{n_processes} stages" if v == 1 else f"{n_processes} processes x {v} stages"
    lines = [f"{schedule_name(schedule)}, {what}, {n_microbatches} microbatches: each stage's peak of microbatches "
             "in flight (from its F to its B, or to its W: an I keeps them)"]
    at = {k: (p, c) for p, held in enumerate(where) for c, k in enumerate(held)}
    lines += [f"  stage {k}: {n}" + (f"  (process {at[k][0]}, chunk {at[k][1]})" if v > 1 else "")
              for k, n in enumerate(per_stage)]
    if v > 1:
        one = min(n_processes, n_microbatches)
        for p, value in enumerate(process_peaks(lowered, lambda p, c: 1 / v)):
            lines.append(f"  process {p} (stages {', '.join(map(str, where[p]))}): {value:g} whole stages' "
                         f"microbatches at once, {value / one:.2f}x 1F1B's {one}")
    return "\n".join(lines)
