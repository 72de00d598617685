"""How the fixed cost per action grows with microbatches and stages (issue 41's "Scale").

    PYTHONPATH=$PWD python bench/bench_action_overhead.py --scale                  # ~1-2 min
    PYTHONPATH=$PWD python bench/bench_action_overhead.py --scale --schedule zb-h1 --steps 4

Three tables, every stage a zero-cost :class:`pipeq.testing.SleepStage` (sleeps of 0 s), 8 x 16
float32 microbatches:

- **process mode** (N = 2, 4, 8 stage processes on this host, m = 8, 32, 128): per compute action
  (F, B, I, W), the stage processes' CPU time (all their threads, from /proc: Python, autograd,
  codec, transport, the spin-polling while waiting) per step over the step's compute actions; and
  the wall time per critical-path slot, the step's wall time over the plan's critical path in
  actions (its dry run with every compute action costing 1: 1F1B 2(m+N-1), ZB-H1 3m+N-1). The
  CPU is the scheduler's nanosecond count (/proc/PID/task/TID/schedstat); a point runs at least
  ``--steps`` timed steps and at least 2048 compute actions (m = 8 on 2 processes: 64 steps).
  N = 4 and 8 on 2 cores are oversubscribed: their wall time is CPU-bound, so the wall per
  slot grows with the plan's compute actions per slot (printed too: 2.9 at m = 8 to 3.9 at
  m = 128 for 1F1B on 4 processes, as the pipeline's fill and drain shrink against its steady
  state) while the CPU per action stays flat; the last table, the cores the stages kept busy
  (CPU over wall), closes the sum: wall per slot = CPU per action x actions per slot / busy cores.
- **simulated mode** (N = 2 ... 16, every stage in this process: the interpreter, the executors
  and autograd without any transport; the stages' sleeps skipped): CPU us per compute action.
- **plan**: CPU us per action of building the plan (``pipeq.schedules.build``: the schedule,
  lowering, validation), once per (m, training) and then cached by the runtime.

Each table ends with the ratio m=128 / m=8 per N: flat is 1.00; above 1.20 is growth faster than
linear in the number of actions (marked ``!``).
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from typing import Any, Callable

import torch
from torch import nn

from pipeq.testing import SleepStage

__all__ = ["descendants_cpu", "descendants_cpu_ns", "plan_shape", "process_point", "simulated_point", "plan_point",
           "main_scale"]

ROWS, WIDTH = 8, 16
MS = (8, 32, 128)
NS = (2, 4, 8)
SIM_NS = (2, 4, 8, 16)
COMPUTE = ("F", "B", "I", "W")
MIN_ACTIONS = 2048  # a process-mode point times at least this many compute actions (more steps when short)


def descendants_cpu() -> dict[str, float]:
    """The CPU seconds (user + system) so far of this process's live descendants, by thread name
    (``pipeq-stage``: the stages' main threads; ``ZMQbg/IO/0``...) and user / system."""
    tick = os.sysconf("SC_CLK_TCK")
    cpu: dict[str, float] = {}
    for p in _descendants():
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/stat") as f:
                    head, rest = f.read().rsplit(")", 1)
                fields = rest.split()
                name = head.split("(", 1)[1]
                name = "pipeq-stage" if name.startswith("pipeq-stage") else name
                cpu[name + " user"] = cpu.get(name + " user", 0.0) + int(fields[11]) / tick
                cpu[name + " sys"] = cpu.get(name + " sys", 0.0) + int(fields[12]) / tick
        except OSError:
            continue
    return cpu


def descendants_cpu_ns() -> int:
    """The CPU nanoseconds so far of this process's live descendants, every thread, from
    /proc/PID/task/TID/schedstat (the scheduler's own count: nanoseconds, where /proc's stat counts
    10 ms ticks)."""
    total = 0
    for p in _descendants():
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total


def _descendants() -> set[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
    mine, todo = set(), [os.getpid()]
    while todo:
        p = todo.pop()
        for child, parent in parents.items():
            if parent == p and child not in mine:
                mine.add(child)
                todo.append(child)
    return mine


def plan_shape(schedule: str, n: int, m: int) -> tuple[int, int, int]:
    """(compute actions per step over all processes, all actions, critical path in slots) of
    ``schedule`` on ``n`` processes: its plan, dry-run with every compute action costing 1."""
    from pipeq import schedules
    from pipeq.schedules import Op

    v = schedules.resolve(schedule).stages_per_process
    lowered = schedules.build(schedule, n * v, m)
    held = schedules.process_stages(schedule, n * v)
    unit = {Op.FORWARD: 1, Op.BACKWARD: 1, Op.INPUT_GRAD: 1, Op.WEIGHT_GRAD: 1, Op.STEP: 0}
    timeline = schedules.dry_run(lowered, cost=unit, stages=held)
    slots = max(t + unit.get(a.op, 0) for row in timeline for t, a in row)
    compute = sum(1 for acts in lowered for a in acts if a.op.value in COMPUTE)
    return compute, sum(len(acts) for acts in lowered), int(slots)


def _stages(schedule: str, n: int) -> tuple[list[nn.Module], dict[str, Any]]:
    from pipeq import schedules

    v = schedules.resolve(schedule).stages_per_process
    split = any(c in schedule for c in ("zb", "dualpipe"))
    stages: list[nn.Module] = [SleepStage(WIDTH, 0.0, 0.0, weight_s=0.0 if split else None) for _ in range(n * v)]
    return stages, ({"stages_per_process": v} if v > 1 else {})


def _data(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(m * ROWS, WIDTH, generator=g), torch.randn(m * ROWS, WIDTH, generator=g)


def process_point(schedule: str, n: int, m: int, warmup: int, steps: int, spin: float | None = None
                  ) -> dict[str, float]:
    """One (N, m) in process mode: CPU us per compute action (stage processes), wall us per slot."""
    from pipeq import PipelineRunner

    stages, kw = _stages(schedule, n)
    if spin is not None:
        kw["spin"] = spin
    x, y = _data(m)
    compute, _, slots = plan_shape(schedule, n, m)
    steps = max(steps, -(-MIN_ACTIONS // compute))  # short steps: more of them
    times = []
    with PipelineRunner(stages, nn.MSELoss(), functools.partial(torch.optim.SGD, lr=0.01), schedule=schedule,
                        microbatches=m, threads_per_stage=1, **kw) as runner:
        for i in range(warmup + steps):
            if i == warmup:
                before = descendants_cpu_ns()
            t0 = time.perf_counter()
            runner.step(x, y)
            times.append(time.perf_counter() - t0)
        cpu = (descendants_cpu_ns() - before) / 1e9 / steps
    wall = statistics.median(times[warmup:])
    return {"cpu_us": 1e6 * cpu / compute, "slot_us": 1e6 * wall / slots, "step_ms": 1e3 * wall,
            "actions": compute, "slots": slots, "per_slot": compute / slots, "busy": cpu / wall}


def simulated_point(schedule: str, n: int, m: int, warmup: int, steps: int) -> dict[str, float]:
    """One (N, m) in simulated mode (the stages' sleeps skipped): CPU us per compute action."""
    import pipeq.testing
    from pipeq import PipelineRunner

    stages, kw = _stages(schedule, n)
    x, y = _data(m)
    compute, _, _ = plan_shape(schedule, n, m)
    sleep = pipeq.testing.time.sleep
    pipeq.testing.time.sleep = lambda s: None  # type: ignore[assignment]
    try:
        with PipelineRunner(stages, nn.MSELoss(), functools.partial(torch.optim.SGD, lr=0.01), schedule=schedule,
                            microbatches=m, mode="simulated", **kw) as runner:
            cpu = []
            for i in range(warmup + steps):
                t0 = time.process_time()
                runner.step(x, y)
                cpu.append(time.process_time() - t0)
    finally:
        pipeq.testing.time.sleep = sleep  # type: ignore[assignment]
    return {"cpu_us": 1e6 * statistics.median(cpu[warmup:]) / compute, "actions": compute}


def plan_point(schedule: str, n: int, m: int, repeat: int = 3) -> dict[str, float]:
    """CPU us per action (all actions, communication too) of building the plan, the best of ``repeat``."""
    from pipeq import schedules

    v = schedules.resolve(schedule).stages_per_process
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        lowered = schedules.build(schedule, n * v, m)
        best = min(best, time.process_time() - t0)
    return {"cpu_us": 1e6 * best / sum(len(a) for a in lowered), "actions": sum(len(a) for a in lowered)}


def _table(title: str, ns: tuple[int, ...], got: dict[tuple[int, int], dict[str, float]], key: str,
           fmt: str = "{:.1f}", mark: bool = True) -> str:
    head = ["N \\ m", *(str(m) for m in MS), "128/8"]
    rows = []
    for n in ns:
        vals = [got.get((n, m), {}).get(key) for m in MS]
        ratio = vals[-1] / vals[0] if vals[0] and vals[-1] else None
        flag = " !" if mark and ratio is not None and ratio > 1.2 else ""
        rows.append([str(n), *("-" if v is None else fmt.format(v) for v in vals),
                     "-" if ratio is None else f"{ratio:.2f}{flag}"])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = "  ".join("{:>%d}" % w for w in widths)
    return "\n".join([title, line.format(*head), *(line.format(*r) for r in rows)])


def main_scale(schedule: str, warmup: int, steps: int, spin: float | None = None,
               say: Callable[[str], None] = print) -> dict[str, Any]:
    """The three tables (see the module); returns their numbers."""
    torch.set_num_threads(1)
    say(f"scale: {schedule}, zero-cost stages, {warmup} warm-up + {steps} timed steps per point"
        f"{'' if spin is None else f', spin={spin:g}'}; "
        f"load {os.getloadavg()[0]:.2f} (a shared machine: wall figures are noisy, CPU figures less so)")
    plan = {(n, m): plan_point(schedule, n, m) for n in SIM_NS for m in MS}
    say(_table("plan: CPU us per action to build (schedules.build), once per (m, training)", SIM_NS, plan,
               "cpu_us", "{:.2f}"))
    sim = {(n, m): simulated_point(schedule, n, m, warmup, steps) for n in SIM_NS for m in MS}
    say(_table("simulated mode: CPU us per compute action (interpreter + executor + autograd, one process)",
               SIM_NS, sim, "cpu_us"))
    proc: dict[tuple[int, int], dict[str, float]] = {}
    for n in NS:
        for m in MS:
            proc[(n, m)] = process_point(schedule, n, m, warmup, steps, spin)
    say(_table("process mode: CPU us per compute action (all stage processes' threads)", NS, proc, "cpu_us"))
    say(_table("process mode: wall us per critical-path slot (step / plan's slots)", NS, proc, "slot_us", "{:.0f}"))
    say(_table("the plan's compute actions per slot (how many run at once: with more processes than cores the "
               "wall per slot grows with it)", NS, proc, "per_slot", "{:.2f}", mark=False))
    say(_table("process mode: cores the stage processes kept busy (their CPU / wall; wall per slot = CPU per "
               "action x actions per slot / this)", NS, proc, "busy", "{:.2f}", mark=False))
    return {"plan": plan, "simulated": sim, "process": proc}
