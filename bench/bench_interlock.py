"""Interlocking schedules against end-to-end backprop: steps/s with equal, fixed stage costs.

    python bench/bench_interlock.py                 # 4 stages, 8 microbatches, F 5 ms / B 10 ms
    python bench/bench_interlock.py --rounds 5 --steps 40 --schemes global pairwise local 3-wise

The model: 4 pipeq.testing.SleepStage(16, F, B) (a sleep costs no CPU, so four stage processes
on two cores still overlap: what is measured is the schedule plus pipeq's own overhead), an
auxiliary head nn.Linear(16, 16) on each stage but the last, CrossEntropyLoss on the last stage's
16-wide output against class targets in 0..15 (the heads use the same loss). Each scheme is run in
its own runner (``start_method="forkserver"``, ``threads_per_stage=1``) for --steps timed steps
after a warm-up; the schemes take turns in an order that rotates every round, and the figures are
medians over rounds. "global" is plain backprop under the 1F1B schedule.

Printed beside the measurement, two ideals of the ratio scheme/global in steps/s:

- plan: the makespan ratio of the schedules' own dry runs (``pipeq.schedules.dry_run`` of each
  lowered schedule, forward F, backward B: the plan ``pipeq schedule`` draws);
- model: the same schedules with the work interlocking really adds on a stage of fixed cost (a
  gradient carried through ``main_k`` without training it, e.g. a pairwise stage's own head's
  gradient right after its forward, is one more backward of the stage), run step after step the
  way the runner does (stage k starts step s+1 once it is free and the last stage has returned
  the loss of step s, so the tail of one step can overlap the next one's start).

Measured on a 2-vCPU VM (defaults, --schemes global pairwise local 3-wise): global 5.21 steps/s
(192 ms, model 165 ms); pairwise/global 0.79x (plan 1.14x, model 0.77x); local/global 1.23x
(plan 1.22x, model 1.22x); 3-wise/global 0.52x (plan 0.69x, model 0.51x). On stages of fixed
cost the extra pass of a head's gradient through main costs pairwise more than its shorter
gradient path saves.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
from torch import nn

import pipeq
from pipeq import schedules
from pipeq.schedules import Op
from pipeq.testing import SleepStage

N_STAGES = 4
WIDTH = 16
WARMUP = 3


def scheme_args(scheme: str) -> dict:
    """PipelineRunner arguments of a scheme: global, local, pairwise or K-wise (nwise, d = K-1)."""
    if scheme in ("global", "local", "pairwise"):
        return {"schedule": scheme}
    if scheme.endswith("-wise") and scheme[:-5].isdigit() and 2 <= int(scheme[:-5]) <= N_STAGES:
        return {"schedule": schedules.Interlock("nwise", distance=int(scheme[:-5]) - 1)}
    raise ValueError(f"unknown scheme {scheme!r}: global, local, pairwise or K-wise, 2 <= K <= {N_STAGES}")


def interlock_of(scheme: str) -> schedules.Interlock:
    a = scheme_args(scheme)
    return schedules.resolve(a["schedule"])  # type: ignore[return-value]


# -- ideals ---------------------------------------------------------------------------------------
def plan_makespan(scheme: str, n: int, m: int, f: float, b: float) -> float:
    """Makespan of one step in the schedule's dry run (forward f, backward b, STEP free)."""
    cost = {Op.FORWARD: f, Op.BACKWARD: b, Op.STEP: 0}
    timeline = schedules.dry_run(schedules.build(interlock_of(scheme), n, m), cost=cost)  # type: ignore[arg-type]
    return max(t + cost[a.op] for row in timeline for t, a in row)


def action_costs(scheme: str, n: int, f: float, b: float) -> list[dict[Op, float]]:
    """Per stage, what F and B cost on stages of fixed cost, pass-through backwards included.

    Mirrors pipeq.research.interlock.executor.InterlockExecutor: a stage k > 0 below the last that sends its own
    head's gradient down computes it through main right after the forward (one backward more in
    F); in B, every gradient it sends other than its own head's and its trainer's is carried
    through main on its own (one backward more each).
    """
    il = interlock_of(scheme)
    d = il.distance(n)
    out = []
    for k in range(n):
        down = schedules.sends_down(k, n, d)
        trainer = schedules.trained_by(k, n, d)
        fwd = f + (b if 0 < k < n - 1 and d >= 1 and k in down else 0)
        wanted = [] if k == 0 or schedules.sends_early(k, n, d) else down
        extra = sum(1 for i in wanted if i not in (trainer, k))
        out.append({Op.FORWARD: fwd, Op.BACKWARD: b * (1 + extra), Op.STEP: 0.0})
    return out


def _channel(k: int, a: schedules.Action) -> tuple[int, int, int]:
    """(sender, receiver, microbatch) of the message a send or receive on stage k moves."""
    if a.op is Op.SEND_ACT:
        return (k, k + 1, a.microbatch)
    if a.op is Op.SEND_GRAD:
        return (k, k - 1, a.microbatch)
    return (k - 1 if a.op is Op.RECV_ACT else k + 1, k, a.microbatch)


def model_step_time(scheme: str, n: int, m: int, f: float, b: float, steps: int = 12) -> float:
    """Steady-state time per step: the lowered lists run step after step, as the runner does."""
    lowered = schedules.build(interlock_of(scheme), n, m)
    cost = action_costs(scheme, n, f, b)
    clock = [0.0] * n
    go = 0.0  # when the driver sends the next step: the last stage has returned the loss
    ends = []
    for _ in range(steps):
        clock = [max(c, go) for c in clock]
        pc = [0] * n
        sent: dict[tuple, float] = {}
        while any(pc[k] < len(lowered[k]) for k in range(n)):
            progressed = False
            for k in range(n):
                while pc[k] < len(lowered[k]):
                    a = lowered[k][pc[k]]
                    if a.op in schedules.COMPUTE_OPS:
                        clock[k] += cost[k][a.op]
                    elif a.op in (Op.SEND_ACT, Op.SEND_GRAD):
                        sent[_channel(k, a)] = clock[k]
                    else:
                        ch = _channel(k, a)
                        if ch not in sent:
                            break
                        clock[k] = max(clock[k], sent.pop(ch))
                    pc[k] += 1
                    progressed = True
            if not progressed:
                raise RuntimeError(f"{scheme}: the model deadlocked (the dry run did not?)")
        go = clock[n - 1]
        ends.append(go)
    half = steps // 2
    return (ends[-1] - ends[half - 1]) / (steps - half)


# -- measurement ----------------------------------------------------------------------------------
def measure(scheme: str, m: int, f: float, b: float, steps: int, batch: int) -> float:
    """Median steps/s of one fresh runner after a warm-up."""
    torch.manual_seed(0)
    stages = [SleepStage(WIDTH, f, b) for _ in range(N_STAGES)]
    heads = [nn.Linear(WIDTH, WIDTH) for _ in range(N_STAGES - 1)]
    x = torch.randn(batch, WIDTH)
    y = torch.randint(0, WIDTH, (batch,))
    runner = pipeq.PipelineRunner(
        stages, nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.01),
        microbatches=m, aux_heads=heads, threads_per_stage=1, start_method="forkserver",
        **scheme_args(scheme),
    )
    times = []
    with runner:
        for _ in range(WARMUP + steps):
            t0 = time.perf_counter()
            runner.step(x, y)
            times.append(time.perf_counter() - t0)
    return 1.0 / statistics.median(times[WARMUP:])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30, help="timed steps per run (after %d warm-up)" % WARMUP)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--forward-ms", type=float, default=5.0)
    p.add_argument("--backward-ms", type=float, default=10.0)
    p.add_argument("--schemes", nargs="+", default=["global", "pairwise", "local"],
                   help="global (compared against) and any of local, pairwise, K-wise")
    args = p.parse_args(argv)
    schemes = ["global"] + [s for s in dict.fromkeys(args.schemes) if s != "global"]
    for s in schemes:
        scheme_args(s)
    n, m = N_STAGES, args.microbatches
    f, b = args.forward_ms / 1e3, args.backward_ms / 1e3
    batch = 4 * m
    print(f"interlocking vs global: {n} SleepStage stages (F {args.forward_ms:g} ms, B "
          f"{args.backward_ms:g} ms), {m} microbatches of {batch // m}, {args.steps} steps x "
          f"{args.rounds} rounds, process mode (forkserver, 1 thread per stage)", flush=True)

    rates: dict[str, list[float]] = {s: [] for s in schemes}
    for r in range(args.rounds):
        order = schemes[r % len(schemes):] + schemes[:r % len(schemes)]
        for s in order:
            rates[s].append(measure(s, m, f, b, args.steps, batch))
        print(f"  round {r + 1}: " + ", ".join(f"{s} {rates[s][-1]:.2f}" for s in schemes)
              + " steps/s", flush=True)

    plan_g = plan_makespan("global", n, m, args.forward_ms, args.backward_ms)
    model_g = model_step_time("global", n, m, args.forward_ms, args.backward_ms)
    result: dict = {}
    print(f"{'scheme':9s} {'steps/s':>8s} {'ms/step':>8s} {'vs global':>10s} "
          f"{'plan':>6s} {'model':>6s}   (ratios: steps/s of the scheme / global; model ms/step)")
    for s in schemes:
        rate = statistics.median(rates[s])
        ratio = statistics.median(q / g for q, g in zip(rates[s], rates["global"]))
        plan = plan_g / plan_makespan(s, n, m, args.forward_ms, args.backward_ms)
        model_ms = model_step_time(s, n, m, args.forward_ms, args.backward_ms)
        result[s] = {"steps_per_s": rate, "ratio": ratio, "plan": plan, "model": model_g / model_ms}
        print(f"{s:9s} {rate:8.2f} {1e3 / rate:8.1f} {ratio:9.2f}x {plan:5.2f}x "
              f"{model_g / model_ms:5.2f}x   (model {model_ms:.1f} ms)")
    for s in schemes[1:]:
        print(f"{s}/global: measured {result[s]['ratio']:.2f}x, plan {result[s]['plan']:.2f}x, "
              f"model {result[s]['model']:.2f}x")
    return result


if __name__ == "__main__":
    main()
