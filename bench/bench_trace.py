"""Tracing overhead: what recording every action costs, against the step time.

    python bench/bench_trace.py            # 5 rounds, alternating off/on, two model sizes
    python bench/bench_trace.py --rounds 9 --steps 400

Two measurements. (1) Direct: the cost of recording one action (two clock reads and a list
append, timed in this process) times the actions each stage records per step (counted in a real
trace), as a fraction of the step time. (2) End to end: the same 2-stage MLP (1F1B, 8
microbatches) trained without and with ``trace=``, in alternating order, comparing median step
times after warm-up; on a 2-core virtual machine this is noisy (a few percent either way), so
the direct figure is the one to hold against the target: tracing costs under 2% of the step time.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time

import torch
from torch import nn

import pipeq

WARMUP = 20


def stages(width: int, depth: int, n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    per = len(layers) // n
    return [nn.Sequential(*layers[k * per:(k + 1) * per]) for k in range(n)]


def run(width: int, depth: int, batch: int, steps: int, trace: str | None) -> float:
    """Median seconds per step (after warm-up)."""
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    runner = pipeq.PipelineRunner(
        stages(width, depth, 2), nn.MSELoss(), functools.partial(torch.optim.SGD, lr=1e-3),
        "1f1b", 8, threads_per_stage=1, start_method="forkserver", trace=trace,
    )
    times = []
    with runner:
        for _ in range(steps):
            t0 = time.perf_counter()
            runner.step(x, y)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[WARMUP:])


def recording_cost_ns(n: int = 200_000) -> float:
    """ns to record one action, exactly as the worker does it (clock, clock, append)."""
    rows: list = []
    rec = rows.append
    clock = time.perf_counter_ns
    t_start = time.perf_counter_ns()
    for j in range(n):
        t0 = clock()
        rec((0, 1, j, t0, clock(), 0))
    return (time.perf_counter_ns() - t_start) / n


def direct(width: int, depth: int, batch: int, steps: int, tmp: str) -> tuple[float, float, float]:
    """(actions per stage per step, recording us per stage-step, % of the step time)."""
    from pipeq.trace import format as trace

    path = os.path.join(tmp, "direct.json")
    step_s = run(width, depth, batch, steps, path)
    events = [e for e in trace.load_trace(path).events if e.training]
    per_stage_step = len(events) / (2 * steps)
    cost_us = per_stage_step * recording_cost_ns() / 1e3
    return per_stage_step, cost_us, 100 * cost_us / (step_s * 1e6)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    sizes = [("small (latency-bound)", 64, 6, 64), ("medium", 512, 6, 256)]
    print(f"tracing overhead: 2 stages, 1F1B, 8 microbatches, {args.steps} steps, {args.rounds} rounds")
    print(f"recording one action: {recording_cost_ns():.0f} ns")
    with tempfile.TemporaryDirectory() as tmp:
        for label, width, depth, batch in sizes:
            actions, cost_us, pct = direct(width, depth, batch, args.steps, tmp)
            print(f"  {label:22s} direct: {actions:.0f} actions per stage-step, {cost_us:.1f} us "
                  f"to record them = {pct:.2f}% of the step time")
            ratios, offs, ons = [], [], []
            for r in range(args.rounds):
                path = os.path.join(tmp, f"t{r}.json")
                order = [None, path] if r % 2 == 0 else [path, None]
                got = {}
                for trace in order:
                    got[trace is not None] = run(width, depth, batch, args.steps, trace)
                offs.append(got[False])
                ons.append(got[True])
                ratios.append(got[True] / got[False])
            print(f"  {label:22s} step {statistics.median(offs) * 1e3:7.3f} ms off, "
                  f"{statistics.median(ons) * 1e3:7.3f} ms on: overhead "
                  f"{(statistics.median(ratios) - 1) * 100:+.1f}% "
                  f"(rounds: {', '.join(f'{(q - 1) * 100:+.1f}%' for q in ratios)})")


if __name__ == "__main__":
    main()
