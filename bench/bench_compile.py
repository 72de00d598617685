#!/usr/bin/env python
"""Compiled stages: the GPT example's model eager and compiled, in one process and as 2 pipeq stages.

    PYTHONPATH=$PWD python bench/bench_compile.py                  # the --quick GPT: about 2-3 min on 2 cores
    PYTHONPATH=$PWD python bench/bench_compile.py --size full      # examples/gpt.py default GPT: about 5 min
    PYTHONPATH=$PWD python bench/bench_compile.py --device cuda    # the same on a GPU
    PYTHONPATH=$PWD python bench/bench_compile.py --split          # split-backward schedules: about 8 min
    PYTHONPATH=$PWD python bench/bench_compile.py --once           # compile once: about 2 min

Rows: the model in this process (eager, then ``torch.compile``'d as pipeq compiles a stage:
``pipeq.stage.compiled``), then pipeq with 2 stages (1F1B, 4 microbatches, stage processes, a split
by module names) eager, compiled (``compile=True``) in a fresh compile cache, and compiled again in
that cache (a second run). Each trains ``--steps`` steps at the model's context length after a
first step: ``first step s`` is that first step (compiling, in the compiled rows), ``compile s`` what
torch says it spent compiling (pipeq: the slowest stage's, from ``runner.stats()``), ``step ms`` the
median step after it; then one step at each of three other lengths (3/4, 1/2 + 1 and 7/8 of the
context): ``recompiles`` counts the compiles they caused (pipeq: every stage's). Torch runs one
thread per process (``--threads``). Prints the background load it saw: compare rows of one run.

``--split``: the split-backward schedules, eager against compiled (``compile=True``, inductor, one
compile cache for every run so that only the first run of a stage's graphs compiles them), on the
GPT of ``--size`` (default here: ``full``, examples/gpt.py's default GPT) cut by ``pipeq.split`` into
P = 2 and 4 stages (``--processes``): 1F1B and ZB-H1 with P stages, ZBV with 2P stages in P
processes (a V), ``--microbatches`` (default 8) of a batch of ``--batch`` at the full context.
Each configuration runs in a fresh runner, traced, for ``--steps`` steps after two warm-up steps;
the rounds (``--rounds``, default 2) alternate the order of the configurations; the figures are
medians over rounds. Per row: the median step, the step over the same runtime's (eager or
compiled) 1F1B, and from the trace the mean ``F``, ``B``, ``I`` and ``W`` of the stages that have
an input gradient (every stage but the first). Then the checks: compiled ``I`` over compiled 1F1B's
``B``, compiled ``I + W`` over it, and each schedule's compiled step ratio against its eager one.

``--once``: what a fresh run of identical blocks compiles again. The ``--size`` GPT (default here:
``full``) with one block as 1 stage, then with ``n_layers`` blocks as that many stages (``pipeq.split``),
compiled (inductor) in a fresh cache, then again in that cache: each run's first step (compiling)
and, per stage, the seconds torch spent compiling and its cache hits (a stage whose graphs another
stage compiled before it hits the shared cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import pipeq  # noqa: E402
from gpt import GPT, QUICK, GPTConfig, lm_loss, random_batch  # noqa: E402
from pipeq.stage.compiled import CompileOptions, compile_stage  # noqa: E402

SGD = functools.partial(torch.optim.SGD, lr=0.01)


def lengths(context: int) -> list[int]:
    """The context, then three other lengths."""
    return [context, 3 * context // 4, context // 2 + 1, 7 * context // 8]


def batch(n: int, T: int, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, 256, (n, T), generator=g), torch.randint(0, 256, (n, T), generator=g)
    return x.to(device), y.to(device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def one_process(cfg: GPTConfig, args: argparse.Namespace, compiled: bool) -> dict:
    """The model in this process: eager, or compiled as pipeq compiles a stage."""
    torch.manual_seed(0)
    model = GPT(cfg).to(args.device)
    watch = compile_stage(model, CompileOptions()) if compiled else None
    opt = SGD(model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        lm_loss(model(x), y).backward()
        opt.step()
        _sync(args.device)

    return _timed(step, cfg, args, lambda: (watch.seconds, watch.compiles) if watch else (0.0, 0))


def pipeline(cfg: GPTConfig, args: argparse.Namespace, compile: dict | bool) -> dict:
    """2 pipeq stages (1F1B, 4 microbatches), split by module names."""
    torch.manual_seed(0)
    model = GPT(cfg)
    half = cfg.n_layers // 2
    names = [["tok_emb", "pos_emb", *(f"blocks.{i}" for i in range(half))],
             [*(f"blocks.{i}" for i in range(half, cfg.n_layers)), "norm", "lm_head"]]
    devices = [args.device] * 2 if args.device.startswith("cuda") else None
    runner = pipeq.PipelineRunner(list(pipeq.split(model, modules=names)), lm_loss, SGD, "1f1b", 4,
                                  start_method="forkserver", threads_per_stage=args.threads, devices=devices,
                                  compile=compile)
    with runner:
        def figures() -> tuple[float, int]:
            stats = runner.stats()
            return max(s["compile_s"] for s in stats), sum(s["compiles"] for s in stats)

        return _timed(lambda x, y: runner.step(x, y), cfg, args, figures)


def _timed(step, cfg: GPTConfig, args: argparse.Namespace, figures) -> dict:
    x, y = batch(args.batch, cfg.context, args.device, 0)
    t0 = time.perf_counter()
    step(x, y)
    first = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - t0)
    compile_s, before = figures()
    for k, T in enumerate(lengths(cfg.context)[1:], 1):
        step(*batch(args.batch, T, args.device, k))
    _, after = figures()
    return {"first": first, "compile": compile_s, "step": statistics.median(times), "recompiles": after - before}


SPLIT_SCHEDULES = ("1f1b", "zb-h1", "zbv")


def split_run(cfg: GPTConfig, args: argparse.Namespace, schedule: str, processes: int, compiled: bool,
              cache: str, trace_dir: str) -> dict:
    """One traced run of ``schedule`` over ``processes`` stage processes (see the module)."""
    torch.manual_seed(0)
    model = GPT(cfg)
    n_stages = 2 * processes if schedule == "zbv" else processes
    stages = pipeq.split(model, (torch.zeros(2, cfg.context, dtype=torch.long),), n_stages=n_stages)
    path = os.path.join(trace_dir, f"{schedule}-{processes}-{int(compiled)}.json")
    x, y = batch(args.batch, cfg.context, args.device, 0)
    with pipeq.PipelineRunner(list(stages), lm_loss, SGD, schedule, args.microbatches, start_method="forkserver",
                              threads_per_stage=args.threads, trace=path,
                              compile={"cache_dir": cache} if compiled else False) as runner:
        for _ in range(2):
            runner.step(x, y)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            runner.step(x, y)
            times.append(time.perf_counter() - t0)
        split = [s["backward_split"] for s in runner.stats()] if compiled else None
    trace = pipeq.trace.load_trace(path)
    first = min(e.step for e in trace.events) + 2  # after the warm-up steps
    ops: dict[str, list[float]] = {}
    for e in trace.events:
        if e.stage > 0 and e.step >= first and e.op in ("F", "B", "I", "W"):
            ops.setdefault(e.op, []).append(e.dur_us / 1e3)
    return {"step": statistics.median(times), "split": split,
            **{op: statistics.mean(v) for op, v in ops.items()}}


def split_main(args: argparse.Namespace) -> None:
    cfg = GPTConfig() if args.size == "full" else QUICK
    print(f"GPT {cfg}, batch {args.batch} x {cfg.context} tokens, {args.microbatches} microbatches, inductor, "
          f"torch {torch.__version__}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    cache = tempfile.mkdtemp(prefix="pipeq-bench-compile-")
    configs = [(s, p, c) for p in args.processes for s in SPLIT_SCHEDULES for c in (False, True)]
    got: dict[tuple, list[dict]] = {c: [] for c in configs}
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else configs[::-1]
        for config in order:
            got[config].append(split_run(cfg, args, *config, cache, cache))
            print(".", end="", flush=True)
    print()
    med = {c: {k: statistics.median(v[k] for v in runs) for k in ("step", "F", "B", "I", "W") if k in runs[0]}
           for c, runs in got.items()}
    print(f"| {'schedule':<8} | P | {'run':<8} | step ms | / 1F1B | F ms | B ms | I ms | W ms | I+W ms | backward |")
    print("|----------|--:|----------|--------:|-------:|-----:|-----:|-----:|-----:|-------:|----------|")
    for (s, p, c), m in med.items():
        base = med[("1f1b", p, c)]["step"]
        cells = [f"{m[k]:4.2f}" if k in m else "   -" for k in ("F", "B", "I", "W")]
        iw = f"{m['I'] + m['W']:6.2f}" if "I" in m and "W" in m else "     -"
        split = ", ".join(sorted({b for b in got[(s, p, c)][0]["split"] or () if b})) or "-"
        print(f"| {s:<8} | {p} | {'compiled' if c else 'eager':<8} | {m['step'] * 1e3:7.1f} | "
              f"{m['step'] / base:6.3f} | {' | '.join(cells)} | {iw} | {split} |")
    for p in args.processes:
        b = med[("1f1b", p, True)]["B"]
        for s in SPLIT_SCHEDULES[1:]:
            m = med[(s, p, True)]
            ratio_c = m["step"] / med[("1f1b", p, True)]["step"]
            ratio_e = med[(s, p, False)]["step"] / med[("1f1b", p, False)]["step"]
            print(f"P={p} {s}: compiled I / compiled 1F1B B = {m['I'] / b:.2f} (<= 0.65), (I + W) / B = "
                  f"{(m['I'] + m['W']) / b:.2f} (within 1 +- 0.15); step / 1F1B's: eager {ratio_e:.3f}, "
                  f"compiled {ratio_c:.3f} (gain over 1F1B, eager {1 / ratio_e:.3f}x, compiled {1 / ratio_c:.3f}x)")


def _first_step(cfg: GPTConfig, n_stages: int, cache: str, args: argparse.Namespace) -> tuple[float, list[dict]]:
    """The first step's seconds of ``cfg``'s GPT in ``n_stages`` compiled stages (1F1B, 8 microbatches), and the stages' stats."""
    torch.manual_seed(0)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    x, y = random_batch(torch.randint(0, 256, (65536,), dtype=torch.uint8, generator=g), args.batch, cfg.context, g)
    stages = pipeq.split(model, (x[:2],), n_stages=n_stages) if n_stages > 1 else [model]
    runner = pipeq.PipelineRunner(stages, lm_loss, SGD, "1f1b", 8, compile={"cache_dir": cache},
                                  start_method="forkserver", threads_per_stage=args.threads, devices=[args.device] * n_stages)
    with runner:
        t = time.perf_counter()
        runner.step(x, y)
        first = time.perf_counter() - t
        return first, runner.stats()


def once_main(cfg: GPTConfig, args: argparse.Namespace) -> None:
    one, many = tempfile.mkdtemp(prefix="pipeq-once-"), tempfile.mkdtemp(prefix="pipeq-once-")
    n = cfg.n_layers
    print(f"GPT {cfg}, batch {args.batch}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"| {'run':<32} | first step s | per stage: compile s (cache hits) |")
    firsts = {}
    for what, layers, stages, cache in [("1 stage of 1 block, fresh", 1, 1, one), (f"{n} stages of 1 block, fresh", n, n, many),
                                        (f"{n} stages of 1 block, cached", n, n, many)]:
        first, st = _first_step(dataclasses.replace(cfg, n_layers=layers), stages, cache, args)
        firsts[what] = first
        per = "; ".join(f"{s['compile_s']:.1f} ({s['compile_cache_hits']})" for s in st)
        print(f"| {what:<32} | {first:12.1f} | {per} |", flush=True)
    fresh = firsts[f"{n} stages of 1 block, fresh"]
    print(f"fresh {n} stages over 1 stage of 1 block: {fresh / firsts['1 stage of 1 block, fresh']:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=("quick", "full"), default="quick",
                   help="the GPT's size: examples/gpt.py's --quick one (2 layers of 32) or its default (4 of 128)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--split", action="store_true", help="the split-backward schedules, eager and compiled (see above)")
    p.add_argument("--processes", type=int, nargs="+", default=[2, 4], help="--split: stage processes")
    p.add_argument("--microbatches", type=int, default=8, help="--split: microbatches per step")
    p.add_argument("--rounds", type=int, default=2, help="--split: alternating rounds")
    p.add_argument("--once", action="store_true", help="compile once: fresh and cached runs of identical blocks")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.once:
        once_main(GPTConfig() if "--size" not in sys.argv or args.size == "full" else QUICK, args)
        return
    if args.split:
        if "--size" not in sys.argv:
            args.size = "full"
        split_main(args)
        return
    cfg = QUICK if args.size == "quick" else GPTConfig()
    print(f"GPT {cfg}, batch {args.batch} x {cfg.context} tokens, lengths {lengths(cfg.context)}, device "
          f"{args.device}, torch {torch.__version__}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    cache = tempfile.mkdtemp(prefix="pipeq-bench-compile-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "one-process")  # fresh: a cold compile
    rows = [("1 process, eager", lambda: one_process(cfg, args, False)),
            ("1 process, compiled", lambda: one_process(cfg, args, True)),
            ("pipeq 2 stages, eager", lambda: pipeline(cfg, args, False)),
            ("pipeq 2 stages, compiled", lambda: pipeline(cfg, args, {"cache_dir": cache})),
            ("pipeq 2 stages, compiled, cached", lambda: pipeline(cfg, args, {"cache_dir": cache}))]
    print(f"| {'setup':<34} | first step s | compile s | step ms | recompiles |")
    print(f"|{'-' * 36}|-------------:|----------:|--------:|-----------:|")
    for name, run in rows:
        r = run()
        print(f"| {name:<34} | {r['first']:12.1f} | {r['compile']:9.1f} | {r['step'] * 1e3:7.1f} | "
              f"{r['recompiles']:10d} |", flush=True)


if __name__ == "__main__":
    main()
