"""Data and pipeline parallelism together: 2 replicas x 2 stages of the digits MLP, 4 processes.

    python examples/dp_digits.py                     # R = 2 and R = 1, 8 epochs each
    python examples/dp_digits.py --epochs 4 --replicas 2

The MLP of ``examples/train_digits.py`` (its ``make_stages``, the same initial weights: Linear
64->128, ReLU, Linear 128->64, ReLU, Linear 64->10) cut into N = 2 stages, [the first four
modules] and [the last Linear], trained on scikit-learn's digits (``load_digits``: 1437 training
images, 360 held out) with SGD (lr 0.05, momentum 0.9), CrossEntropyLoss, batches of 64, the
1F1B schedule with 4 microbatches per replica, ``start_method="forkserver"``, one thread per
stage process. With ``data_parallel=2`` each batch is split in two halves of 32, each replica
pipelines its half through its own two stage processes, and stage k's gradients are summed over
the two replicas (over pipeq's ZeroMQ link between them) before stage k steps: R x N = 4
processes. The same run with R = 1 (2 processes, the whole batch in 4 microbatches of 16) is
printed beside it; both are full-batch SGD, so they reach the same weights up to rounding (the
maximum parameter difference is printed).

A run here (a 2-core VM shared with other jobs; the times are the training epochs only, "start" is
starting the stage processes, the first one including the fork server's own start)::

    $ python examples/dp_digits.py
    R = 2 x N = 2 (4 processes): epoch 8 mean loss 0.0132, held-out accuracy 98.1%, 3.7 s (start 4.1 s)
    R = 1 x N = 2 (2 processes): epoch 8 mean loss 0.0132, held-out accuracy 98.1%, 1.6 s (start 0.2 s)
    same weights: max |parameter difference| R = 2 vs R = 1 after 184 steps: 1.8e-07
    steps/s: R = 2 49, R = 1 114

The two learn the same (98.1%, as train_digits' three stages do), and R = 2 is 2.3x slower
here (another run, on a quieter machine: 2.4 s against 1.3 s, 77 and 140 steps/s, 1.8x): its 4
processes share 2 cores, and this model's step (17k multiply-adds per sample in the forward) is
mostly messages and waits, which a replica does not shorten, plus one all-reduce per stage.
``bench/bench_dp.py`` measures when data parallelism pays.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

if __name__ == "__main__":  # said at once: importing torch takes a second or two
    print(f"pipeq example: {__doc__.splitlines()[0]}", flush=True)

import torch
from tqdm import tqdm
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pipeq  # noqa: E402
from examples.train_digits import load_digits, make_stages  # noqa: E402


def two_stages(seed: int = 0) -> list[nn.Module]:
    """train_digits' three stages as two: [Linear, ReLU, Linear, ReLU] and [Linear]."""
    s = make_stages(seed)
    return [nn.Sequential(*s[0], *s[1]), s[2]]


def train(replicas: int = 2, epochs: int = 8, batch: int = 64, microbatches: int = 4,
          lr: float = 0.05, start_method: str = "forkserver", verbose: bool = True) -> dict:
    """Train with R = ``replicas`` copies of the 2-stage pipeline; returns accuracy, times, state."""
    x_train, y_train, x_test, y_test = load_digits()
    runner = pipeq.PipelineRunner(
        two_stages(), nn.CrossEntropyLoss(),
        functools.partial(torch.optim.SGD, lr=lr, momentum=0.9),
        schedule="1f1b", microbatches=microbatches, data_parallel=replicas,
        start_method=start_method, threads_per_stage=1,
    )
    g = torch.Generator().manual_seed(1)  # the same batches for every R
    steps, losses = 0, []
    t_start = time.perf_counter()
    with runner:
        t0 = time.perf_counter()
        per_epoch = -(-len(x_train) // batch)
        with tqdm(total=epochs * per_epoch, desc=f"R = {replicas}", unit="step", leave=False,
                  disable=not verbose) as bar:
            for _ in range(epochs):
                perm = torch.randperm(len(x_train), generator=g)
                losses = []
                for i in range(0, len(perm), batch):
                    idx = perm[i:i + batch]
                    losses.append(runner.step(x_train[idx], y_train[idx]))
                    steps += 1
                    bar.update(1)
        seconds = time.perf_counter() - t0
        accuracy = (runner.predict(x_test).argmax(1) == y_test).float().mean().item()
        state = runner.state_dict()
    out = {"replicas": replicas, "accuracy": accuracy, "seconds": seconds, "start_s": t0 - t_start,
           "steps": steps, "last_loss": sum(losses) / len(losses), "state": state}
    if verbose:
        print(f"R = {replicas} x N = 2 ({2 * replicas} processes): epoch {epochs} mean loss "
              f"{out['last_loss']:.4f}, held-out accuracy {accuracy:.1%}, {seconds:.1f} s "
              f"(start {out['start_s']:.1f} s)", flush=True)
    return out


def compare(replicas: int = 2, epochs: int = 8, verbose: bool = True, **kw) -> list[dict]:
    """R = ``replicas`` and R = 1 on the same batches; prints how far apart their weights end."""
    runs = [train(r, epochs, verbose=verbose, **kw) for r in (replicas, 1)]
    a, b = runs[0]["state"], runs[1]["state"]
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    for r in runs:
        r["max_diff_vs_r1"] = diff
    if verbose:
        print(f"same weights: max |parameter difference| R = {replicas} vs R = 1 after "
              f"{runs[0]['steps']} steps: {diff:.1e}")
        print(f"steps/s: R = {replicas} {runs[0]['steps'] / runs[0]['seconds']:.0f}, "
              f"R = 1 {runs[1]['steps'] / runs[1]['seconds']:.0f}")
    return runs


if __name__ == "__main__":  # required: stage processes re-import this file
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4, help="per replica")
    a = p.parse_args()
    compare(a.replicas, a.epochs, microbatches=a.microbatches)
