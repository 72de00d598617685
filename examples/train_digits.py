"""pipeq's main example: a 3-stage MLP learns scikit-learn's digits, one process per stage.

    python examples/train_digits.py                       # 1F1B, process mode
    python examples/train_digits.py --schedule fill-drain --mode simulated

Each stage runs in its own process (pinned to its share of the CPU cores, or to cuda:k when CUDA
is there); activations and gradients travel between them over ZeroMQ. The run prints the loss
per epoch (with a progress bar of its steps) and the held-out accuracy, and checks the result
against nothing but the labels. It says what it does at once: torch is imported after that line.
"""

from __future__ import annotations

import argparse
import functools
import time

import pipeq  # light: no torch (it comes in with the first function that needs it)


def load_digits(seed: int = 0):
    """sklearn's bundled 8x8 digits (1797 images, offline): standardized train/test tensors."""
    import torch

    from examples.digits_data import digits

    x, y = digits()
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    n_test = len(x) // 5
    x_train, y_train, x_test, y_test = x[n_test:], y[n_test:], x[:n_test], y[:n_test]
    # std clamped at >= 1: pixels blank in every training image would blow a stray test dot up
    mean, std = x_train.mean(0), x_train.std(0).clamp_min(1.0)
    return (x_train - mean) / std, y_train, (x_test - mean) / std, y_test


def make_stages(seed: int = 0) -> list[nn.Module]:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return [
        nn.Sequential(nn.Linear(64, 128), nn.ReLU()),
        nn.Sequential(nn.Linear(128, 64), nn.ReLU()),
        nn.Linear(64, 10),
    ]


def train(schedule: str = "1f1b", mode: str = "process", epochs: int = 8, batch: int = 64,
          microbatches: int = 4, lr: float = 0.05, verbose: bool = True) -> float:
    """Train on digits through a PipelineRunner; returns the held-out accuracy."""
    import torch
    from torch import nn
    from tqdm import tqdm

    x_train, y_train, x_test, y_test = load_digits()
    runner = pipeq.PipelineRunner(
        make_stages(),
        loss_fn=nn.CrossEntropyLoss(),
        optimizer=functools.partial(torch.optim.SGD, lr=lr, momentum=0.9),
        schedule=schedule,
        microbatches=microbatches,
        mode=mode,
    )
    g = torch.Generator().manual_seed(1)
    steps_per_epoch = -(-len(x_train) // batch)
    if verbose:
        print(f"starting {runner.n_stages} stages...", flush=True)
    t_start = time.perf_counter()
    with runner:
        if verbose:
            print(f"stages ready in {time.perf_counter() - t_start:.1f} s; training {epochs} epochs of "
                  f"{steps_per_epoch} steps", flush=True)
        t0 = time.perf_counter()
        with tqdm(total=epochs * steps_per_epoch, unit="step", disable=not verbose, dynamic_ncols=True) as bar:
            for epoch in range(epochs):
                perm = torch.randperm(len(x_train), generator=g)
                losses = []
                for i in range(0, len(perm), batch):
                    idx = perm[i : i + batch]
                    losses.append(runner.step(x_train[idx], y_train[idx]))
                    bar.set_postfix(epoch=epoch + 1, loss=f"{losses[-1]:.4f}", refresh=False)
                    bar.update(1)
                if verbose:
                    bar.write(f"epoch {epoch + 1}: mean loss {sum(losses) / len(losses):.4f}")
        elapsed = time.perf_counter() - t0
        accuracy = (runner.predict(x_test).argmax(1) == y_test).float().mean().item()
    if verbose:
        print(f"{schedule} ({mode}): held-out accuracy {accuracy:.1%} "
              f"({len(y_test)} images), training took {elapsed:.1f} s")
    return accuracy


if __name__ == "__main__":  # required: stage processes re-import this file
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # the schedules that train plain stages (the others need more than stages: interlock_digits.py
    # trains local, pairwise and n-wise interlocking with heads, al_digits.py Associated Learning)
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "fill-drain", "gpipe", "global", "async"])
    p.add_argument("--mode", default="process", choices=["process", "simulated"])
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    args = p.parse_args()
    print(f"pipeq example: a 3-stage MLP learns scikit-learn's digits ({args.schedule}, {args.mode} mode, "
          f"{args.epochs} epochs)", flush=True)
    train(args.schedule, args.mode, args.epochs, microbatches=args.microbatches)
