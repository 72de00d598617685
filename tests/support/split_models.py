"""Whole models for pipeq.split's tests: a small GPT (tied embedding, mask, position ids), a skip net, an untraceable one."""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.qkv(x).split(C, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln1(h)) * mask.unsqueeze(-1)
        return h + self.mlp(self.ln2(h))


class TinyGPT(nn.Module):
    """Tied token embedding and LM head; every block takes the mask; position ids are an input
    (by default 0..T-1).
    Its forward skips removed modules (a split by module names keeps only a stage's own)."""

    def __init__(self, vocab: int = 40, d: int = 16, layers: int = 4, heads: int = 2, context: int = 16) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(context, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        if pos is None and self.tok_emb is not None:  # positions 0..T-1: an arange of the length
            pos = torch.arange(idx.shape[1], device=idx.device)
        h = self.tok_emb(idx) + self.pos_emb(pos) if self.tok_emb is not None else idx
        for block in self.blocks:
            h = block(h, mask)
        if self.norm is not None:
            h = self.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h


def gpt_batch(n: int, *, vocab: int = 40, T: int = 8, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(idx, mask, pos, target) of ``n`` samples."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (n, T), generator=g)
    mask = (torch.rand(n, T, generator=g) > 0.2).float()
    pos = torch.randint(0, T, (n, T), generator=g)
    target = torch.randint(0, vocab, (n, T), generator=g)
    return idx, mask, pos, target


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


class SkipNet(nn.Module):
    """A U-Net-like skip: ``a``'s output is added back after ``c`` (across any split between)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.c = nn.Linear(d, d)
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.tanh(self.a(x))
        h = torch.tanh(self.c(torch.tanh(self.b(s))))
        return self.head(h + s)


class Untraceable(nn.Module):
    """Branches on a tensor's value: torch.export cannot capture one graph of it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:
            h = h * 2
        return self.b(h)


def reference_losses(model: nn.Module, batches: list, lr: float, named: bool, loss_fn=F.cross_entropy) -> list[float]:
    """Plain one-process training of ``model`` (in place) with SGD + momentum on ``batches``
    ((idx, mask, pos, target) with ``named``, else (x, target) and ``loss_fn``): each step's loss."""
    from models import reference_train

    def loss_of(m: nn.Module, b: tuple) -> torch.Tensor:
        if named:
            idx, mask, pos, target = b
            return lm_loss(m(idx, mask=mask, pos=pos), target)
        return loss_fn(m(b[0]), b[1])

    sgd = functools.partial(torch.optim.SGD, lr=lr, momentum=0.9)
    return reference_train([], None, sgd, batches, model=model, loss_of=loss_of)[1]


def pipeline_losses(runner, batches: list, named: bool, each_step=None) -> list[float]:
    """The same batches through a running PipelineRunner; ``each_step(runner)`` after each."""
    losses = []
    for b in batches:
        if named:
            idx, mask, pos, target = b
            losses.append(runner.step(idx, target, stage_inputs={"mask": mask, "pos": pos}))
        else:
            losses.append(runner.step(*b))
        if each_step is not None:
            each_step(runner)
    return losses


def assert_state_close(state: dict, model: nn.Module, atol: float = 1e-5) -> None:
    """``state`` (a runner's, under the model's names, each tensor once) equals ``model``'s."""
    want = model.state_dict()
    assert set(state) <= set(want), sorted(set(state) - set(want))
    assert all(n in state or any(want[n] is want[m] or want[n].data_ptr() == want[m].data_ptr() for m in state)
               for n in want), sorted(set(want) - set(state))
    for name, t in state.items():
        assert torch.allclose(t, want[name], atol=atol), (name, (t - want[name]).abs().max())


def tied_copies(runner, stages) -> list[torch.Tensor]:
    """Every copy of every tied parameter, in every stage process of every replica (process
    mode), or every stage (simulated mode)."""
    from pipeq.stage.info import info_of
    from pipeq.testing import backend_of

    be = backend_of(runner)
    n = len(stages)
    if runner.mode == "simulated":
        per = be.get_state()
    else:
        from pipeq.wire.messages import Kind

        got = be.ask_each(Kind.GET_STATE, Kind.STATE, "every copy", range(be.n_processes))
        per = [(got[g].extra["names"], list(got[g].tensors)) for g in range(be.n_processes)]
    out = []
    for g, (names, tensors) in enumerate(per):
        tied = {t.name for t in info_of(stages[g % n]).ties}
        out += [t for name, t in zip(names, tensors) if name in tied]
    return out


def assert_model_state_close(full: dict, model: nn.Module, atol: float = 1e-5) -> None:
    """``full`` (a runner's ``model_state_dict()``: every name of the model, the tied ones too)
    equals ``model.state_dict()``."""
    want = model.state_dict()
    assert sorted(full) == sorted(want), sorted(set(full) ^ set(want))
    for name, t in want.items():
        assert torch.allclose(full[name], t, atol=atol, rtol=0), (name, (full[name] - t).abs().max())


def trains_like_one_process(runner, stages, model: nn.Module, batches: list, copies: int, while_running=None,
                            lr: float = 0.1) -> nn.Module:
    """``runner`` (not started; SGD with ``lr`` and momentum 0.9) trains ``stages``, a split of the
    tied GPT ``model``, on ``batches`` as plain PyTorch trains ``model`` in one process: each
    step's loss, the state (``state_dict``: the tie once) and the whole model's state
    (``model_state_dict`` against the model's ``state_dict``) within 1e-5; after every step,
    ``copies`` copies of the tied weight, bitwise equal. ``while_running(runner)`` checks more
    before it closes. The reference model, trained."""
    ref = copy.deepcopy(model)
    want = reference_losses(ref, batches, lr, named=True)
    seen: list[list[torch.Tensor]] = []
    with runner:
        got = pipeline_losses(runner, batches, named=True, each_step=lambda r: seen.append(tied_copies(r, stages)))
        state, full = runner.state_dict(), runner.model_state_dict()
        if while_running is not None:
            while_running(runner)
    assert len(got) == len(want) and all(abs(a - b) <= 1e-5 for a, b in zip(got, want)), (got, want)
    assert_state_close(state, ref)
    assert "lm_head.weight" not in state and "tok_emb.weight" in state  # the tie once, under its first name
    assert_model_state_close(full, ref)
    assert len(seen) == len(batches)
    for step, held in enumerate(seen, 1):
        assert len(held) == copies and all(torch.equal(c, held[0]) for c in held), f"step {step}: copies differ"
    return ref


def gpt_runs(n_steps: int = 3, batch: int = 4) -> list[tuple[torch.Tensor, ...]]:
    return [gpt_batch(batch, seed=10 + i) for i in range(n_steps)]


def skip_case() -> tuple[SkipNet, list[tuple[torch.Tensor, torch.Tensor]], list[nn.Module]]:
    """A SkipNet, three batches for it, and its split into 3 stages (the skip crosses two points)."""
    import pipeq

    torch.manual_seed(0)
    model = SkipNet()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(3)]
    return model, batches, pipeq.split(model, (batches[0][0][:2],), split_points=["b", "c"])
