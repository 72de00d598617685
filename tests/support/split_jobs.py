"""Job files' models split by module names: a tiny language model with a tied embedding, and a GPT
(split_models.TinyGPT) in 4 stages under ZBV; their data and loss."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from split_models import TinyGPT, lm_loss

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
    """The job in one process (:func:`models.reference_train`): the model built under the job's
    seed, SGD lr 0.1, 3 batches."""
    from models import reference_train

    torch.manual_seed(seed)
    return reference_train([], loss, functools.partial(torch.optim.SGD, lr=0.1), batches(0), model=lm())


#: TinyGPT (tied embedding and LM head) in 4 stages, two per process under ZBV (V placement:
#: process 0 holds stages 0 and 3, so the tie's copies are summed in its memory; process 1 holds
#: 1 and 2); checkpoints every 2 steps, and a restart after a stage fails
GPT_JOB = """\
model = "split_jobs:gpt"
split_modules = [["tok_emb", "pos_emb", "blocks.0"], ["blocks.1"], ["blocks.2"], ["blocks.3", "norm", "lm_head"]]
loss = "split_models:lm_loss"
optimizer = "torch.optim:SGD"
optimizer_args = { lr = 0.1, momentum = 0.9 }
data = "split_jobs:gpt_batches"
schedule = "zbv"
stages_per_process = 2
microbatches = 4
steps = 6
checkpoint_every = 2
eval_data = "split_jobs:gpt_heldout"
eval_every = 3
max_restarts = 1
seed = 0
"""


class GPT(TinyGPT):
    """TinyGPT on tokens alone (a launched job's x): every token counts (the mask is ones) and
    each sits at its own position. A stage after the first gets the hidden states as ``idx``."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        B, T = idx.shape[:2]
        return super().forward(idx, torch.ones(B, T), torch.arange(T).expand(B, T))


def gpt() -> GPT:
    return GPT()


#: the GPT job's sequence lengths, step by step: every batch its own (a language model's data)
GPT_LENGTHS = (8, 6, 11, 5, 8, 13)


def gpt_batches(epoch: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Six batches of 8 token sequences (TinyGPT's vocabulary of 40) of the lengths
    :data:`GPT_LENGTHS`, and their targets."""
    g = torch.Generator().manual_seed(100 + epoch)
    return [(torch.randint(0, 40, (8, t), generator=g), torch.randint(0, 40, (8, t), generator=g))
            for t in GPT_LENGTHS]


def gpt_heldout() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The GPT job's evaluation batches: two lengths, neither a training one."""
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, 40, (4, t), generator=g), torch.randint(0, 40, (4, t), generator=g)) for t in (7, 12)]


def gpt_reference(steps: int = 6, seed: int = 0, eval_every: int = 3) -> tuple[GPT, list[float], list[float]]:
    """The GPT job in one process: the model built under the job's seed, SGD lr 0.1 with
    momentum 0.9, the job's batches in order; its losses, and the held-out loss (the mean over
    the tokens of :func:`gpt_heldout`'s batches) every ``eval_every`` steps."""
    from models import reference_train

    torch.manual_seed(seed)
    evals: list[float] = []
    steps_done = [0]

    def evaluate(model: GPT) -> None:
        steps_done[0] += 1
        if steps_done[0] % eval_every == 0:
            with torch.no_grad():
                held = gpt_heldout()  # the loss over all their tokens (loss_weighting "token")
                evals.append(sum(lm_loss(model(hx), hy).item() * hy.numel() for hx, hy in held)
                             / sum(hy.numel() for _, hy in held))

    model, losses = reference_train([], lm_loss, functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
                                    gpt_batches(0)[:steps], model=gpt(), after_step=evaluate)
    return model, losses, evals
