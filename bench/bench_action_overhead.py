#!/usr/bin/env python
"""The stage event loop's fixed cost per action: a pipeline of stages that compute (almost) nothing.

    PYTHONPATH=$PWD python bench/bench_action_overhead.py                 # ~1 min
    PYTHONPATH=$PWD python bench/bench_action_overhead.py --steps 100 --schedule zb-h1
    PYTHONPATH=$PWD python bench/bench_action_overhead.py --profile 1     # + cProfile of stage 1
    PYTHONPATH=$PWD python bench/bench_action_overhead.py --micro         # in-process CPU per action, ~20 s
    PYTHONPATH=$PWD python bench/bench_action_overhead.py --critical-path # where each slot's time goes, ~1.5 min
    PYTHONPATH=$PWD python bench/bench_action_overhead.py --critical-path --schedule zbv --slots
    PYTHONPATH=$PWD python bench/bench_action_overhead.py --critical-path --processes 2 --spin 0
    PYTHONPATH=$PWD python bench/bench_action_overhead.py --scale         # cost vs m and N, ~1-2 min

N=4 stage processes (``PipelineRunner``, process mode, 1 torch thread each), m=8 microbatches of
8 x 16 float32, every stage a :class:`pipeq.testing.SleepStage` that sleeps 0 s in F, I and W (a
bias: every stage runs a backward). For each schedule (1f1b, zb-h1) it prints the median ms per
step over ``--steps`` steps after ``--warmup`` (and the fastest step: the machine is shared and
noisy), and the ms per critical-path slot: the step time
over the ideal critical path's length in actions (1F1B: 2(m+N-1); ZB-H1: 3m+N-1), which is the
runtime's fixed cost per action on the critical path (compute is ~0 here); and the CPU time per
step the stage processes used (all four together, from /proc: their Python, autograd, codec and
transport work, and their busy-polling while waiting, ``spin``) and the driver's. Four stages
on a 2-core machine are CPU-bound: every microsecond of CPU per action is on the critical path.

``--micro`` prints instead the CPU microseconds, in this one process, of a middle stage's F, F+B
and F+I+W on the zero-cost stage (its sleeps skipped), of one 8 x 16 float32 message encoded,
sent over a lane, received and decoded, and of a look at an empty lane: what the machine's noise
does not blur.

``--profile K`` runs cProfile inside stage K (enabled by its module's forward after the warm-up,
dumped at the end of the timed steps) and prints the top functions by own time and by cumulative
time, in CPU time of the stage's main thread (waiting and preemption do not count): where an
action's time goes (codec, transport, shm, autograd, executor, interpreter).

``--critical-path`` runs instead issue 41's F/I/W harness (4 ms each per process, 2-chunk
schedules at half per chunk) traced, for each ``--schedule`` (default 1f1b, zb-h1, zbv,
dualpipev), and prints the median wall microseconds of each part of a critical-path slot
(compute, the sleep's overshoot, autograd entry/exit, interpreter, send, wait for an already-sent
message, wake-up, receive, codec) per kind of slot; ``--slots`` adds the last step slot by slot.
See bench/critical_path.py and :mod:`pipeq.trace.critical`.

``--scale`` prints per-action CPU and per-slot wall time against m = 8, 32, 128 and N = 2, 4, 8
processes, and in simulated mode (N up to 16) the interpreter's and the plan's CPU per action
(bench/scale.py); default schedule 1f1b, 2 warm-up + 4 timed steps per point.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import tempfile
import time
from functools import partial
from typing import Any

import torch
from torch import nn

import critical_path  # noqa: E402  (bench/ is this script's directory: on the path)
import scale  # noqa: E402
from pipeq.testing import SleepStage

__all__ = ["ProfiledStage", "main", "micro", "run"]

N, M, ROWS, WIDTH = 4, 8, 8, 16
SLOTS = {"1f1b": 2 * (M + N - 1), "zb-h1": 3 * M + N - 1, "fill-drain": 2 * (M + N - 1)}


class ProfiledStage(SleepStage):
    """A zero-cost :class:`SleepStage` that profiles its own process (cProfile) from forward
    number ``start`` to forward number ``stop``, then writes the stats to ``path``."""

    def __init__(self, start: int, stop: int, path: str) -> None:
        super().__init__(WIDTH, 0.0, 0.0, weight_s=0.0)
        self.start, self.stop, self.path = start, stop, path
        self.calls = 0
        self._prof: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.start:
            self._prof = cProfile.Profile(time.thread_time_ns, 1e-9)  # CPU time: not the waits, not preemption
            self._prof.enable()
        elif self.calls == self.stop and self._prof is not None:
            self._prof.disable()
            self._prof.dump_stats(self.path)
            self._prof = None
        return super().forward(x)


def run(schedule: str, warmup: int, steps: int, spin: float | None, profile: int | None,
        path: str) -> tuple[list[float], dict[str, float], float]:
    """The step times (s) of ``steps`` timed steps of ``schedule`` after ``warmup``, and the CPU
    seconds per step of the stage processes (all together) and of this process (the driver)."""
    from pipeq import PipelineRunner

    stages: list[nn.Module] = [SleepStage(WIDTH, 0.0, 0.0, weight_s=0.0) for _ in range(N)]
    if profile is not None:  # the forward after the warm-up to the first of the step after the last
        stages[profile] = ProfiledStage(warmup * M + 1, (warmup + steps) * M + 1, path)
    kw: dict[str, Any] = {"spin": spin} if spin is not None else {}
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(M * ROWS, WIDTH, generator=g), torch.randn(M * ROWS, WIDTH, generator=g)
    times = []
    with PipelineRunner(stages, nn.MSELoss(), partial(torch.optim.SGD, lr=0.01), schedule=schedule,
                        microbatches=M, threads_per_stage=1, **kw) as runner:
        for i in range(warmup + steps + (profile is not None)):
            if i == warmup:
                stage_cpu, own_cpu = scale.descendants_cpu(), time.process_time()
            t0 = time.perf_counter()
            runner.step(x, y)
            times.append(time.perf_counter() - t0)
            if i == warmup + steps - 1:
                after = scale.descendants_cpu()
                stage_cpu = {k: (v - stage_cpu.get(k, 0.0)) / steps for k, v in after.items()}
                own_cpu = (time.process_time() - own_cpu) / steps
    return times[warmup:warmup + steps], stage_cpu, own_cpu




def micro() -> dict[str, float]:
    """One action's CPU cost in this process (no other process, no waiting): a middle stage's
    F, F+B, F+I+W on a zero-cost stage (its sleeps of 0 s skipped), and one message of 8 x 16
    float32 encoded, sent over a lane, received and decoded."""
    import pipeq.testing
    from pipeq.stage.executor import StageExecutor
    from pipeq.stage.spec import StageSpec
    from pipeq.wire import codec, lanes
    from pipeq.wire.frames import decode_aligned
    from pipeq.wire.messages import Kind

    sleep = pipeq.testing.time.sleep
    pipeq.testing.time.sleep = lambda s: None  # type: ignore[assignment]  (the stage's own cost out)
    try:
        ex = StageExecutor(1, N, StageSpec(SleepStage(WIDTH, 0.0, 0.0, weight_s=0.0),
                                           partial(torch.optim.SGD, lr=0.0)), torch.device("cpu"))
        ex.begin(0, [ROWS] * M, True)
        x, g = torch.randn(ROWS, WIDTH), (torch.randn(ROWS, WIDTH),)
        out = {"F": critical_path.cpu_us(lambda: (ex.forward(0, (x,)), ex.stash.clear())),
               "F+B": critical_path.cpu_us(lambda: (ex.forward(0, (x,)), ex.backward(0, g))),
               "F+I+W": critical_path.cpu_us(lambda: (ex.forward(0, (x,)), ex.input_grad(0, g), ex.weight_grad(0)))}
    finally:
        pipeq.testing.time.sleep = sleep  # type: ignore[assignment]
    path = os.path.join(tempfile.mkdtemp(prefix="pipeq-lane-"), "lane")
    box = lanes.LaneInbox(path, "bench")
    lane = lanes.Lane(path)
    box.accept()
    conn = box.conns[0]

    def hop() -> None:
        lane.send(lane.datagram(codec.encode(Kind.ACTIVATION, 1, 2, [x])))  # type: ignore[arg-type]
        decode_aligned(box.receive(conn))  # type: ignore[arg-type]

    out["message"] = critical_path.cpu_us(hop)
    out["empty poll"] = critical_path.cpu_us(lambda: box.receive(conn))
    lane.close()
    box.close()
    return out


def _print_profile(path: str, top: int) -> None:
    stats = pstats.Stats(path)
    stats.strip_dirs()
    for key in ("tottime", "cumulative"):
        print(f"-- top {top} by {key}")
        stats.sort_stats(key).print_stats(top)


def _critical(names: list[str], warmup: int, steps: int, slots: bool, n: int, spin: float | None) -> None:
    from pipeq.trace.critical import format_critical

    enc, dec = critical_path.codec_cost(critical_path.ROWS * critical_path.WIDTH * 4)
    print(f"F/I/W harness: N={n} processes{'' if spin is None else f', spin={spin:g}'}, m={critical_path.M}, F=I=W={critical_path.COST_S * 1e3:g} ms "
          f"per process (2-chunk schedules: half per chunk); {warmup} warm-up + {steps} traced steps; wall us on "
          f"the host clock; codec: encode {enc:.1f} + decode {dec:.1f} us CPU per message (in-process "
          f"estimate); load {os.getloadavg()[0]:.2f}")
    for name in names:
        cp, times = critical_path.analyse(name, warmup, steps, n=n, spin=spin)
        print()
        print(format_critical(cp, per_slot=slots))
        print(f"measured step (untraced clock, driver): median {1e3 * statistics.median(times):.2f} ms")


def cold() -> dict[str, float]:
    """The same small forward and backward (8 x 16 by 16 x 16, tanh), wall us, right after 4 ms of:
    nothing, a Python busy loop, a sleep, large matmuls. What an action's code costs around a stage
    whose own work took that long: the machine's, not the runtime's instructions."""
    a, w = torch.randn(8, 16), torch.randn(16, 16, requires_grad=True)
    big = torch.randn(700, 700)

    def small() -> None:
        (a @ w).tanh().sum().backward()

    def busy(matmul: bool) -> None:
        end = time.perf_counter() + 0.004
        while time.perf_counter() < end:
            if matmul:
                big @ big

    before = {"nothing": lambda: None, "a Python busy loop": lambda: busy(False),
              "a sleep": lambda: time.sleep(0.004), "large matmuls": lambda: busy(True)}
    out = {}
    for name, work in before.items():
        took = []
        for _ in range(60):
            work()
            t0 = time.perf_counter()
            small()
            took.append(1e6 * (time.perf_counter() - t0))
        out[name] = statistics.median(took[10:])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", action="append", help="1f1b, zb-h1 (default: both)")
    ap.add_argument("--warmup", type=int, default=None, help="default 10 (--critical-path: 5)")
    ap.add_argument("--steps", type=int, default=None, help="default 60 (--critical-path: 20)")
    ap.add_argument("--spin", type=float, default=None, help="PipelineRunner(spin=...) (default: the library's)")
    ap.add_argument("--profile", type=int, default=None, help="profile stage K (cProfile)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--micro", action="store_true", help="only the in-process CPU cost of each action")
    ap.add_argument("--cold", action="store_true", help="a small forward+backward's wall time after 4 ms of other work")
    ap.add_argument("--critical-path", action="store_true", help="the F/I/W harness's critical path, part by part")
    ap.add_argument("--slots", action="store_true", help="with --critical-path: the last step slot by slot")
    ap.add_argument("--processes", type=int, default=critical_path.N, help="with --critical-path: stage processes")
    ap.add_argument("--scale", action="store_true", help="per-action CPU and per-slot wall vs m and N")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.scale:
        for name in args.schedule or ["1f1b"]:
            scale.main_scale(name, 2 if args.warmup is None else args.warmup, 4 if args.steps is None else args.steps,
                             args.spin)
        return
    if args.critical_path:
        _critical(args.schedule or list(critical_path.SCHEDULES), 5 if args.warmup is None else args.warmup,
                  20 if args.steps is None else args.steps, args.slots, args.processes, args.spin)
        return
    args.warmup = 10 if args.warmup is None else args.warmup
    args.steps = 60 if args.steps is None else args.steps
    if args.micro:
        print("CPU us per call, in process: " + ", ".join(f"{k} {v:.1f}" for k, v in micro().items()))
        return
    if args.cold:
        print("a small forward+backward, wall us, right after 4 ms of: "
              + ", ".join(f"{k} {v:.0f}" for k, v in cold().items()))
        return
    print(f"N={N} stages, m={M} microbatches of {ROWS}x{WIDTH}, zero-cost SleepStage, process mode, "
          f"load {os.getloadavg()[0]:.2f}")
    for schedule in args.schedule or ["1f1b", "zb-h1"]:
        path = os.path.join(tempfile.mkdtemp(prefix="pipeq-prof-"), f"stage{args.profile}.prof")
        times, stage_cpu, own_cpu = run(schedule, args.warmup, args.steps, args.spin, args.profile, path)
        med = 1e3 * statistics.median(times)
        q1, _, q3 = (1e3 * q for q in statistics.quantiles(times, n=4))
        slots = SLOTS[schedule]
        low = 1e3 * min(times)
        print(f"{schedule:<6} {med:7.2f} ms/step (IQR {q1:.2f}-{q3:.2f}, min {low:.2f})  {slots} slots  "
              f"{med / slots:.3f} ms/slot (min {low / slots:.3f})")
        by_thread = ", ".join(f"{k} {1e3 * v:.2f}" for k, v in sorted(stage_cpu.items(), key=lambda kv: -kv[1]) if v)
        print(f"       CPU ms/step: stage processes {1e3 * sum(stage_cpu.values()):.2f} ({by_thread}); "
              f"driver {1e3 * own_cpu:.2f}")
        if args.profile is not None:
            if os.path.exists(path):
                _print_profile(path, args.top)
            else:
                print(f"(no profile written at {path})")


if __name__ == "__main__":
    main()
