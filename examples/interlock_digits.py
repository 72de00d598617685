"""Interlocking backpropagation: a 4-stage ResNet on digits, end-to-end vs local vs interlocked.

    python examples/interlock_digits.py                          # all four schemes, process mode
    python examples/interlock_digits.py --schemes global pairwise --epochs 4
    python examples/interlock_digits.py --quick --mode simulated # a smoke run in one process
    python examples/interlock_digits.py --head gbpl_fc --arch 16,2/32,2   # other heads, a deeper net

The network is a small basic-block ResNet on scikit-learn's 8x8 digits (1 channel), built with its
heads by ``pipeq.models.resnet.resnet`` from spec strings as in the interlocking-backprop paper's code:
architecture ``16,1/32,1/64,1`` (16 planes at 8x8, 32 at 4x4, 64 at 2x2) cut into 4 stages, the
stem | a block | a block | the last block and the classifier, and each stage but the last owns an
auxiliary head ``conv32_bn_gbpl_fc`` (conv3x3 -> 32 channels, BN, ReLU, global average pool,
Linear -> 10 classes). The schemes differ in which loss trains each stage's main path (Gomez et
al., "Interlocking Backpropagation: Improving depthwise model-parallelism", arXiv 2010.04116;
docs/guides/research.md states the losses):

- global: plain end-to-end backprop (the heads learn beside it, from detached outputs);
- local: every stage learns from its own head only; no gradient crosses a stage boundary;
- pairwise: stage k's main path learns from stage k+1's head, so each loss crosses one boundary;
- 3-wise (``nwise``, d = 2): stage k learns from the loss two stages up (stages 1-2: the real one).

Every scheme starts from the same weights, sees the same batches in the same order for the same
epochs, and is judged on the same held-out fifth of the data through the main path only
(``runner.predict``). A real run (process mode, ``threads_per_stage=1``, a shared 2-core virtual
machine; 24.9 s in all)::

    $ python examples/interlock_digits.py
    ...
    scheme     held-out accuracy   wall time
    global                 97.8%        4.3s
    local                  99.2%        4.1s
    pairwise               98.9%        4.9s
    3-wise                 98.3%        5.3s
    (359 held-out images, 6 epochs, process mode)

The accuracies repeat exactly from run to run, and ``--mode simulated`` (one thread, as each stage
process has) gives the same ones. A point is 3-4 of the 359 images, and the order moves with the
seed: with ``compare(seed=1)`` and ``seed=2`` global made 98.9% and 98.3%, local 99.4% twice,
pairwise 99.7% and 99.2%, 3-wise 98.6% and 98.1%. Over the three seeds local and pairwise beat
end-to-end training and 3-wise stayed within a point of it: on data this small the convolutional
heads likely act as deep supervision. The wall times (training epochs only, 138 steps of 4
microbatches) move with the machine's load: over five runs with other work on the machine global
took 4.3 to 13.6 s, pairwise 4.9 to 13.9 s. This model is so small that a step is bound by the
latency of the hops between 4 processes on 2 cores, not by compute, so these times say little
about the schedules; ``bench/bench_interlock.py`` measures them on stages of fixed cost.
"""

from __future__ import annotations

import argparse
import functools
import re
import time

if __name__ == "__main__":  # said at once: importing torch takes a second or two
    print(f"pipeq example: {__doc__.splitlines()[0]}", flush=True)

import torch
from tqdm import tqdm
from torch import nn

import pipeq
from pipeq.models.resnet import resnet

N_STAGES = 4
SCHEMES = ("global", "local", "pairwise", "3-wise")
ARCH = "16,1/32,1/64,1"  # planes,blocks per superblock: 16 x 8x8, 32 x 4x4, 64 x 2x2
HEAD = "conv32_bn_gbpl_fc"  # each head: conv3x3 -> 32, BN, ReLU, global average pool, Linear -> 10
BLOCKS_PER_COMPONENT = "1,1,1,rest"  # 4 stages: the stem | block 16 | block 32 | block 64 + output


def load_digits(seed: int = 0):
    """sklearn's bundled 8x8 digits (1797 images, offline): standardized train/test tensors, the
    images as [N, 1, 8, 8]."""
    from examples.digits_data import digits

    x, y = digits()
    x = x.reshape(-1, 1, 8, 8) / 16.0
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    n_test = len(x) // 5
    x_train, y_train, x_test, y_test = x[n_test:], y[n_test:], x[:n_test], y[:n_test]
    mean, std = x_train.mean(), x_train.std()  # one scale for the image, not per pixel
    return (x_train - mean) / std, y_train, (x_test - mean) / std, y_test


def make_model(seed: int = 0, arch: str = ARCH, head: str = HEAD) -> tuple[list[nn.Module], list[nn.Module]]:
    """(4 stages, 3 auxiliary heads) of a basic-block ResNet on 1x8x8 images, the same weights
    for the same seed: the stem | a block | a block | the rest (see pipeq.models.resnet)."""
    torch.manual_seed(seed)
    return resnet("basic", arch, head, BLOCKS_PER_COMPONENT, n_classes=10, in_channels=1, stem_channels=16)


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
          data=None, verbose: bool = True, arch: str = ARCH, head: str = HEAD,
          steps_per_epoch: int | None = None) -> tuple[float, float]:
    """Train one scheme from the seed's initial weights; returns (held-out accuracy, wall seconds).

    The wall time is that of the training epochs only: stage start-up (the first runner also
    starts the fork server) and the held-out evaluation are left out. ``steps_per_epoch`` cuts
    every epoch short after that many batches (a smoke run).
    """
    x_train, y_train, x_test, y_test = data if data is not None else load_digits()
    stages, heads = make_model(seed, arch, head)
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
            batches = perm.split(batch)[:steps_per_epoch]
            bar = tqdm(batches, desc=f"{scheme} epoch {epoch + 1}", unit="step", leave=False, disable=not verbose)
            losses = [runner.step(x_train[idx], y_train[idx]) for idx in bar]
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
    cut = kw.get("steps_per_epoch")
    length = f"{epochs} epoch{'s' if epochs != 1 else ''}" + (f" of {cut} steps" if cut else "")
    print(f"({len(data[3])} held-out images, {length}, {mode} mode)")
    return rows


def main(argv: list[str] | None = None) -> list[tuple[str, float, float]]:
    """The command line: train the schemes asked for, print the table, return its rows."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES),
                   help="global, local, pairwise, K-wise (nwise with d = K-1); default: all four")
    p.add_argument("--epochs", type=int, default=None, help="default 6 (--quick: 1)")
    p.add_argument("--mode", default="process", choices=["process", "simulated"])
    p.add_argument("--quick", action="store_true", help="one epoch: a smoke run")
    p.add_argument("--arch", default=ARCH, help=f"the ResNet's planes,blocks per superblock (default {ARCH}; "
                   "at least 2 blocks in all: the stages are the stem | a block | a block | the rest)")
    p.add_argument("--head", default=HEAD, metavar="SPEC",
                   help=f"the auxiliary heads' spec (default {HEAD}): conv<ch>, bn, gbpl, fc<width>, fc "
                   "joined by '_', ending in fc (see pipeq.models.resnet)")
    args = p.parse_args(argv)
    for name in args.schemes:
        try:
            scheme_args(name)
        except ValueError as exc:
            p.error(str(exc))
    try:
        make_model(0, args.arch, args.head)  # a bad --arch or --head, before anything starts
    except ValueError as exc:
        p.error(str(exc))
    epochs = args.epochs if args.epochs is not None else (1 if args.quick else 6)
    if args.mode == "simulated":  # one thread, as each stage process has: the process mode's numbers
        torch.set_num_threads(1)
    return compare(args.schemes, args.mode, epochs, arch=args.arch, head=args.head)


if __name__ == "__main__":  # required: stage processes re-import this file
    main()
