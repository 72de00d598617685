#!/usr/bin/env python
"""Compiled stages: the GPT example's model eager and compiled, in one process and as 2 pipeq stages.

    PYTHONPATH=$PWD python bench/bench_compile.py                  # the --quick GPT: about 2-3 min on 2 cores
    PYTHONPATH=$PWD python bench/bench_compile.py --size full      # examples/gpt.py default GPT: about 5 min
    PYTHONPATH=$PWD python bench/bench_compile.py --device cuda    # the same on a GPU

Rows: the model in this process (eager, then ``torch.compile``'d as pipeq compiles a stage:
``pipeq.stage.compiled``), then pipeq with 2 stages (1F1B, 4 microbatches, stage processes, a split
by module names) eager, compiled (``compile=True``) in a fresh compile cache, and compiled again in
that cache (a second run). Each trains ``--steps`` steps at the model's context length after a
first step: ``first step s`` is that first step (compiling, in the compiled rows), ``compile s`` what
torch says it spent compiling (pipeq: the slowest stage's, from ``runner.stats()``), ``step ms`` the
median step after it; then one step at each of three other lengths (3/4, 1/2 + 1 and 7/8 of the
context): ``recompiles`` counts the compiles they caused (pipeq: every stage's). Torch runs one
thread per process (``--threads``). Prints the background load it saw: compare rows of one run.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import pipeq  # noqa: E402
from gpt import GPT, QUICK, GPTConfig, lm_loss  # noqa: E402
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=("quick", "full"), default="quick",
                   help="the GPT's size: examples/gpt.py's --quick one (2 layers of 32) or its default (4 of 128)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
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
