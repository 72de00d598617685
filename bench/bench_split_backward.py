#!/usr/bin/env python
"""A split backward's cost: a whole backward ``B`` against its input gradient ``I`` plus weight gradient ``W``.

    PYTHONPATH=$PWD python bench/bench_split_backward.py            # ~1 min on one core
    PYTHONPATH=$PWD python bench/bench_split_backward.py --repeats 40
    PYTHONPATH=$PWD python bench/bench_split_backward.py --compile  # and compiled (inductor), ~3 min

Prints, for each model (a 4-layer MLP of width 1024, batch 64; a transformer encoder block, d=512,
8 heads, batch 4 x 128 tokens) as a middle stage of a pipeline (it has an input gradient), the
median milliseconds of one microbatch's ``B``, ``I``, ``W`` and ``I+W`` (torch on 1 thread,
:class:`pipeq.stage.executor.StageExecutor` driven directly, a fresh forward before each), and the
ratio (I+W)/B: 1.0 is a split that costs nothing. To compare with another version of pipeq, point
PYTHONPATH at it.

``--compile`` adds the GPT example's middle stage (examples/gpt.py's default GPT cut by
``pipeq.split`` into 4 stages: stage 1, one block; a microbatch of 2 sequences of 128 tokens) and,
for every model, the same figures compiled by inductor as a stage process compiles its stage: ``B``
with the backward compiled whole (what 1F1B runs), ``I`` and ``W`` with it cut in two
(:mod:`pipeq.stage.split_backward`, what the split-backward schedules run), and compiled ``I`` over
compiled ``B``. One process, one thread: no other stage competes for the core.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
from torch import nn

from pipeq.stage.compiled import CompileOptions, compile_stage
from pipeq.stage.executor import StageExecutor
from pipeq.stage.spec import StageSpec

__all__ = ["main", "measure"]


def mlp() -> tuple[nn.Module, torch.Tensor]:
    """4 x (Linear(1024, 1024) + ReLU), batch 64."""
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers), torch.randn(64, 1024)


def block() -> tuple[nn.Module, torch.Tensor]:
    """A transformer encoder layer (d=512, 8 heads, MLP 2048), 4 sequences of 128 tokens."""
    layer = nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, batch_first=True)
    return layer, torch.randn(4, 128, 512)


def gpt_stage() -> tuple[nn.Module, torch.Tensor]:
    """examples/gpt.py's default GPT in 4 stages: stage 1 (one block) and what stage 0 sends it."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from gpt import GPT, GPTConfig

    import pipeq

    torch.manual_seed(0)
    cfg = GPTConfig()
    stages = pipeq.split(GPT(cfg), (torch.zeros(2, cfg.context, dtype=torch.long),), n_stages=4)
    sent = stages[0](torch.randint(0, cfg.vocab, (2, cfg.context)))
    return stages[1], tuple(t.detach() for t in sent)


def _executor(module: nn.Module, x: Any, compiled: str | None) -> StageExecutor:
    ex = StageExecutor(1, 3, StageSpec(module, functools.partial(torch.optim.SGD, lr=0.0)), torch.device("cpu"))
    if compiled is not None:
        ex.compile_watch = compile_stage(ex.module, CompileOptions(split_backward=compiled == "cut"))
    ex.begin(0, [_rows(x)], True)
    return ex


def _rows(x: Any) -> int:
    return (x[0] if isinstance(x, tuple) else x).shape[0]


def measure(make: Callable[[], tuple[nn.Module, Any]], repeats: int, compiled: bool = False) -> dict[str, float]:
    """Median ms of B, I, W and I+W of one microbatch on a middle stage built by ``make``
    (``compiled``: B with the backward compiled whole, I and W with it cut in two)."""
    torch.manual_seed(0)
    module, x = make()
    if compiled:
        whole = _executor(copy.deepcopy(module), x, "whole")
        ex = _executor(module, x, "cut")
    else:
        ex = whole = _executor(module, x, None)
    times: dict[str, list[float]] = {"B": [], "I": [], "W": [], "I+W": []}
    for r in range(repeats + 3):  # 3 warm-up rounds
        for split in (False, True):
            run = ex if split else whole
            out = run.forward(0, x if isinstance(x, tuple) else (x,))
            g = tuple(torch.randn_like(o) for o in out if o.is_floating_point())
            t0 = time.perf_counter()
            if split:
                ex.input_grad(0, g)
                t1 = time.perf_counter()
                ex.weight_grad(0)
            else:
                whole.backward(0, g)
                t1 = time.perf_counter()
            t2 = time.perf_counter()
            if r >= 3:
                if split:
                    times["I"].append(t1 - t0)
                    times["W"].append(t2 - t1)
                    times["I+W"].append(t2 - t0)
                else:
                    times["B"].append(t2 - t0)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--compile", action="store_true", help="add the GPT stage, and every model compiled (see above)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, median of {args.repeats}")
    print(f"{'model':<24}{'':<9}{'B ms':>9}{'I ms':>9}{'W ms':>9}{'I+W ms':>9}{'I/B':>7}{'(I+W)/B':>9}")
    models = [("mlp 4x1024, b64", mlp), ("transformer d512 4x128", block)]
    if args.compile:
        models.append(("GPT example, stage 1/4", gpt_stage))
    for name, make in models:
        for compiled in (False, True) if args.compile else (False,):
            m = measure(make, args.repeats, compiled)
            print(f"{name:<24}{'compiled' if compiled else 'eager':<9}{m['B']:>9.2f}{m['I']:>9.2f}{m['W']:>9.2f}"
                  f"{m['I+W']:>9.2f}{m['I'] / m['B']:>7.2f}{m['I+W'] / m['B']:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
