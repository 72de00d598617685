"""Interlocking backpropagation: a 4-stage residual CNN on digits, end-to-end vs local vs interlocked.

    python examples/interlock_digits.py                          # all four schemes, process mode
    python examples/interlock_digits.py --schemes global pairwise --epochs 4
    python examples/interlock_digits.py --quick --mode simulated # a smoke run in one process

Each of the 4 stages is a small residual CNN block on scikit-learn's 8x8 digits, and each stage
but the last owns an auxiliary head (pool + Linear -> 10 classes); the schemes differ in which
loss trains each stage's main path (arXiv 2010.04116; ``/work/shared/notes/algorithms.md``):

- global: plain end-to-end backprop (the heads learn beside it, from detached outputs);
- local: every stage learns from its own head only; no gradient crosses a stage boundary;
- pairwise: stage k's main path learns from stage k+1's head, so each loss crosses one boundary;
- 3-wise (``nwise``, d = 2): stage k learns from the loss two stages up (stages 1-2: the real one).

Every scheme starts from the same weights, sees the same batches in the same order for the same
epochs, and is judged on the same held-out fifth of the data through the main path only
(``runner.predict``). A real run (process mode, ``threads_per_stage=1``, a shared 2-core virtual
machine; about 30 s in all)::

    $ python examples/interlock_digits.py
    ...
    scheme     held-out accuracy   wall time
    global                 99.2%        4.8s
    local                  94.2%        4.8s
    pairwise               99.2%        5.6s
    3-wise                 99.4%        4.4s
    (359 held-out images, 6 epochs, process mode)

The accuracies repeat exactly from run to run; the wall times (training epochs only, 138 steps of
4 microbatches) move by a second or more with the machine's load. This model is so small that a
step is bound by the latency of the hops between 4 processes on 2 cores, not by compute, so the
schedules hardly differ in time here; ``bench/bench_interlock.py`` measures them on stages of
fixed cost.
"""

from __future__ import annotations

import argparse
import functools
import re
import time

import torch
from torch import nn

import pipeq

N_STAGES = 4
SCHEMES = ("global", "local", "pairwise", "3-wise")


def load_digits(seed: int = 0):
    """sklearn's bundled 8x8 digits (1797 images, offline): standardized train/test tensors."""
    try:
        from sklearn.datasets import load_digits as _load
    except ImportError:  # an optional dependency: pipeq itself does not need it
        raise ModuleNotFoundError("the digits examples load scikit-learn's bundled digits: "
                                  "pip install -e '.[examples]' (or pip install scikit-learn)") from None

    data = _load()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    n_test = len(x) // 5
    x_train, y_train, x_test, y_test = x[n_test:], y[n_test:], x[:n_test], y[:n_test]
    mean, std = x_train.mean(), x_train.std()  # one scale for the image, not per pixel
    return (x_train - mean) / std, y_train, (x_test - mean) / std, y_test


class ResBlock(nn.Module):
    """conv3x3 - ReLU - conv3x3, plus the input (a 1x1 strided conv when the shape changes), ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.skip = (nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))
                     if stride != 1 or c_in != c_out else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.skip(x) + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class Stem(nn.Module):
    """Flat 64 pixels -> 1x8x8 image -> conv 1->c -> ReLU."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x.reshape(-1, 1, 8, 8)))


class PoolLinear(nn.Module):
    """Global average pool, then Linear(c -> classes): the last stage's classifier and every head."""

    def __init__(self, c: int, classes: int = 10) -> None:
        super().__init__()
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))


def make_model(seed: int = 0, c1: int = 16, c2: int = 32) -> tuple[list[nn.Module], list[nn.Module]]:
    """(4 stages, 3 auxiliary heads), the same weights for the same seed."""
    torch.manual_seed(seed)
    stages: list[nn.Module] = [
        nn.Sequential(Stem(c1), ResBlock(c1, c1)),            # 16 x 8 x 8
        ResBlock(c1, c2, stride=2),                           # 32 x 4 x 4
        ResBlock(c2, c2),                                     # 32 x 4 x 4
        nn.Sequential(ResBlock(c2, c2), PoolLinear(c2)),      # 10 logits
    ]
    heads: list[nn.Module] = [PoolLinear(c1), PoolLinear(c2), PoolLinear(c2)]
    return stages, heads


def scheme_args(scheme: str) -> dict:
    """PipelineRunner arguments of a scheme: global, local, pairwise or K-wise (nwise, d = K-1)."""
    if scheme in ("global", "local", "pairwise"):
        return {"schedule": scheme}
    m = re.fullmatch(r"(\d+)-wise", scheme)
    if m and 2 <= int(m.group(1)) <= N_STAGES:
        return {"schedule": pipeq.schedules.Interlock("nwise", distance=int(m.group(1)) - 1)}
    raise ValueError(f"unknown scheme {scheme!r}: global, local, pairwise or K-wise, 2 <= K <= {N_STAGES}")


def train(scheme: str, mode: str = "process", epochs: int = 6, batch: int = 64,
          microbatches: int = 4, lr: float = 2e-3, seed: int = 0, start_method: str = "forkserver",
          data=None, verbose: bool = True) -> tuple[float, float]:
    """Train one scheme from the seed's initial weights; returns (held-out accuracy, wall seconds).

    The wall time is that of the training epochs only: stage start-up (the first runner also
    starts the fork server) and the held-out evaluation are left out.
    """
    x_train, y_train, x_test, y_test = data if data is not None else load_digits()
    stages, heads = make_model(seed)
    runner = pipeq.PipelineRunner(
        stages, nn.CrossEntropyLoss(),
        functools.partial(torch.optim.Adam, lr=lr),
        microbatches=microbatches, mode=mode, aux_heads=heads,
        threads_per_stage=1, start_method=start_method, **scheme_args(scheme),
    )
    g = torch.Generator().manual_seed(seed + 1)  # the same batches, in the same order, per scheme
    with runner:
        t0 = time.perf_counter()
        for epoch in range(epochs):
            perm = torch.randperm(len(x_train), generator=g)
            losses = [runner.step(x_train[idx], y_train[idx]) for idx in perm.split(batch)]
            if verbose:
                print(f"  {scheme:9s} epoch {epoch + 1}: mean loss {sum(losses) / len(losses):.4f}",
                      flush=True)
        elapsed = time.perf_counter() - t0
        accuracy = (runner.predict(x_test).argmax(1) == y_test).float().mean().item()
    return accuracy, elapsed


def compare(schemes=SCHEMES, mode: str = "process", epochs: int = 6, verbose: bool = True,
            **kw) -> list[tuple[str, float, float]]:
    """Train each scheme in turn; print and return (scheme, accuracy, seconds) rows."""
    data = load_digits()
    rows = []
    for scheme in schemes:
        scheme_args(scheme)  # refuse a bad name before training anything
    for scheme in schemes:
        acc, secs = train(scheme, mode, epochs, data=data, verbose=verbose, **kw)
        rows.append((scheme, acc, secs))
    print(f"{'scheme':10s} {'held-out accuracy':>17s}   {'wall time':>9s}")
    for scheme, acc, secs in rows:
        print(f"{scheme:10s} {acc:17.1%}   {secs:8.1f}s")
    print(f"({len(data[3])} held-out images, {epochs} epoch{'s' if epochs != 1 else ''}, {mode} mode)")
    return rows


if __name__ == "__main__":  # required: stage processes re-import this file
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES),
                   help="global, local, pairwise, K-wise (nwise with d = K-1); default: all four")
    p.add_argument("--epochs", type=int, default=None, help="default 6 (--quick: 1)")
    p.add_argument("--mode", default="process", choices=["process", "simulated"])
    p.add_argument("--quick", action="store_true", help="one epoch: a smoke run")
    args = p.parse_args()
    for name in args.schemes:
        try:
            scheme_args(name)
        except ValueError as exc:
            p.error(str(exc))
    epochs = args.epochs if args.epochs is not None else (1 if args.quick else 6)
    compare(args.schemes, args.mode, epochs)
