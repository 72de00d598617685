"""A job file's model split by module names: a tiny language model with a tied embedding, its data and loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, T = 13, 8, 6

JOB = """\
model = "split_jobs:lm"
split_modules = [["tok_emb", "blocks.0"], ["blocks.1", "blocks.2", "lm_head"]]
loss = "split_jobs:loss"
optimizer = "torch.optim:SGD"
optimizer_args = { lr = 0.1 }
data = "split_jobs:batches"
microbatches = 2
steps = 3
"""


class LM(nn.Module):
    """Embedding, tanh blocks, LM head tied to the embedding; skips the modules a stage lacks."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(3)])
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok_emb(idx) if self.tok_emb is not None else idx
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.lm_head(h) if self.lm_head is not None else h


def lm() -> LM:
    return LM()


def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def batches(epoch: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(epoch)
    return [(torch.randint(0, VOCAB, (4, T), generator=g), torch.randint(0, VOCAB, (4, T), generator=g))
            for _ in range(3)]


def reference(seed: int = 0) -> tuple[LM, list[float]]:
    """The job in one process: the model built under the job's seed, SGD lr 0.1, 3 batches."""
    torch.manual_seed(seed)
    model = lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches(0):
        opt.zero_grad()
        out = loss(model(x), y)
        out.backward()
        opt.step()
        losses.append(out.item())
    return model, losses
