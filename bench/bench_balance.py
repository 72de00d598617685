"""Balanced stages: an unevenly sized layer stack, split by equal layer counts vs ``pipeq.balance``.

    python bench/bench_balance.py                  # 2 stages, 1F1B, 8 microbatches, 2 rounds: ~25 s
    python bench/bench_balance.py --stages 3 --steps 20

The model is 8 x (Linear + ReLU) whose widths shrink from 1024 to 256 halfway (16 layers; the
first four Linears cost 4-16x the last four). The equal-count split gives each stage 8 layers,
so stage 0 holds nearly all the work; ``pipeq.balance(model, N, one microbatch, by="time")``
measures each layer's forward + backward (one thread, as each stage runs) and moves the
boundary. Both splits train the same model in process mode (``threads_per_stage=1``,
forkserver), traced: steps/s is 1 / the median step time after warm-up, and the bubble (share
of a step's wall time a stage does not compute, averaged over stages; the ideal
(N-1)/(m+N-1) assumes equal stages) and each stage's compute per step come from the trace
(``pipeq.trace.analyze``).
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
from pipeq.trace import report
from pipeq.trace import format as trace

WIDTHS = (1024, 1024, 1024, 1024, 256, 256, 256, 256, 256)
BATCH, MICROBATCHES, WARMUP = 256, 8, 5


def uneven_model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(WIDTHS, WIDTHS[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers)


def equal_counts(n_layers: int, n_stages: int) -> list[int]:
    """The hand split: the same number of layers per stage (the first stages get the remainder)."""
    return [n_layers // n_stages + (k < n_layers % n_stages) for k in range(n_stages)]


def run(counts: list[int], steps: int, path: str) -> tuple[float, report.Report]:
    """(steps/s, the trace's report) of training the model split by ``counts``."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, WIDTHS[0], generator=g), torch.randn(BATCH, WIDTHS[-1], generator=g)
    runner = pipeq.PipelineRunner(uneven_model(), nn.MSELoss(), functools.partial(torch.optim.SGD, lr=1e-3),
                                  "1f1b", MICROBATCHES, balance=counts, threads_per_stage=1,
                                  start_method="forkserver", trace=path)
    times = []
    with runner:
        for _ in range(steps + WARMUP):
            t0 = time.perf_counter()
            runner.step(x, y)
            times.append(time.perf_counter() - t0)
    return 1 / statistics.median(times[WARMUP:]), report.analyze(trace.load_trace(path), skip_first=WARMUP)


def stage_line(name: str, counts: list[int], steps_per_s: float, rep: report.Report) -> str:
    compute = ", ".join(f"{t.compute_us / t.steps / 1e3:.1f}" for t in rep.stages)
    return (f"  {name:10s} {str(counts):12s} {steps_per_s:6.2f} steps/s   bubble {100 * rep.bubble:5.1f}% "
            f"(ideal {100 * rep.ideal_bubble:.1f}%)   compute per step by stage: {compute} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--steps", type=int, default=30, help="timed steps per split (after 5 warm-up steps)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of both splits, in alternating order")
    args = p.parse_args()
    torch.set_num_threads(1)  # as each stage process runs (threads_per_stage=1)
    model = uneven_model()
    sample = torch.randn(BATCH // MICROBATCHES, WIDTHS[0])
    t0 = time.perf_counter()
    costs = pipeq.balance.profile_times(model, sample)
    balanced = pipeq.balance.partition(costs, args.stages)
    measured = time.perf_counter() - t0
    equal = equal_counts(len(model), args.stages)
    print(f"{len(model)} layers, {args.stages} stages, 1F1B, {MICROBATCHES} microbatches of {BATCH // MICROBATCHES} "
          f"rows, {args.steps} timed steps; load average {os.getloadavg()[0]:.1f}")
    print(f"measured in {measured:.2f} s: per-layer forward+backward (ms) "
          + " ".join(f"{1e3 * c:.2f}" for c in costs))
    for name, counts in (("equal", equal), ("balanced", balanced)):
        sums = [1e3 * c for c in stage_sums(costs, counts)]
        print(f"  {name:10s} {str(counts):12s} measured stage costs per microbatch: "
              + ", ".join(f"{s:.2f}" for s in sums) + " ms")
    rates: dict[str, list[float]] = {"equal": [], "balanced": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = [("equal", equal), ("balanced", balanced)]
            for name, counts in order if r % 2 == 0 else order[::-1]:
                sps, rep = run(counts, args.steps, os.path.join(tmp, f"{name}-{r}.json"))
                rates[name].append(sps)
                print(stage_line(name, counts, sps, rep))
    ratio = statistics.median(rates["balanced"]) / statistics.median(rates["equal"])
    print(f"balanced / equal: {ratio:.2f}x steps/s")


def stage_sums(costs: list[float], counts: list[int]) -> list[float]:
    out, start = [], 0
    for c in counts:
        out.append(sum(costs[start:start + c]))
        start += c
    return out

if __name__ == "__main__":
    main()
