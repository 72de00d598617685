"""Associated Learning on digits: a 4-layer AL network against the same blocks trained by backprop.

    python examples/al_digits.py                          # both, process mode (4 stage processes)
    python examples/al_digits.py --epochs 4
    python examples/al_digits.py --quick --mode simulated # a smoke run in one process

Four MLP blocks (Linear 64->W + ReLU, then Linear W->W + ReLU three times; W = 256) on
scikit-learn's 8x8 digits (pixels standardized per feature, std clamped at >= 1 so that the
always-blank border pixels stay 0; an 80/20 split, seed 0) are trained two ways:

- AL (``schedule="al"``): each block is the ``f`` of an AL layer (``pipeq.research.build_al``: a
  Linear+Tanh bridge ``b``, label encoder ``g`` and decoder ``h`` per layer, label widths = W).
  Every stage learns from its own two local losses only and updates after every microbatch, so
  messages only flow forward; prediction decodes ``b_4``, ``h_4 .. h_1`` back to stage 0
  (the inference path of the AL paper);
- 1F1B: the same four blocks (the same initial weights: they are made first from the same seed)
  plus a Linear W->10 head on the last stage, CrossEntropyLoss, plain end-to-end backprop under
  the 1F1B schedule, one optimizer step per batch.

Both use Adam (lr 1e-3), batches of 64 in 4 microbatches, the same batches in the same order for
the same epochs, one thread per stage, and are judged on the same held-out fifth through
``runner.predict``. A real run (process mode, a shared 2-core virtual machine with other jobs on
it; 16 s in all, about half of it starting the stage processes)::

    $ python examples/al_digits.py
    ...
    method     held-out accuracy   wall time
    AL                     98.6%        7.0s
    1F1B                   97.8%        3.3s
    (359 held-out images, 10 epochs of 23 batches, process mode)

The accuracies repeat exactly from run to run and in simulated mode; the wall times (training
epochs only, 230 steps) move with the machine's load (under heavier load: AL 16.5 s, 1F1B 4.6 s).
AL is slower here although no stage ever waits for a gradient: an AL step does about 5x the work
of a backprop step of the same blocks (b, g and h are each as large as f, and every stage makes
two Adam updates per microbatch instead of one per batch), and four stage processes share two
cores, so there is nothing for its shorter dependency chain to win back. ``bench/bench_al.py``
measures the schedules on stages of fixed cost, where pipelined AL beats 1F1B by the bubble it
does not have, and against sequential AL.
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
from examples.train_digits import load_digits  # noqa: E402  (the same split and scaling)
from pipeq.research import build_al  # noqa: E402

N_STAGES = 4
N_CLASSES = 10
WIDTH = 256
METHODS = ("AL", "1F1B")


def make_blocks(width: int = WIDTH) -> list[nn.Module]:
    """The four f blocks (plain torch.nn, so stage processes unpickle them without this file)."""
    return [nn.Sequential(nn.Linear(64 if i == 0 else width, width), nn.ReLU()) for i in range(N_STAGES)]


def make_al(seed: int = 0, width: int = WIDTH) -> list[pipeq.research.ALLayer]:
    """The AL layers: the seed's blocks first, then each layer's b, g, h."""
    torch.manual_seed(seed)
    return build_al(make_blocks(width), [width] * N_STAGES, N_CLASSES)


def make_backprop(seed: int = 0, width: int = WIDTH) -> list[nn.Module]:
    """The same blocks (the same weights for the same seed) as 1F1B stages, a Linear head on the last."""
    torch.manual_seed(seed)
    blocks = make_blocks(width)
    head = nn.Linear(width, N_CLASSES)
    return [*blocks[:-1], nn.Sequential(blocks[-1], head)]


def make_runner(method: str, mode: str = "process", microbatches: int = 4, lr: float = 1e-3, seed: int = 0,
                start_method: str = "forkserver", width: int = WIDTH) -> pipeq.PipelineRunner:
    """An unstarted runner of ``method`` ("AL" or "1F1B") from the seed's initial weights."""
    adam = functools.partial(torch.optim.Adam, lr=lr)
    common = dict(mode=mode, start_method=start_method, threads_per_stage=1)
    if method == "AL":
        return pipeq.PipelineRunner(make_al(seed, width), None, adam, "al", microbatches, **common)
    if method == "1F1B":
        return pipeq.PipelineRunner(make_backprop(seed, width), nn.CrossEntropyLoss(), adam, "1f1b",
                                    microbatches, **common)
    raise ValueError(f"unknown method {method!r}: choose from {', '.join(METHODS)}")


def train(method: str, mode: str = "process", epochs: int = 10, batch: int = 64, microbatches: int = 4,
          lr: float = 1e-3, seed: int = 0, start_method: str = "forkserver", data=None,
          verbose: bool = True) -> tuple[float, float]:
    """Train one method from the seed's initial weights; returns (held-out accuracy, wall seconds).

    The wall time is that of the training epochs only: stage start-up (the first runner also starts
    the fork server) and the held-out evaluation are left out. A simulated run uses one torch
    thread in this process, as each stage process does.
    """
    x_train, y_train, x_test, y_test = data if data is not None else load_digits()
    runner = make_runner(method, mode, microbatches, lr, seed, start_method)
    threads = torch.get_num_threads()
    if mode == "simulated":
        torch.set_num_threads(1)
    g = torch.Generator().manual_seed(seed + 1)  # the same batches, in the same order, per method
    try:
        with runner:
            t0 = time.perf_counter()
            for epoch in range(epochs):
                perm = torch.randperm(len(x_train), generator=g)
                bar = tqdm(perm.split(batch), desc=f"{method} epoch {epoch + 1}", unit="step", leave=False,
                           disable=not verbose)
                losses = [runner.step(x_train[idx], y_train[idx]) for idx in bar]
                if verbose:
                    what = "associated loss (last layer)" if method == "AL" else "cross-entropy"
                    print(f"  {method:4s} epoch {epoch + 1}: mean {what} {sum(losses) / len(losses):.4f}",
                          flush=True)
            elapsed = time.perf_counter() - t0
            accuracy = (runner.predict(x_test).argmax(1) == y_test).float().mean().item()
    finally:
        torch.set_num_threads(threads)
    return accuracy, elapsed


def compare(methods=METHODS, mode: str = "process", epochs: int = 10, verbose: bool = True,
            batch: int = 64, **kw) -> list[tuple[str, float, float]]:
    """Train each method in turn; print and return (method, accuracy, seconds) rows."""
    for method in methods:
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}: choose from {', '.join(METHODS)}")
    data = load_digits()
    rows = []
    for method in methods:
        acc, secs = train(method, mode, epochs, batch=batch, data=data, verbose=verbose, **kw)
        rows.append((method, acc, secs))
    print(f"{'method':10s} {'held-out accuracy':>17s}   {'wall time':>9s}")
    for method, acc, secs in rows:
        print(f"{method:10s} {acc:17.1%}   {secs:8.1f}s")
    n_batches = -(-len(data[0]) // batch)
    print(f"({len(data[3])} held-out images, {epochs} epoch{'s' if epochs != 1 else ''} of {n_batches} "
          f"batches, {mode} mode)")
    return rows


if __name__ == "__main__":  # required: stage processes re-import this file
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=None, help="default 10 (--quick: 1)")
    p.add_argument("--mode", default="process", choices=["process", "simulated"])
    p.add_argument("--quick", action="store_true", help="one epoch: a smoke run")
    args = p.parse_args()
    compare(METHODS, args.mode, args.epochs if args.epochs is not None else (1 if args.quick else 10))
