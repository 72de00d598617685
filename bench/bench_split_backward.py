#!/usr/bin/env python
"""A split backward's cost: a whole backward ``B`` against its input gradient ``I`` plus weight gradient ``W``.

    PYTHONPATH=$PWD python bench/bench_split_backward.py            # ~1 min on one core
    PYTHONPATH=$PWD python bench/bench_split_backward.py --repeats 40

Prints, for each model (a 4-layer MLP of width 1024, batch 64; a transformer encoder block, d=512,
8 heads, batch 4 x 128 tokens) as a middle stage of a pipeline (it has an input gradient), the
median milliseconds of one microbatch's ``B``, ``I``, ``W`` and ``I+W`` (torch on 1 thread,
:class:`pipeq.stage.executor.StageExecutor` driven directly, a fresh forward before each), and the
ratio (I+W)/B: 1.0 is a split that costs nothing. To compare with another version of pipeq, point
PYTHONPATH at it.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Callable

import torch
from torch import nn

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


def measure(make: Callable[[], tuple[nn.Module, torch.Tensor]], repeats: int) -> dict[str, float]:
    """Median ms of B, I, W and I+W of one microbatch on a middle stage built by ``make``."""
    torch.manual_seed(0)
    module, x = make()
    ex = StageExecutor(1, 3, StageSpec(module, functools.partial(torch.optim.SGD, lr=0.0)), torch.device("cpu"))
    ex.begin(0, [x.shape[0]], True)
    times: dict[str, list[float]] = {"B": [], "I": [], "W": [], "I+W": []}
    for r in range(repeats + 3):  # 3 warm-up rounds
        for split in (False, True):
            (out,) = ex.forward(0, (x,))
            g = (torch.randn_like(out),)
            t0 = time.perf_counter()
            if split:
                ex.input_grad(0, g)
                t1 = time.perf_counter()
                ex.weight_grad(0)
            else:
                ex.backward(0, g)
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
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, median of {args.repeats}")
    print(f"{'model':<22}{'B ms':>9}{'I ms':>9}{'W ms':>9}{'I+W ms':>9}{'(I+W)/B':>9}")
    for name, make in (("mlp 4x1024, b64", mlp), ("transformer d512 4x128", block)):
        m = measure(make, args.repeats)
        print(f"{name:<22}{m['B']:>9.2f}{m['I']:>9.2f}{m['W']:>9.2f}{m['I+W']:>9.2f}{m['I+W'] / m['B']:>9.2f}")


if __name__ == "__main__":
    main()
