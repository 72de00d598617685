"""torch.distributed.pipelining (TDP) beside pipeq: one rank's body for ``bench_schedules.py``.

Every TDP schedule class the benchmark compares, with how many stages each rank holds and where:

    GPipe, 1F1B                       1 stage per rank (stage = rank)
    InterleavedZeroBubble             1 stage per rank: that is ZB-H1 (TDP's "ZB1P")
    Interleaved1F1B, LoopedBFS        2 stages per rank, looped: rank r holds r and r + N
    ZBVZeroBubble, DualPipeV          2 stages per rank, V: rank r holds r and 2N - 1 - r

:func:`child_tdp` runs in each of N spawned ranks (gloo on 127.0.0.1, one thread, pinned to core
r mod ncpu as pipeq pins its stages); it builds this rank's chunks with ``job["make"]``, a module
level function ``(stage index, n stages) -> nn.Module``, trains ``warmup + steps`` steps (zero_grad,
``schedule.step``, ``opt.step``, a barrier) and returns the step times, how far training moved
its parameters (the L1 norm of the update, a cross-check against pipeq's) and, on rank 0, the
schedule's compute order (TDP's own ``pipeline_order``: per rank, ``(stage, op, microbatch)``),
from which the benchmark computes the ideal of TDP's order when pipeq has no such schedule yet.
Importing this module imports nothing of torch.distributed.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any, Callable

import torch
from torch import nn

import bench_core
from pipeq.schedules.placement import stages_of

#: TDP class name -> (stages per rank, placement)
CLASSES: dict[str, tuple[int, str]] = {
    "ScheduleGPipe": (1, "loop"),
    "Schedule1F1B": (1, "loop"),
    "ScheduleInterleavedZeroBubble": (1, "loop"),
    "ScheduleInterleaved1F1B": (2, "loop"),
    "ScheduleLoopedBFS": (2, "loop"),
    "ScheduleZBVZeroBubble": (2, "v"),
    "ScheduleDualPipeV": (2, "v"),
}


def stage_ids(rank: int, world: int, chunks: int, placement: str) -> list[int]:
    """The TDP stage indices rank ``rank`` holds (its chunks in order): pipeq's placement."""
    return stages_of(rank, world, chunks, placement)


def compute_order(sched: Any, world: int) -> list[list[tuple[int, str, int]]] | None:
    """TDP's compute actions per rank as (stage, op, microbatch); OVERLAP_F_B is expanded into its
    parts (run one after the other, as on a CPU). None for single-stage classes (no order kept)."""
    order = getattr(sched, "pipeline_order", None)
    if not order:
        return None
    out: list[list[tuple[int, str, int]]] = []
    for r in range(world):
        acts: list[tuple[int, str, int]] = []
        for a in order[r]:
            for part in (a.sub_actions or (a,)) if a is not None else ():
                op = part.computation_type.value
                if op in ("F", "I", "W", "B"):
                    acts.append((part.stage_index, op, part.microbatch_index))
        out.append(acts)
    return out


def _build(job: dict, rank: int, world: int) -> tuple[Any, list[nn.Module], set[int], int]:
    """(schedule, this rank's modules, its stage ids, n stages) for ``job["cls"]``."""
    from torch.distributed import pipelining as tdp

    chunks, placement = CLASSES[job["cls"]]
    n_stages = chunks * world
    ids = stage_ids(rank, world, chunks, placement)
    mods = [job["make"](s, n_stages) for s in ids]
    stages = [tdp.PipelineStage(m, s, n_stages, torch.device("cpu")) for m, s in zip(mods, ids)]
    cls = getattr(tdp.schedules, job["cls"])
    kw = {"n_microbatches": job["microbatches"], "loss_fn": nn.MSELoss()}
    single = issubclass(cls, tdp.schedules.PipelineScheduleSingle)
    sched = cls(stages[0], **kw) if single else cls(stages, **kw)
    return sched, mods, set(ids), n_stages


def _one_step(sched: Any, opt: Any, ids: set[int], n_stages: int, x: torch.Tensor, y: torch.Tensor) -> None:
    args = (x,) if 0 in ids else ()
    kw: dict[str, Any] = {"target": y, "losses": [], "return_outputs": False} if n_stages - 1 in ids else {}
    opt.zero_grad(set_to_none=True)
    sched.step(*args, **kw)
    opt.step()


def child_tdp(rank: int, world: int, port: int, job: dict) -> dict:
    """One TDP rank: ``job`` = cls, make, microbatches, x, y, warmup, steps. Returns the step
    times (s, after warm-up) and the update's L1 norm, or ``error`` (the exception's first line) if the class refused or
    failed; rank 0 adds the compute ``order``."""
    bench_core._pin(rank)
    bench_core._threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=job.get("timeout", 120)))
    try:
        try:
            sched, mods, ids, n_stages = _build(job, rank, world)
        except Exception as e:  # the class refuses this configuration: every rank refuses alike
            return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"}
        params = [p for m in mods for p in m.parameters()]
        start = [p.detach().clone() for p in params]
        opt = torch.optim.SGD(params, lr=job.get("lr", 0.01))
        x, y = job["x"], job["y"]
        times = []
        dist.barrier()
        for _ in range(job["warmup"] + job["steps"]):
            t0 = time.perf_counter()
            _one_step(sched, opt, ids, n_stages, x, y)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        update = sum(float((p.detach() - p0).abs().double().sum()) for p, p0 in zip(params, start))
        out: dict[str, Any] = {"times": times[job["warmup"]:], "update": update}
        if rank == 0:
            out["order"] = compute_order(sched, world)
        return out
    finally:
        dist.destroy_process_group()


def run_tdp(cls: str, make: Callable[[int, int], nn.Module], world: int, x: torch.Tensor, y: torch.Tensor,
            microbatches: int, warmup: int, steps: int, timeout: float, run_group: Callable,
            free_port: Callable[[], int]) -> dict:
    """Rank 0's result of ``cls`` on ``world`` fresh ranks (bench_core's ``run_group``)."""
    job = {"cls": cls, "make": make, "microbatches": microbatches, "x": x, "y": y, "warmup": warmup,
           "steps": steps, "timeout": timeout}
    port = free_port()
    results = run_group(f"tdp-{cls}", child_tdp, world, lambda _r: (port, job), timeout)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return {"error": errors[0]}
    return {**results[0], "update": sum(r["update"] for r in results)}
