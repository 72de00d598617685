"""runner.stream against a runner.step loop: batches/s of every schedule, beside its bound.

    python bench/bench_stream.py                    # m = 4 and 8, 30 timed batches per loop
    python bench/bench_stream.py --quick            # m = 4, 8 timed batches (under a minute)
    python bench/bench_stream.py --microbatches 4 --batches 60 --schedules local async

The model: 4 pipeq.testing.SleepStage(16, F, B) (F 5 ms, B 10 ms by default: a sleep costs no
CPU, so four stage processes on two cores still overlap and what is measured is the schedule plus
pipeq's own overhead), MSELoss on regression targets, SGD. Interlocking schedules get cheap
auxiliary heads, ``nn.Identity()`` with an MSE loss, so the heads cost nothing measurable. Each
schedule runs in its own runner (process mode, ``start_method="forkserver"``,
``threads_per_stage=1``): --warmup batches, then --batches timed ones of a ``runner.step`` loop,
then the same of ``runner.stream`` (the warm-up batches at the head of the stream; the clock runs
from the loss of the last warm-up batch to the last loss, so neither the fill nor start-up counts).

Bounds (batches/s, from ``pipeq.schedules.bounds.stream_bound``: dry runs with F and B as given, STEP
free): "plan" for the lowered action lists as they are; "model" for the same lists with the work
interlocking really adds on a stage of fixed cost: pairwise and n-wise carry a head's gradient
through the main module with ``torch.autograd.grad``, and on a SleepStage that input-gradient-only
backward sleeps a full B (``bench_interlock.action_costs``). The two differ for pairwise and
n-wise only; the model is what a SleepStage pipeline can reach, so "of bound" uses it.

"slept" holds the stream against the model bound with the ``time.sleep`` durations measured in
this process (a sleep overshoots, more on a loaded machine), to tell sleep overshoot from pipeq's
own per-hop overhead. The x1F1B ratios divide by the measured 1F1B step loop of the same round,
which runs below its own bound too: the ratio of the bounds is beside each, in parentheses.

Targets (printed, not asserted): streamed local and streamed async at least 1.5x a step loop of
1F1B at m = 4 (ideal 1.75x: (m+N-1)(F+B) against m(F+B)); every streamed schedule within 10% of
its own bound.

Measured on the 2-vCPU VM shared with other work (load average 5.9 -> 8.5, --rounds 2): every
schedule, streamed or not, at 74-90% of its bound (the step loops at 76-87%: streaming adds no
overhead of its own; time.sleep overshot by ~0.1 ms only, so the rest is per-hop wake-up and
interpreter time on an overloaded machine). Streamed local 1.84x a 1F1B step loop at m = 4 (bound
1.75x), 1.57x at m = 8 (1.37x). Fill-drain, 1F1B and global stream at their step loops' rate, as
their plans say (stage 0 flushes every batch). Async 0.89x (m = 4): today each of its batches
still ends with its cooldown, so its plan allows 1.00x, not 1.75x. Pairwise 0.98x (plan 1.40x,
SleepStage model 1.00x), n-wise d=2 0.71x (model 0.70x): on stages whose input-gradient-only
backward costs a full backward, neither beats global.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import statistics
import time

import torch
from torch import nn

import pipeq
from pipeq import schedules
from pipeq.schedules.bounds import StreamBound, stream_bound
from pipeq.schedules import Op
from pipeq.testing import SleepStage

N_STAGES = 4
WIDTH = 16
ROWS = 4  # rows per microbatch
REAL_ROWS = 64  # rows per microbatch with --real
SCHEDULES = ["fill-drain", "1f1b", "global", "local", "pairwise", "nwise:2", "async"]
REFERENCE = "1f1b"


def schedule_of(name: str) -> "str | schedules.ScheduleFn":
    """A bench name (one of SCHEDULES; nwise:D for any distance D) as a PipelineRunner schedule."""
    if name.startswith("nwise:") and name[6:].isdigit():
        return schedules.Interlock("nwise", distance=int(name[6:]))
    if name in SCHEDULES:
        return name
    raise ValueError(f"unknown schedule {name!r}: one of {', '.join(SCHEDULES)} (nwise:D, any D >= 1)")


@functools.cache
def _interlock_bench():
    spec = importlib.util.spec_from_file_location(
        "bench_interlock", os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_interlock.py"))
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def model_costs(name: str, n: int, f: float, b: float) -> "list[dict[Op, float]]":
    """Per-stage F/B costs on SleepStages: plain, plus interlocking's pass-through backwards."""
    il = schedules.resolve(schedule_of(name))
    if not isinstance(il, schedules.Interlock):
        return [{Op.FORWARD: f, Op.BACKWARD: b, Op.STEP: 0.0}] * n
    d = il.distance(n)
    scheme = "global" if d == n - 1 else "local" if d == 0 else f"{d + 1}-wise"
    return _interlock_bench().action_costs(scheme, n, f, b)


def bounds(name: str, n: int, m: int, f: float, b: float) -> dict[str, StreamBound]:
    """Seconds per batch: the plan (F and B as given) and the SleepStage cost model."""
    sched = schedule_of(name)
    return {"plan": stream_bound(sched, n, m, {Op.FORWARD: f, Op.BACKWARD: b, Op.STEP: 0.0}),
            "model": stream_bound(sched, n, m, model_costs(name, n, f, b))}


# -- measurement ----------------------------------------------------------------------------------
def real_stages(n: int, width: int) -> list[nn.Module]:
    """``n`` stages of real compute: Linear(width) + ReLU twice each."""
    return [nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU())
            for _ in range(n)]


def measure(name: str, m: int, f: float, b: float, warmup: int, batches: int,
            real: int = 0) -> tuple[float, float]:
    """(step loop, stream) in batches/s, one fresh runner for both (``real``: MLP stages of that
    width instead of sleeping ones)."""
    torch.manual_seed(0)
    sched = schedule_of(name)
    width = real or WIDTH
    stages = real_stages(N_STAGES, width) if real else [SleepStage(WIDTH, f, b) for _ in range(N_STAGES)]
    extra: dict = {}
    if isinstance(schedules.resolve(sched), schedules.Interlock):
        extra = {"aux_heads": [nn.Identity() for _ in range(N_STAGES - 1)], "aux_loss": nn.MSELoss()}
    rows = REAL_ROWS if real else ROWS
    data = [(torch.randn(rows * m, width), torch.randn(rows * m, width)) for _ in range(4)]
    runner = pipeq.PipelineRunner(stages, nn.MSELoss(), functools.partial(torch.optim.SGD, lr=0.01),
                                  schedule=sched, microbatches=m, threads_per_stage=1,
                                  start_method="forkserver", **extra)
    total = warmup + batches

    def rate(stamps: list[float]) -> float:
        return batches / (stamps[-1] - stamps[warmup - 1])

    with runner:
        stamps = []
        for i in range(total):
            runner.step(*data[i % len(data)])
            stamps.append(time.perf_counter())
        step_rate = rate(stamps)
        stamps = []
        for _ in runner.stream(data[i % len(data)] for i in range(total)):
            stamps.append(time.perf_counter())
        stream_rate = rate(stamps)
    return step_rate, stream_rate


def slept(seconds: float, samples: int = 15) -> float:
    """The median time ``time.sleep(seconds)`` takes here (it overshoots, more on a loaded machine)."""
    took = []
    for _ in range(samples):
        t0 = time.perf_counter()
        time.sleep(seconds)
        took.append(time.perf_counter() - t0)
    return statistics.median(took)


def _real(names: list[str], ms: list[int], warmup: int, batches: int, width: int) -> dict:
    """The same loops on real compute: measured batches/s and the ratio to a 1F1B step loop."""
    print(f"real compute: {N_STAGES} stages of 2 x Linear({width}) + ReLU, {REAL_ROWS} rows a microbatch, "
          f"one thread a stage, on {os.cpu_count()} cores (load {_load()})")
    print(f"{'m':>2} {'schedule':<10} {'step':>8} {'stream':>8} {'step x1F1B':>11} {'stream x1F1B':>13}")
    out: dict = {}
    for m in ms:
        ref = None
        for name in names:
            step, stream = measure(name, m, 0.0, 0.0, warmup, batches, real=width)
            ref = ref or step
            out[(m, name)] = (step, stream)
            print(f"{m:>2} {name:<10} {step:>8.2f} {stream:>8.2f} {step / ref:>10.2f}x {stream / ref:>12.2f}x")
    return out


def _load() -> str:
    try:
        return "load average %.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        return "load average ?"


def _bound_text(plan: float, model: float) -> str:
    return f"{plan:6.2f}" if abs(plan - model) < 1e-9 * plan else f"{plan:6.2f}/{model:.2f}"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="m = 4, 2 warm-up and 8 timed batches")
    p.add_argument("--microbatches", type=int, nargs="+", default=None, help="m values (default 4 8)")
    p.add_argument("--batches", type=int, default=None, help="timed batches per loop (default 30)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up batches per loop (default 3)")
    p.add_argument("--rounds", type=int, default=1, help="runs of every schedule (medians are printed)")
    p.add_argument("--forward-ms", type=float, default=5.0)
    p.add_argument("--backward-ms", type=float, default=10.0)
    p.add_argument("--real", type=int, default=0, metavar="WIDTH",
                   help="real compute instead of sleeps: 4 stages of 2 x Linear(WIDTH)+ReLU, measured only "
                        "(the four stage processes share this machine's cores, so no dry-run bound applies)")
    p.add_argument("--schedules", nargs="+", default=SCHEDULES,
                   help=f"any of {' '.join(SCHEDULES)} (nwise:D for distance D); {REFERENCE} always runs")
    args = p.parse_args(argv)
    ms = args.microbatches or ([4] if args.quick else [4, 8])
    batches = args.batches or (8 if args.quick else 30)
    warmup = args.warmup or (2 if args.quick else 3)
    if batches < 1 or warmup < 1 or args.rounds < 1 or any(m < 1 for m in ms):
        p.error("--batches, --warmup, --rounds and --microbatches must be >= 1")
    names = [REFERENCE] + [s for s in dict.fromkeys(args.schedules) if s != REFERENCE]
    for s in names:
        schedule_of(s)
    n, f, b = N_STAGES, args.forward_ms / 1e3, args.backward_ms / 1e3
    if args.real:
        return _real(names, ms, warmup, batches, args.real)
    print(f"runner.stream vs runner.step: {n} SleepStage stages (F {args.forward_ms:g} ms, B "
          f"{args.backward_ms:g} ms), microbatches of {ROWS} rows, m = {', '.join(map(str, ms))}; "
          f"{warmup} warm-up + {batches} timed batches per loop, {args.rounds} round(s); process mode "
          f"(forkserver, 1 thread per stage); {_load()}", flush=True)

    measured: dict[tuple[int, str], list[tuple[float, float]]] = {}
    t0 = time.monotonic()
    for r in range(args.rounds):
        for m in ms:
            order = names[r % len(names):] + names[:r % len(names)]
            for s in order:
                measured.setdefault((m, s), []).append(measure(s, m, f, b, warmup, batches))
    elapsed = time.monotonic() - t0

    f_slept, b_slept = slept(f), slept(b)
    print(f"\nbatches/s; bound: from the dry run (plan, /model where a SleepStage adds pass-through "
          f"backwards); of: measured / bound (/model); slept: the same with the time.sleep durations "
          f"measured here (F {f_slept * 1e3:.2f} ms, B {b_slept * 1e3:.2f} ms); x1F1B: over a step loop of "
          f"1F1B at the same m, measured (bound)")
    head = (f"{'m':>2s} {'schedule':11s} {'step':>6s} {'bound':>12s} {'of':>4s} {'stream':>7s} {'bound':>12s} "
            f"{'of':>4s} {'slept':>5s} {'step x1F1B':>14s} {'stream x1F1B':>14s}")
    print(head)
    print("-" * len(head))
    result: dict = {}
    for m in ms:
        ref_rates = measured[(m, REFERENCE)]
        ref_bound = 1.0 / bounds(REFERENCE, n, m, f, b)["plan"].step
        for s in names:
            rates = measured[(m, s)]
            step_rate = statistics.median(q for q, _ in rates)
            stream_rate = statistics.median(q for _, q in rates)
            bd = bounds(s, n, m, f, b)
            row = {
                "step": step_rate, "stream": stream_rate,
                "step_bound": 1.0 / bd["plan"].step, "step_model": 1.0 / bd["model"].step,
                "stream_bound": 1.0 / bd["plan"].stream, "stream_model": 1.0 / bd["model"].stream,
                "stream_slept": 1.0 / bounds(s, n, m, f_slept, b_slept)["model"].stream,
            }
            row["step_of_bound"] = step_rate / row["step_model"]
            row["of_bound"] = stream_rate / row["stream_model"]
            row["of_slept"] = stream_rate / row["stream_slept"]
            # against the 1F1B step loop of the same round
            row["step_x"] = statistics.median(q / ref for (q, _), (ref, _) in zip(rates, ref_rates))
            row["stream_x"] = statistics.median(q / ref for (_, q), (ref, _) in zip(rates, ref_rates))
            row["step_x_bound"] = row["step_model"] / ref_bound
            row["stream_x_bound"] = row["stream_model"] / ref_bound
            result[(m, s)] = row
            print(f"{m:2d} {s:11s} {step_rate:6.2f} {_bound_text(row['step_bound'], row['step_model']):>12s} "
                  f"{row['step_of_bound']:4.0%} {stream_rate:7.2f} "
                  f"{_bound_text(row['stream_bound'], row['stream_model']):>12s} {row['of_bound']:4.0%} "
                  f"{row['of_slept']:5.0%} {row['step_x']:6.2f}x ({row['step_x_bound']:.2f}x) "
                  f"{row['stream_x']:6.2f}x ({row['stream_x_bound']:.2f}x)")
    print(f"({elapsed:.0f} s; {_load()})")

    print("\nnotes:")
    print("- pairwise/n-wise on SleepStages: a stage sends its head's gradient by autograd.grad through "
          "its main module, an input-gradient-only backward that sleeps a full B; the second bound "
          "(/model) charges it, so they beat global only where that model says so.")
    print("- fill-drain, 1F1B and global flush every batch on stage 0 (its STEP waits for the batch's "
          "last gradient, its next forward for the STEP): their stream bound is the step loop's.")
    for m in ms:
        busy = 1.0 / bounds(REFERENCE, n, m, f, b)["plan"].busy
        print(f"- m = {m}: no schedule beats the busiest stage's own work, {busy:.2f} batches/s "
              f"({busy * bounds(REFERENCE, n, m, f, b)['plan'].step:.2f}x a 1F1B step loop).")

    print("\ntargets (not asserted):")
    if 4 in ms:
        for s in ("local", "async"):
            if (4, s) in result:
                row = result[(4, s)]
                verdict = "met" if row["stream_x"] >= 1.5 else "MISSED"
                why = ""
                if s == "async" and row["stream_x_bound"] < 1.5:
                    why = (f"; its plan allows {row['stream_x_bound']:.2f}x: each batch still ends with its "
                           "cooldown (drains) before the next one's forwards, a known gap fixed elsewhere")
                print(f"- streamed {s} >= 1.5x a 1F1B step loop at m = 4 (ideal 1.75x): "
                      f"{row['stream_x']:.2f}x, {verdict}{why}")
    else:
        print("- streamed local / async >= 1.5x a 1F1B step loop at m = 4: m = 4 not run")
    misses = [f"{s} m={m} {row['of_bound']:.1%}" for (m, s), row in result.items() if row["of_bound"] < 0.9]
    print("- every streamed schedule within 10% of its own bound (/model): "
          + ("met" if not misses else "MISSED by " + ", ".join(misses)))
    return result


if __name__ == "__main__":
    main()
