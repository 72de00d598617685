"""Checkpoint cases with heads: Interlock stages, heads and runs, and AL layers, tokens and runs."""

from __future__ import annotations

import functools

import torch
from torch import nn

import pipeq
from pipeq import schedules
from pipeq.research import build_al_lstm

FAST = dict(start_method="forkserver")
ADAM = functools.partial(torch.optim.Adam, lr=1e-2)
STEP_LR = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5)
# its milestones are a Counter of ints, keys the wire refuses: they travel as items
MULTISTEP = functools.partial(torch.optim.lr_scheduler.MultiStepLR, milestones=[2, 3], gamma=0.1)


def stages(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(0.3)),
            nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU()), nn.Linear(8, 4)]


def heads(seed: int = 1) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Dropout(0.2), nn.Linear(8, 4)), nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 4))]


def batches(steps: int, size: int = 12, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 6, generator=g), torch.randint(0, 4, (size,), generator=g)) for _ in range(steps)]


def interlocking(schedule, mode: str, seed: int = 0):
    # in process mode (the snapshots cross the wire) a MultiStepLR, StepLR otherwise
    scheduler = MULTISTEP if mode == "process" else STEP_LR
    return lambda: pipeq.PipelineRunner(stages(seed), nn.CrossEntropyLoss(), ADAM, schedule, 3, mode=mode,
                                        aux_heads=heads(seed + 1), lr_scheduler=scheduler, **FAST)


VOCAB, CLASSES = 13, 3


def tokens(steps: int, size: int = 8, seed: int = 4):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(1, VOCAB, (size, 6), generator=g)
        x[:, 4:][torch.rand(size, 2, generator=g) < 0.5] = 0
        x[:, 5][x[:, 4] == 0] = 0  # padding at the end only
        out.append((x, torch.randint(0, CLASSES, (size,), generator=g)))
    return out


def al_layers(seed: int = 0):
    torch.manual_seed(seed)
    return build_al_lstm(VOCAB, CLASSES, embed_dim=5, hidden=4, lstm_layers=2, label_width=3)


def al_run(mode: str):
    return lambda: pipeq.PipelineRunner(al_layers(), None, ADAM, schedules.AssociatedLearning(), 2, mode=mode,
                                        lr_scheduler=STEP_LR, **FAST)
