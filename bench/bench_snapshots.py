"""What in-memory snapshots cost per step: a streamed run without them, with 1 and with 10 per 100 steps.

    PYTHONPATH=. python bench/bench_snapshots.py                  # 3 stages of 2.1M parameters, Adam
    PYTHONPATH=. python bench/bench_snapshots.py --steps 200 --width 512 --repeats 2

Every configuration trains the same model on the same batches (``runner.stream``, 1F1B, one
thread per stage), from fresh processes; the timer covers the stream only (not the start). The
runs alternate (none, 1 per 100, 10 per 100, none, ...) so that drift on a shared machine falls
on all of them alike; each configuration's best and median time per step are printed, with
the snapshot's size and the extra time per step against no snapshots.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn

import pipeq


def stages(width: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU()) for _ in range(3)]


def adam(params):
    return torch.optim.Adam(params, lr=1e-4)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def one_run(width: int, steps: int, every: int, batch: int) -> tuple[float, int]:
    """Seconds per step of a stream of ``steps`` batches, snapshots every ``every`` steps (0:
    none); and the newest snapshot's bytes."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)) for _ in range(8)]
    runner = pipeq.PipelineRunner(stages(width), mse, adam, "1f1b", 4, threads_per_stage=1)
    with runner:
        runner.step(*data[0])  # warm: the first step allocates
        runner.keep_snapshots(every)
        t0 = time.perf_counter()
        for _ in runner.stream(data[i % len(data)] for i in range(steps)):
            pass
        seconds = time.perf_counter() - t0
        snap = runner.snapshot
    return seconds / steps, snap.nbytes if snap is not None else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    configs = {"none": 0, "1 per 100 steps": 100, "10 per 100 steps": 10}
    times: dict[str, list[float]] = {name: [] for name in configs}
    size = 0
    for _ in range(args.repeats):
        for name, every in configs.items():
            per_step, nbytes = one_run(args.width, args.steps, every, args.batch)
            times[name].append(per_step)
            size = max(size, nbytes)
    base = min(times["none"])
    print(f"3 stages of {sum(p.numel() for p in stages(args.width)[0].parameters()) / 1e6:.1f}M parameters, Adam: "
          f"a snapshot holds {size / 2**20:.0f} MiB; {args.steps} steps of {args.batch} x {args.width}, "
          f"1F1B, 4 microbatches, best of {args.repeats}")
    print(f"{'snapshots':<18} {'best ms/step':>12} {'median':>8} {'extra ms/step':>14} {'extra':>7}")
    for name, got in times.items():
        best = min(got)
        print(f"{name:<18} {best * 1e3:>12.2f} {statistics.median(got) * 1e3:>8.2f} "
              f"{(best - base) * 1e3:>14.2f} {(best - base) / base:>7.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
