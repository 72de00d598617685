"""Trace the same model under different schedules and draw what happened.

    python examples/trace_schedules.py                 # writes runs/traces/trace-<schedule>.{json,png}
    python examples/trace_schedules.py --out /tmp/traces --schedules 1f1b pairwise
    python examples/trace_schedules.py --out docs/traces   # refresh the docs' pictures (tracked files)

The model: 4 processes of fixed cost (pipeq.testing.SleepStage: forward 10 ms, backward 20 ms:
input gradient 10 ms and weight gradient 10 ms, which the zero-bubble schedules run apart; a
schedule of v stages per process cuts it into 4v stages of 1/v the cost each; pairwise
interlocking adds a Linear head per stage but the last), so the pictures show the schedule and
pipeq's own overhead, not CPU contention on a small machine. Each run trains 3 steps of 8
microbatches with ``trace=``; the last step is drawn and the report (compute, send, wait, bubble
against the schedule's own plan) is printed.
"""

from __future__ import annotations

import argparse
import functools
import os

if __name__ == "__main__":  # said at once: importing torch takes a second or two
    print(f"pipeq example: {__doc__.splitlines()[0]}", flush=True)

import torch
from torch import nn

import pipeq
from pipeq.testing import SleepStage
from pipeq.trace import analyze, format_report, load_trace, plot_trace

def trace_run(schedule: str, out: str, n: int = 4, m: int = 8) -> str:
    path = os.path.join(out, f"trace-{schedule}.json")
    v = pipeq.schedules.resolve(schedule).stages_per_process
    stages = [SleepStage(16, 0.010 / v, 0.010 / v, weight_s=0.010 / v) for _ in range(n * v)]
    heads = {}
    if schedule in ("local", "pairwise", "nwise"):  # interlocking: a small head per stage but the last
        heads = dict(aux_heads=[nn.Linear(16, 16) for _ in range(n - 1)], aux_loss=nn.MSELoss())
    runner = pipeq.PipelineRunner(stages, nn.MSELoss(), functools.partial(torch.optim.SGD, lr=0.01),
                                  schedule, m, trace=path, **heads)
    with runner:
        for _ in range(3):
            runner.step(torch.randn(32, 16), torch.randn(32, 16))
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join("runs", "traces"),
                   help="output directory (default runs/traces; docs/traces refreshes the pictures of the docs)")
    p.add_argument("--schedules", nargs="+", default=["fill-drain", "1f1b", "pairwise"])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for schedule in args.schedules:
        path = trace_run(schedule, args.out)
        trace = load_trace(path)
        print(format_report(analyze(trace, skip_first=1)))
        v = pipeq.schedules.resolve(schedule).stages_per_process
        shape = "4 stages" if v == 1 else f"4 processes x {v} stages"
        png = plot_trace(trace, path[:-len(".json")] + ".png",
                         title=f"{schedule}: {shape} x 8 microbatches (per process F 10 ms, I 10 ms, W 10 ms), measured")
        print(f"picture: {png}\n")


if __name__ == "__main__":
    main()
