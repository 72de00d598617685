"""The tutorial's asynchronous pipeline: a 16-8-1 MLP in two stage processes, no flush.

    python examples/async_mlp.py                      # weight stashing (PipeDream), 10 000 updates
    python examples/async_mlp.py --no-stashing        # backward with the newest weights instead

The tutorial's setup: 320 random 16-dim inputs with random binary targets, BCE, SGD lr 0.5,
microbatches of 32. Each stage is its own process and steps its optimizer after every
microbatch's backward (schedule "async"); each ``runner.step`` streams 10 microbatches (one pass
over the data) through the pipeline. The loss curve is printed every 1000 microbatches, as the
tutorial does. A run here (2-core VM, process mode)::

    microbatch     0: loss 0.691
    microbatch  1000: loss 0.623
    microbatch  2000: loss 0.516
    microbatch  3000: loss 0.478
    microbatch  4000: loss 0.458
    microbatch  5000: loss 0.410
    microbatch  6000: loss 0.442
    microbatch  7000: loss 0.377
    microbatch  8000: loss 0.356
    microbatch  9000: loss 0.339
    10000 updates per stage in 18.9 s (weight stashing)
"""

from __future__ import annotations

import argparse
import functools
import time

if __name__ == "__main__":  # said at once: importing torch takes a second or two
    print(f"pipeq example: {__doc__.splitlines()[0]}", flush=True)

import torch
from torch import nn

import pipeq


class Stage0(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.w1(x))


class Stage1(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.w2(x))


def train(updates: int = 10_000, stashing: bool = True, mode: str = "process",
          every: int = 1000, verbose: bool = True) -> list[tuple[int, float]]:
    """Returns the loss curve [(microbatches done, mean loss of the last pass)]."""
    torch.manual_seed(40)
    x = torch.rand([320, 16])
    target = torch.randint(0, 2, [320, 1], dtype=torch.float32)
    runner = pipeq.PipelineRunner(
        [Stage0(), Stage1()], nn.BCELoss(), functools.partial(torch.optim.SGD, lr=0.5),
        schedule=pipeq.schedules.AsyncOneFOneB(weight_stashing=stashing), microbatches=10, mode=mode,
    )
    curve = []
    start = time.perf_counter()
    with runner:
        for step in range(updates // 10):
            loss = runner.step(x, target)  # 10 microbatches of 32, one update each per stage
            done = step * 10
            if done % every == 0:
                curve.append((done, loss))
                if verbose:
                    print(f"microbatch {done:5d}: loss {loss:.3f}")
    if verbose:
        print(f"{updates} updates per stage in {time.perf_counter() - start:.1f} s "
              f"({'weight stashing' if stashing else 'no stashing'})")
    return curve


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--updates", type=int, default=10_000)
    p.add_argument("--no-stashing", action="store_true")
    p.add_argument("--mode", choices=["process", "simulated"], default="process")
    a = p.parse_args()
    train(a.updates, stashing=not a.no_stashing, mode=a.mode)
