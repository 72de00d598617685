"""``schedule="auto"``: profile the stages for two steps on copies, then run the schedule their costs favour.

The runner settles the schedule at the first ``step(x, target)`` (timing anything needs a batch),
before any stage process starts: :func:`decide` runs two ZB-H1 steps of the stages in this process
(:class:`~pipeq.runtime.simulated.SimulatedBackend`, on deep copies: the user's modules, the
optimizers the run will build and the global torch RNG state are left as they were; a recipe's
stages are built here for it), takes each stage's mean F, I and W times from the second step's
trace rows and hands them to :func:`pipeq.schedules.choose.choose` with one stage per process (the
stages are given: a schedule of two stages per process would change the process count, so those
are not candidates). The runner prints the ranking once (stderr), keeps it as
``runner.auto_choice``, and starts with the winner (possibly ``zb-search``, a searched plan).

With ``auto_memory_limit`` the same profile also measures what each stage holds (its
``runner.memory()`` figures, :mod:`pipeq.stage.memory`): its parameters, their gradients and its
optimizer state (:func:`footprint`: the static bytes), and the activations one microbatch keeps
for its backward; :func:`~pipeq.schedules.choose.choose` then keeps the schedules whose every
process's predicted peak is within the limit (:mod:`pipeq.control.memory_limit`).

Limits: the profile times compute only (one process: no message costs, ``hop`` 0). Whatever needs
the running pipeline before a first ``step`` (``predict``, ``stream``, ``state_dict``,
``load_state_dict``...) settles it unprofiled, as do data- or tensor-parallel and multi-host runs:
ZB-H1 (1F1B's memory, never slower than 1F1B at equal costs).
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch

from pipeq.control.memory_limit import MemoryLimitError
from pipeq.control.reports import stage_bytes
from pipeq.errors import ScheduleError
from pipeq.schedules import Op
from pipeq.schedules.choose import Budget, Choice, choose, stage_cost
from pipeq.schedules.memory import Footprint
from pipeq.trace.format import OP_OF_CODE

__all__ = ["AUTO", "FALLBACK", "PROFILE_STEPS", "is_auto", "costs_of", "footprint", "profile", "decide"]

#: the schedule name that asks for this, and the schedule the run is checked and built with until then
AUTO, FALLBACK = "auto", "zb-h1"
PROFILE_STEPS = 2
_TIMED = (Op.FORWARD, Op.BACKWARD, Op.INPUT_GRAD, Op.WEIGHT_GRAD)  # what a stage's costs are made of


def is_auto(schedule: Any) -> bool:
    """Whether ``schedule`` is ``"auto"``."""
    return isinstance(schedule, str) and schedule == AUTO


def costs_of(rows: Sequence[Sequence[tuple[int, ...]]]) -> list[dict[Op, float]]:
    """Each stage's mean F, I, W (and B) times in ms from its trace rows' last step."""
    out = []
    for stage_rows in rows:
        last = max((r[1] for r in stage_rows), default=0)
        times: dict[Op, list[float]] = {}
        for code, step, _, start, end, *_ in stage_rows:
            if step == last and OP_OF_CODE.get(code) in _TIMED:
                times.setdefault(OP_OF_CODE[code], []).append((end - start) / 1e6)
        out.append({op: sum(t) / len(t) for op, t in times.items()})
    return out


def footprint(figures: Sequence[dict[str, Any]]) -> Footprint:
    """What each stage holds, from its figures after a profiled step (:mod:`pipeq.stage.memory`):
    static, its parameters, their gradients (kept after a step until the next one clears them)
    and its optimizer state; per microbatch in flight, what the profile's ZB-H1 step measured it
    to hold after its ``F``, and after its ``I`` until its ``W`` (:func:`~pipeq.control.reports.stage_bytes`)."""
    return Footprint([float(f["param_bytes"] + f["grad_bytes"] + f["optimizer_bytes"]) for f in figures],
                     [stage_bytes(f) for f in figures])


def profile(specs: Sequence[Any], numerics: Any, device: str, shards: Any, x: Any, target: Any,
            inputs: Any = None, steps: int = PROFILE_STEPS,
            measure: bool = False) -> tuple[list[dict[Op, float]], Footprint | None]:
    """Run ``steps`` ZB-H1 steps of ``specs`` (copies) in this process: each stage's costs (ms)
    and, with ``measure``, what each holds (:func:`footprint`)."""
    from pipeq.runtime.simulated import SimulatedBackend

    rng = torch.random.get_rng_state()
    try:
        backend = SimulatedBackend(specs, FALLBACK, device, numerics)  # deep-copies every spec
        backend.trace_rows = [[] for _ in specs]
        for step in range(1, steps + 1):
            backend.submit(step, shards, x, target, False, inputs)
            backend.result(step)
        held = footprint(backend.stats()) if measure else None
    finally:
        torch.random.set_rng_state(rng)
    return costs_of(backend.trace_rows), held


def _specs(model: Any, n_stages: int) -> list[Any]:
    """The stages to profile: the runner's, or a recipe's built here (RNG restored by the caller)."""
    if model.builder is None:
        return list(model.replicas[0])
    builder = model.builder.for_schedule(FALLBACK)
    return [builder.build(k, n_stages) for k in range(n_stages)]


def decide(model: Any, numerics: Any, n_stages: int, microbatches: int, batch: tuple[Any, ...] | None,
           *, device: str = "cpu", can_profile: bool = True, stages_per_process: int = 1,
           byte_limit: float | None = None) -> Choice:
    """The choice for the run: profiled with ``batch`` = (shards, x, target, inputs) when given
    and ``can_profile``, else at equal unit costs (which chooses ZB-H1, or with several stages
    per process the best of those schedules); among the schedules of ``stages_per_process``;
    with ``byte_limit`` (bytes per process; profiled runs only), those whose every process fits."""
    costs: list[dict[Op, float]] = [stage_cost(1.0, 1.0, 1.0)] * n_stages
    budget = None
    if batch is not None and can_profile:
        rng = torch.random.get_rng_state()
        try:
            specs = _specs(model, n_stages)
        finally:
            torch.random.set_rng_state(rng)
        shards, x, target, inputs = batch
        costs, held = profile([copy.deepcopy(s) for s in specs], numerics, device, shards, x, target, inputs,
                              measure=byte_limit is not None)
        costs = [{op: max(t, 1e-6) for op, t in c.items()} for c in costs]  # a stage of no work: still a stage
        budget = Budget(byte_limit, held) if held is not None and byte_limit is not None else None
    v = stages_per_process
    try:
        return choose(costs, n_stages // v, microbatches, stages_per_process=v, budget=budget)
    except ScheduleError as exc:
        if budget is None:
            raise
        raise MemoryLimitError(f"auto_memory_limit: {exc}; raise the limit, or cut the model into more stages, "
                               "or use fewer microbatches") from None
