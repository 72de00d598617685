"""The digits job of ``examples/digits.toml``: importable stages, data and evaluation set.

    pipeq launch examples/digits.toml                  # 3 stages, one host
    pipeq launch examples/digits.toml --steps 200 --checkpoint-every 50 --out runs/digits
    pipeq launch examples/digits_pairwise.toml         # pairwise interlocking, with heads()
    pipeq launch examples/digits_nwise.toml            # 3-wise interlocking, four_stages + four_heads
    pipeq launch examples/digits_async.toml            # asynchronous 1F1B (PipeDream)
    pipeq launch examples/digits_al.toml               # Associated Learning, al_stages
    pipeq launch examples/digits_plateau.toml          # ReduceLROnPlateau per epoch, top3 metric
    pipeq launch examples/digits_faults.toml           # Adam, StepLR, dropout; restarts by itself

A job file names these functions as ``examples.digits_job:NAME``; every stage process imports
this module and builds its own stage (the same weights on every host: the launcher seeds it).
"""

from __future__ import annotations

import functools

import torch
from torch import nn


def layers() -> list[nn.Module]:
    """The flat model: checkpoints name parameters by these layers' indices (0.weight, 2.bias...)."""
    return [nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)]


def stages() -> list[nn.Module]:
    """Three stages."""
    l = layers()
    return [nn.Sequential(*l[0:2]), nn.Sequential(*l[2:4]), nn.Sequential(*l[4:])]


def heads() -> list[nn.Module]:
    """Auxiliary heads for the interlocking schedules (examples/digits_pairwise.toml): stage k's
    reads stage k's output (128 and 64 features) and predicts the digit."""
    return [nn.Linear(128, 10), nn.Linear(64, 10)]


def four_stages() -> list[nn.Module]:
    """Four stages of a slightly deeper MLP (64-128-128-64-10), for interlocking schedules whose
    distance needs a fourth stage to differ from plain backprop: with N stages, n-wise
    interlocking of distance d < N-1 (examples/digits_nwise.toml: 3-wise, d = 2) is not global."""
    return [nn.Sequential(nn.Linear(64, 128), nn.ReLU()), nn.Sequential(nn.Linear(128, 128), nn.ReLU()),
            nn.Sequential(nn.Linear(128, 64), nn.ReLU()), nn.Linear(64, 10)]


def four_heads() -> list[nn.Module]:
    """The auxiliary heads of four_stages' first three stages (128, 128 and 64 features in)."""
    return [nn.Linear(128, 10), nn.Linear(128, 10), nn.Linear(64, 10)]


def al_stages(width: int = 128, n_layers: int = 3) -> list[nn.Module]:
    """Associated Learning layers (examples/digits_al.toml): ``pipeq.research.build_al`` over MLP
    blocks on the 64 pixels (Linear 64->width + ReLU, then Linear width->width + ReLU), each
    block the ``f`` of one layer, with Linear+Tanh bridges ``b``, label encoders ``g`` and
    decoders ``h`` of ``width`` features. One layer per stage."""
    from pipeq.research import build_al

    blocks = [nn.Sequential(nn.Linear(64 if i == 0 else width, width), nn.ReLU()) for i in range(n_layers)]
    return build_al(blocks, [width] * n_layers, 10)


def dropout_stages(p: float = 0.1) -> list[nn.Module]:
    """The three stages with dropout after each hidden layer (examples/digits_faults.toml): a
    restarted run must also bring back every stage's random stream to train the same weights."""
    l = layers()
    return [nn.Sequential(*l[0:2], nn.Dropout(p)), nn.Sequential(*l[2:4], nn.Dropout(p)), nn.Sequential(*l[4:])]


def two_stages() -> list[nn.Module]:
    """The same layers as two stages (a 3-stage checkpoint loads into this split)."""
    l = layers()
    return [nn.Sequential(*l[0:3]), nn.Sequential(*l[3:])]


@functools.lru_cache(maxsize=1)
def _digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """sklearn's bundled 8x8 digits (offline): standardized 80/20 train/test split."""
    from examples.digits_data import digits

    x, y = digits()
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    n_test = len(x) // 5
    mean, std = x[n_test:].mean(0), x[n_test:].std(0).clamp_min(1.0)  # constant pixels: no blow-up
    x = (x - mean) / std
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


def train_batches(epoch: int, batch: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of shuffled batches; the shuffle depends on the epoch only (resumable)."""
    x, y, _, _ = _digits()
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1000 + epoch))
    return [(x[i], y[i]) for i in perm.split(batch)]


def heldout() -> tuple[torch.Tensor, torch.Tensor]:
    _, _, x, y = _digits()
    return x, y


def top3(output: torch.Tensor, target: torch.Tensor) -> float:
    """An evaluation metric: the share of samples whose class is among their 3 highest scores."""
    return float((output.topk(3, dim=1).indices == target[:, None]).any(1).float().mean())


def image_batches(epoch: int, batch: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`train_batches` as 1x8x8 images, for convolutional stages (pipeq.models.resnet)."""
    return [(x.view(-1, 1, 8, 8), y) for x, y in train_batches(epoch, batch)]


def heldout_images() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = heldout()
    return x.view(-1, 1, 8, 8), y
