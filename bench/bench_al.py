"""Pipelined Associated Learning against sequential AL and 1F1B backprop: steps/s on 4 stages.

    python bench/bench_al.py                 # 8 microbatches; (a) F 5 ms / B 10 ms, (b) digits MLP
    python bench/bench_al.py --rounds 5 --steps 40 --forward-ms 10 --backward-ms 20

Three ways to train the same f-chain, each timed in steps/s (one ``runner.step`` = one batch):

- AL pipelined: ``schedule="al"``, process mode: one process per stage, messages only flow
  forward, every stage updates after each microbatch (``pipeq.research``);
- AL sequential: the very same AL math and executors in one process, layer after layer:
  ``mode="simulated"`` runs stage 0's whole step, then stage 1's, ... (an AL stage never waits
  for a later one, so the simulated engine never switches early; the test checks the order);
  one torch thread, as each stage process has;
- 1F1B: plain end-to-end backprop of the same f-chain under the 1F1B schedule, process mode.

Two models, both on 4 stages:

(a) equal fixed costs: each f is a ``pipeq.testing.SleepStage(16, F, B)`` (a sleep costs no CPU,
    so four stage processes on two cores still overlap: the schedule and pipeq's overhead are what
    is measured). AL layers are ``ALLayer(f=SleepStage, b=Linear, g=Linear, h=Linear)`` (16 wide,
    16 classes; the label paths are tiny next to F and B); 1F1B trains the same SleepStages with
    CrossEntropyLoss on the last one's 16-wide output. Batches of 4 per microbatch. Beside the
    measurement, the ideal ms/step without overhead: pipelined AL ``(n-1)F + m(F+B)`` (stage k
    trails stage 0 by k forwards; nothing waits on a backward), sequential AL ``n m (F+B)``,
    1F1B ``(m+n-1)(F+B)``.
(b) real compute: the digits model of ``examples/al_digits.py`` (4 blocks Linear 256 + ReLU, AL
    layers from ``build_al``, a Linear head for 1F1B; Adam), on a fixed batch of 64 images.

Each measurement is a fresh runner (``start_method="forkserver"``, ``threads_per_stage=1``) timed
for --steps steps after a warm-up; per round the three take turns in an order that rotates every
round, and the figures are medians over rounds (ratios: the median of the per-round ratios).

Measured on a shared 2-vCPU VM (other jobs running, load average 1-5), defaults, about 2 min::

    (a) SleepStage f (F 5 ms, B 10 ms), batch 32
      method          steps/s  ms/step    ideal
      AL pipelined       6.13    163.2    135.0
      AL sequential      1.80    555.1    480.0
      1F1B               5.28    189.2    165.0
    (b) digits MLP (examples/al_digits.py: 4 x Linear 256 + ReLU, Adam), batch 64
      method          steps/s  ms/step
      AL pipelined      21.69     46.1
      AL sequential     27.00     37.0
      1F1B              66.49     15.0
    ratios (steps/s, median of the per-round ratios):
      sleep : pipelined AL / sequential AL 3.47x (ideal 3.56x), pipelined AL / 1F1B 1.16x (ideal 1.22x)
      digits: pipelined AL / sequential AL 0.85x, pipelined AL / 1F1B 0.29x

(a) is close to its ideal: pipelined AL beats 1F1B by the bubble it does not have, and sequential
AL by nearly n x (every sleep's overshoot and every action's overhead is paid serially there, so
the ratio may even exceed the ideal). (b) is not compute that pipelining can win on here: an AL
step does about 5x the work of a backprop step of the same blocks (41 against 8 ms in one
process, one thread) (b, g, h are each as large as
f, and each stage runs two Adam updates per microbatch instead of one per batch), and four stage
processes share two cores, so each stage's compute stretches (a trace: 18-32 ms of compute per
stage per step against 37 ms for all four in one process) and sends cost ~1 ms each. The digits
figures move a lot with the machine's load (another run: pipelined / sequential 1.48x, / 1F1B
0.31x); the sleep figures repeat within a few per cent.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch
from torch import nn

import pipeq
from pipeq.research import ALLayer
from pipeq.testing import SleepStage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from examples import al_digits  # noqa: E402

N_STAGES = 4
WIDTH = 16  # (a): features and classes
DIGITS_BATCH = 64
WARMUP = 3
METHODS = ("AL pipelined", "AL sequential", "1F1B")
PARTS = ("sleep", "digits")


# -- models -------------------------------------------------------------------------------------
def sleep_al(f: float, b: float) -> list[ALLayer]:
    """AL layers whose f is a SleepStage; b, g, h single Linears (stage 0: to and from 16 classes)."""
    torch.manual_seed(0)
    return [ALLayer(f=SleepStage(WIDTH, f, b), b=nn.Linear(WIDTH, WIDTH), g=nn.Linear(WIDTH, WIDTH),
                    h=nn.Linear(WIDTH, WIDTH)) for _ in range(N_STAGES)]


def sleep_chain(f: float, b: float) -> list[nn.Module]:
    return [SleepStage(WIDTH, f, b) for _ in range(N_STAGES)]


def make_runner(part: str, method: str, m: int, f: float, b: float) -> pipeq.PipelineRunner:
    mode = "simulated" if method == "AL sequential" else "process"
    common = dict(mode=mode, start_method="forkserver", threads_per_stage=1)
    if part == "sleep":
        sgd = functools.partial(torch.optim.SGD, lr=0.01)
        if method == "1F1B":
            return pipeq.PipelineRunner(sleep_chain(f, b), nn.CrossEntropyLoss(), sgd, "1f1b", m, **common)
        return pipeq.PipelineRunner(sleep_al(f, b), None, sgd, "al", m, **common)
    return al_digits.make_runner("1F1B" if method == "1F1B" else "AL", mode, m)


def batch_of(part: str, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    if part == "sleep":
        g = torch.Generator().manual_seed(0)
        n = 4 * m
        return torch.randn(n, WIDTH, generator=g), torch.randint(0, WIDTH, (n,), generator=g)
    x_train, y_train, _, _ = al_digits.load_digits()
    return x_train[:DIGITS_BATCH], y_train[:DIGITS_BATCH]


# -- ideals ---------------------------------------------------------------------------------------
def ideal_ms(method: str, n: int, m: int, f: float, b: float) -> float:
    """ms per step on stages of fixed cost, without any overhead (f, b in ms)."""
    if method == "AL pipelined":
        return (n - 1) * f + m * (f + b)
    if method == "AL sequential":
        return n * m * (f + b)
    if method == "1F1B":
        return (m + n - 1) * (f + b)
    raise ValueError(method)


# -- measurement ----------------------------------------------------------------------------------
def measure(part: str, method: str, m: int, f: float, b: float, steps: int,
            data: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Median steps/s of one fresh runner after a warm-up."""
    x, y = data
    runner = make_runner(part, method, m, f, b)
    threads = torch.get_num_threads()
    if method == "AL sequential":
        torch.set_num_threads(1)  # as each stage process has (threads_per_stage=1)
    times = []
    try:
        with runner:
            for _ in range(WARMUP + steps):
                t0 = time.perf_counter()
                runner.step(x, y)
                times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 1.0 / statistics.median(times[WARMUP:])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30, help="timed steps per run (after %d warm-up)" % WARMUP)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--forward-ms", type=float, default=5.0, help="(a): each f's forward")
    p.add_argument("--backward-ms", type=float, default=10.0, help="(a): each f's backward")
    args = p.parse_args(argv)
    n, m = N_STAGES, args.microbatches
    f, b = args.forward_ms / 1e3, args.backward_ms / 1e3
    data = {part: batch_of(part, m) for part in PARTS}
    what = {
        "sleep": f"(a) SleepStage f (F {args.forward_ms:g} ms, B {args.backward_ms:g} ms), batch {4 * m}",
        "digits": f"(b) digits MLP (examples/al_digits.py: 4 x Linear {al_digits.WIDTH} + ReLU, Adam), "
                  f"batch {DIGITS_BATCH}",
    }
    print(f"pipelined AL vs sequential AL vs 1F1B: {n} stages, {m} microbatches, {args.steps} steps x "
          f"{args.rounds} rounds; process mode (forkserver, 1 thread per stage), sequential AL in "
          f"simulated mode (1 thread)", flush=True)

    rates: dict[str, dict[str, list[float]]] = {part: {s: [] for s in METHODS} for part in PARTS}
    for r in range(args.rounds):
        order = METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]
        for part in PARTS:
            for s in order:
                rates[part][s].append(measure(part, s, m, f, b, args.steps, data[part]))
            print(f"  round {r + 1} {part:6s}: " + ", ".join(f"{s} {rates[part][s][-1]:.2f}" for s in METHODS)
                  + " steps/s", flush=True)

    result: dict = {}
    for part in PARTS:
        print(what[part])
        ideal_col = f" {'ideal':>8s}" if part == "sleep" else ""
        print(f"  {'method':14s} {'steps/s':>8s} {'ms/step':>8s}{ideal_col}")
        res: dict = {}
        for s in METHODS:
            rate = statistics.median(rates[part][s])
            res[s] = {"steps_per_s": rate}
            line = f"  {s:14s} {rate:8.2f} {1e3 / rate:8.1f}"
            if part == "sleep":
                ideal = ideal_ms(s, n, m, args.forward_ms, args.backward_ms)
                res[s]["ideal_ms"] = ideal
                line += f" {ideal:8.1f}"
            print(line)
        al = rates[part]["AL pipelined"]
        for key, other in (("vs_sequential", "AL sequential"), ("vs_1f1b", "1F1B")):
            res[key] = statistics.median(a / o for a, o in zip(al, rates[part][other]))
        if part == "sleep":
            pipelined = res["AL pipelined"]["ideal_ms"]
            res["ideal_vs_sequential"] = res["AL sequential"]["ideal_ms"] / pipelined
            res["ideal_vs_1f1b"] = res["1F1B"]["ideal_ms"] / pipelined
        result[part] = res
    print("ratios (steps/s, median of the per-round ratios):")
    for part in PARTS:
        res = result[part]
        ideal = part == "sleep"
        print(f"  {part:6s}: pipelined AL / sequential AL {res['vs_sequential']:.2f}x"
              + (f" (ideal {res['ideal_vs_sequential']:.2f}x)" if ideal else "")
              + f", pipelined AL / 1F1B {res['vs_1f1b']:.2f}x"
              + (f" (ideal {res['ideal_vs_1f1b']:.2f}x)" if ideal else ""))
    return result


if __name__ == "__main__":
    main()
