"""Compiled stages' cases: a tiny GPT-style model (one block of width 32, tied embedding and LM head,
positions from the length: any length up to 64), its batches of changing lengths, plain one-process
training to hold a pipeline against, and a pipeline run that reports its stages' stats."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

import pipeq

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
VOCAB, D, CONTEXT = 64, 32, 64
#: the lengths a run trains on, in turn (the issue's)
LENGTHS = (32, 24, 40, 17)
#: a split by module names: stage 0 embeds and runs the block, stage 1 the norm and head (the tie crosses)
BY_NAME = [["tok_emb", "pos_emb", "blocks.0"], ["norm", "lm_head"]]


class Block(nn.Module):
    def __init__(self, d: int = D, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        B, T, C = h.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2)
                   for t in self.qkv(self.ln1(h)).split(C, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return h + self.mlp(self.ln2(h))


class GPT(nn.Module):
    """Tokens ``(B, T)`` -> logits ``(B, T, VOCAB)``; a split by module names drops the modules
    other stages hold (the forward skips what is None)."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, D)
        self.pos_emb = nn.Embedding(CONTEXT, D)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.lm_head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            h = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        else:
            h = idx
        for block in self.blocks or ():  # None on a stage of a split by names that holds no block
            h = block(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(layers=1)  # one block: inductor compiles each stage in about half the time of two


def batches(lengths=LENGTHS, n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch of ``n`` sequences per length."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (n, T), generator=g), torch.randint(0, VOCAB, (n, T), generator=g))
            for T in lengths]


def reference(m: nn.Module, data: list) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain one-process training of a copy of ``m`` (:func:`models.reference_train`): each step's loss, and its state."""
    from models import reference_train

    model, losses = reference_train([m], lm_loss, SGD, data)
    return losses, model[0].state_dict()


def run(stages, data: list, schedule: str = "1f1b", microbatches: int = 2,
        **settings) -> tuple[list[float], dict, list[dict]]:
    """``stages`` trained on ``data``: the losses, the state, every stage's stats."""
    with pipeq.PipelineRunner(list(stages), lm_loss, SGD, schedule, microbatches, **settings) as r:
        losses = [r.step(x, y) for x, y in data]
        return losses, r.state_dict(), r.stats()


def assert_trains_like_one_process(got: tuple, want: tuple, tol: float = 1e-5) -> None:
    losses, state, _ = got
    ref_losses, ref_state = want
    assert len(losses) == len(ref_losses) and all(abs(a - b) <= tol for a, b in zip(losses, ref_losses)), \
        (losses, ref_losses)
    assert set(state) <= set(ref_state), sorted(set(state) - set(ref_state))  # the model's own names
    for name, t in state.items():
        assert torch.allclose(t, ref_state[name], atol=tol, rtol=0), (name, (t - ref_state[name]).abs().max())
