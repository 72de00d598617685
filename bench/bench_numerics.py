"""What recomputation saves and costs, and what bf16 and clipping cost: peak memory and steps/s.

    python bench/bench_numerics.py                       # width 256, 8 layers a stage, batch 4096
    python bench/bench_numerics.py --batch 8192 --steps 5

Two stages of ``--layers`` x (Linear(W, W), ReLU), fill-drain with 8 microbatches (every
microbatch's activations are held until the backwards: recomputation's best case), process
mode, ``start_method="forkserver"``. Each configuration runs in a fresh runner: one warm-up step,
then ``runner.stats(reset_peak=True)`` and ``--steps`` timed steps; printed: each stage's peak
memory over the timed steps (``runner.stats()``: the stage process's peak resident set on the
CPU, CUDA's peak allocated bytes on a GPU), and the median step time.

Configurations: plain fp32; ``recompute=True``; ``precision="bf16"``; ``clip_grad_norm=1.0``
(one extra round trip of 16 bytes along the pipeline per step).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
from torch import nn

import pipeq


def stack(width: int, layers: int) -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])


def measure(options: dict, args: argparse.Namespace) -> tuple[list[int], float]:
    torch.manual_seed(0)
    stages = [stack(args.width, args.layers), nn.Sequential(stack(args.width, args.layers), nn.Linear(args.width, 10))]
    x, y = torch.randn(args.batch, args.width), torch.randint(0, 10, (args.batch,))
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.01),
                                  "fill-drain", 8, start_method="forkserver", **options)
    with runner:
        runner.step(x, y)
        runner.stats(reset_peak=True)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            runner.step(x, y)
            times.append(time.perf_counter() - t0)
        peaks = [s["peak_bytes"] for s in runner.stats()]
    return peaks, statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    configs = {"fp32": {}, "recompute": {"recompute": True}, "bf16": {"precision": "bf16"},
               "clip 1.0": {"clip_grad_norm": 1.0}}
    print(f"2 stages x {args.layers} x Linear({args.width}, {args.width}), batch {args.batch}, fill-drain, "
          f"8 microbatches; peak = each stage's peak memory over {args.steps} steps")
    print(f"{'config':>10} {'stage 0 MiB':>12} {'stage 1 MiB':>12} {'step ms':>9}")
    base = None
    for name, options in configs.items():
        peaks, step = measure(options, args)
        base = base or peaks
        saved = " ".join(f"{(b - q) / 2**20:+.0f}" for b, q in zip(base, peaks))
        print(f"{name:>10} {peaks[0] / 2**20:12.1f} {peaks[1] / 2**20:12.1f} {step * 1e3:9.1f}"
              + (f"   saved vs fp32 (MiB): {saved}" if name != "fp32" else ""))


if __name__ == "__main__":
    main()
