"""Tiny job modules for the launches of tests/launch/ and tests/unit/launch/ (not a test module).

Job files name these as ``launch_jobs:NAME``; the launches run from this folder, so every stage
process imports this module through the recipe's search path.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from pipeq.research import build_al

FEATURES, CLASSES, SAMPLES, BATCH = 8, 3, 240, 24


@functools.lru_cache(maxsize=1)
def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """Points labelled by a fixed random linear teacher: learnable in a few dozen steps."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(1)
    return x, y


def train_batches(epoch: int, batches: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of shuffled batches (10, or its first ``batches``); the shuffle depends on the
    epoch only."""
    x, y = _data()
    perm = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(100 + epoch))
    return [(x[i], y[i]) for i in perm.split(BATCH)][:batches]


def top2(output: torch.Tensor, target: torch.Tensor) -> float:
    """The share of samples whose target is among their two highest scores (an eval metric)."""
    return float((output.topk(2, dim=1).indices == target[:, None]).any(1).float().mean())


def heldout() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _data()
    return x[:60], y[:60]


def mlp_stages() -> list[nn.Module]:
    return [nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU()), nn.Sequential(nn.Linear(16, 16), nn.ReLU()),
            nn.Linear(16, CLASSES)]


def heads() -> list[nn.Module]:
    """The auxiliary heads of mlp_stages' first two stages."""
    return [nn.Linear(16, CLASSES), nn.Linear(16, CLASSES)]


def al_layers() -> list[nn.Module]:
    blocks = [nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU()), nn.Sequential(nn.Linear(16, 12), nn.ReLU()),
              nn.Sequential(nn.Linear(12, 8), nn.Tanh())]
    return build_al(blocks, [16, 12, 8], CLASSES, label_widths=[8, 6, 6])


class SplitInput(nn.Module):
    """Stage 0 of pair_stages: takes x as (first half of the features, {"rest": second half})."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(FEATURES // 2, 16)
        self.b = nn.Linear(FEATURES - FEATURES // 2, 16)

    def forward(self, first: torch.Tensor, extra: dict) -> torch.Tensor:
        return torch.relu(self.a(first) + self.b(extra["rest"]))


def pair_stages() -> list[nn.Module]:
    return [SplitInput(), nn.Linear(16, CLASSES)]


def pair_batches(epoch: int) -> list[tuple[tuple, torch.Tensor]]:
    """train_batches with x as a tuple (features[:4], {"rest": features[4:]})."""
    return [((x[:, :FEATURES // 2], {"rest": x[:, FEATURES // 2:]}), y) for x, y in train_batches(epoch)]


class _Picky(nn.Module):
    """A stage that raises on an input holding a value over 1e6 (a bug that comes back at the same step)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().max() > 1e6:
            raise ValueError("a value over 1e6 in this batch")
        return self.inner(x)


def picky_stages() -> list[nn.Module]:
    """mlp_stages whose stage 0 raises on poisoned_batches' third batch, every time it meets it."""
    return [_Picky(), nn.Sequential(nn.Linear(16, 16), nn.ReLU()), nn.Linear(16, CLASSES)]


class _Crashing(_Picky):
    """A stage whose native code crashes (SIGSEGV) on an input holding a value over 1e6, once
    what was in flight before it has had time to finish."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().max() > 1e6:
            import os
            import signal
            import time

            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGSEGV)
        return self.inner(x)


def crashing_stages() -> list[nn.Module]:
    """mlp_stages whose stage 0 dies of a SIGSEGV on poisoned_batches' third batch, every time."""
    return [_Crashing(), nn.Sequential(nn.Linear(16, 16), nn.ReLU()), nn.Linear(16, CLASSES)]


def poisoned_batches(epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """train_batches with the third batch's first value set to 1e9."""
    out = train_batches(epoch)
    x = out[2][0].clone()
    x[0, 0] = 1e9
    out[2] = (x, out[2][1])
    return out


def lm_stages() -> list[nn.Module]:
    """A token embedding, then a per-position MLP to the 13 tokens' logits: any length goes."""
    return [nn.Embedding(13, 6), nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 13))]


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A plain function: the mean cross-entropy over the tokens that are not -100."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def microbatch_batches(epoch: int = 0, steps: int = 3) -> list[tuple]:
    """Batches given as their microbatches (pipeq.Microbatches of x and of the target): three a
    batch, of different lengths and rows, the first row of each padded (-100) from its middle."""
    from pipeq import Microbatches

    g = torch.Generator().manual_seed(100 + epoch)
    out = []
    for _ in range(steps):
        xs, ys = [], []
        for rows, length in ((2, 7), (3, 4), (1, 9)):
            xs.append(torch.randint(0, 13, (rows, length), generator=g))
            y = torch.randint(0, 13, (rows, length), generator=g)
            y[0, length // 2:] = -100
            ys.append(y)
        out.append((Microbatches(xs), Microbatches(ys)))
    return out


def broken_stages() -> list[nn.Module]:
    """A stages function that fails (a file it needs is missing)."""
    raise FileNotFoundError("weights/encoder.pt: no such file")


def unpaired_batches(epoch: int) -> list[torch.Tensor]:
    """train_batches' x alone: no targets (a list: checked before any stage starts)."""
    return [x for x, _ in train_batches(epoch)]


def unpaired_stream(epoch: int):
    """The same as a generator: checked as its first batch comes."""
    yield from unpaired_batches(epoch)
