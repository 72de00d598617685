"""Tied weights' test model: a tiny GPT-like stage list whose token embedding (stage 0) is the LM head's weight (stage 2).

Module-level, hence picklable into stage processes. Flat-model names (``runner.state_dict()``)::

    stage 0   0.weight                          Embedding(VOCAB, DIM)
    stage 1   1.weight 1.bias [1.tied]          Mix: mean over the tokens, Linear, Tanh
    stage 2   2.weight 2.bias 3.weight          LayerNorm, Linear(DIM, VOCAB, bias=False) (tied)

``TIE = ["0.weight", "3.weight"]``; with ``spare=True`` stage 1 holds a copy it never uses
(``1.tied``, tied too: ``TIE3``), which contributes zero gradients.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

from models import reference_train

VOCAB, DIM, TOKENS = 11, 6, 4
TIE = ["0.weight", "3.weight"]
TIE3 = ["0.weight", "1.tied", "3.weight"]
SGD = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)
ADAM = functools.partial(torch.optim.Adam, lr=0.05)


class Mix(nn.Module):
    """(batch, tokens, DIM) -> (batch, DIM): the tokens' mean through Linear and Tanh; with
    ``spare``, it holds a parameter it never uses (a tied copy it does not need)."""

    def __init__(self, spare: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, DIM) * 0.5)
        self.bias = nn.Parameter(torch.zeros(DIM))
        if spare:
            self.tied = nn.Parameter(torch.zeros(VOCAB, DIM))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h.mean(dim=1) @ self.weight.t() + self.bias)


def lm_stages(seed: int = 0, *, shared: bool = True, spare: bool = False) -> list[nn.Module]:
    """The three stages; ``shared``: the head's weight *is* the embedding's (one Parameter, as a
    tied model builds it), else a separate tensor of other values; ``spare``: see the module."""
    torch.manual_seed(seed)
    emb = nn.Embedding(VOCAB, DIM)
    mix = Mix(spare)
    head = nn.Linear(DIM, VOCAB, bias=False)
    if shared:
        head.weight = emb.weight
        if spare:
            mix.tied = emb.weight
    return [nn.Sequential(emb), mix, nn.Sequential(nn.LayerNorm(DIM), head)]


def lm_batches(n: int, size: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (size, TOKENS), generator=g), torch.randint(0, VOCAB, (size,), generator=g))
            for _ in range(n)]


class _Chain(nn.Module):
    def __init__(self, stages: list[nn.Module]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for s in self.stages:
            x = s(x)
        return x


def reference(data, *, seed: int = 0, spare: bool = False, make_opt=SGD, clip: float | None = None):
    """One process trains the tied model (one Parameter for every name of the tie): its
    per-step losses and per-step state under the runner's names (the tie once, under its key)."""
    from pipeq.checkpoint import flat_model

    stages = lm_stages(seed, spare=spare)
    states = []

    def keep(model: nn.Module) -> None:
        sd = flat_model(list(model.stages)).state_dict()
        states.append({k: v.clone() for k, v in sd.items() if k not in ("3.weight", "1.tied")})

    _, losses = reference_train([], nn.CrossEntropyLoss(), make_opt, data, clip,
                                model=_Chain(copy.deepcopy(stages)),  # deepcopy keeps the sharing
                                after_step=keep)
    return losses, states


def copies(per_stage) -> list[torch.Tensor]:
    """Every copy of the tie in a backend's ``get_state()`` (per stage: local names, tensors)."""
    where = {0: ["0.weight"], 1: ["tied"], 2: ["1.weight"]}
    out = []
    for k, (names, tensors) in enumerate(per_stage):
        out += [t for n, t in zip(names, tensors) if n in where[k]]
    return out


def assert_close(state, want, atol: float = 1e-5) -> None:
    assert sorted(state) == sorted(want)
    for key in want:
        torch.testing.assert_close(state[key], want[key], atol=atol, rtol=0, msg=key)


def every_copy(runner) -> list[torch.Tensor]:
    """Every copy of the tie in every stage process of a process-mode runner (every replica's):
    GET_STATE asked of each, as ``ProcessBackend.get_state`` asks replica 0's."""
    from pipeq.testing import backend_of
    from pipeq.wire.messages import Kind

    be = backend_of(runner)
    n = be.n_stages
    got = be.ask_each(Kind.GET_STATE, Kind.STATE, "every copy", range(be.n_processes))
    out = []
    for r in range(be.replicas):
        out += copies([(got[r * n + k].extra["names"], list(got[r * n + k].tensors)) for k in range(n)])
    return out
