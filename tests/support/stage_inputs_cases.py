"""Stage-input cases: a tiny GPT-like model whose later stages take a mask and position ids from the driver, its data, and the one-process reference."""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

from pipeq.stage.info import set_info

V, D, T = 11, 8, 5  # vocabulary, width, sequence length
SGD = functools.partial(torch.optim.SGD, lr=0.3, momentum=0.5)


class Embed(nn.Module):
    """Stage 0: tokens (B, T) -> h (B, T, D)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)

    def forward(self, tokens):
        return self.emb(tokens)


class Block(nn.Module):
    """h, mask (B, T) of 0. / 1., pos (B, T) positions -> h: attention over the kept positions,
    after a position embedding; with ``head``, the token logits (B, T, V). ``scale``: a constant."""

    def __init__(self, head: bool = False) -> None:
        super().__init__()
        self.pos_emb = nn.Embedding(T, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, V) if head else None

    def forward(self, h, mask, pos, scale: float = 1.0):
        h = h + self.pos_emb(pos)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        att = q @ k.transpose(1, 2) / D ** 0.5 + (mask[:, None, :] - 1) * 1e4
        h = h + (att.softmax(-1) @ v) * scale
        return self.out(h) if self.out is not None else h


def token_loss(out, y):
    """Mean cross-entropy over every token."""
    return nn.functional.cross_entropy(out.reshape(-1, V), y.reshape(-1))


def stages(seed: int = 0, declare: bool = True) -> list[nn.Module]:
    """Embed, Block, Block(head); with ``declare`` the blocks declare ``mask`` and ``pos``."""
    torch.manual_seed(seed)
    out = [Embed().double(), Block().double(), Block(head=True).double()]
    if declare:
        for s in out[1:]:
            set_info(s, inputs=["mask", "pos"])
    return out


def batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(tokens, next tokens, {"mask", "pos"}) of ``n`` sequences; every row keeps its first position."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (n, T), generator=g)
    y = torch.randint(0, V, (n, T), generator=g)
    mask = (torch.rand(n, T, generator=g) > 0.3).double()
    mask[:, 0] = 1.0
    pos = torch.randint(0, T, (n, T), generator=g)
    return tokens, y, {"mask": mask, "pos": pos}


def forward(model: list[nn.Module], tokens, inputs, scale: float = 1.0):
    """The whole model in one process."""
    h = model[0](tokens)
    h = model[1](h, **inputs, scale=scale)
    return model[2](h, **inputs, scale=scale)


def reference(model_stages, batches, scale: float = 1.0):
    """Plain training of a copy of ``model_stages`` on full batches (:func:`models.reference_train`):
    (the model, the losses)."""
    from models import reference_train

    model, losses = reference_train([], None, SGD, batches, model=nn.ModuleList(copy.deepcopy(model_stages)),
                                    loss_of=lambda m, b: token_loss(forward(list(m), b[0], b[2], scale), b[1]))
    return list(model), losses


class RideEmbed(nn.Module):
    """The ride-through twin's stage 0: x = tokens | mask | pos as one float tensor (B, 3T) ->
    (h, mask, pos), which then ride through every stage (what stage inputs spare)."""

    def __init__(self, embed: Embed) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, x):
        return self.embed(x[:, :T].long()), x[:, T:2 * T], x[:, 2 * T:].long()


class RideBlock(nn.Module):
    """The ride-through twin's block: (h, mask, pos) -> (h, mask, pos), the logits on the last."""

    def __init__(self, block: Block) -> None:
        super().__init__()
        self.block = block

    def forward(self, h, mask, pos):
        out = self.block(h, mask, pos)
        return out if self.block.out is not None else (out, mask, pos)


def ride_through(model_stages) -> list[nn.Module]:
    """Copies of ``model_stages`` that take everything through x instead of stage inputs."""
    first, *blocks = copy.deepcopy(model_stages)
    return [RideEmbed(first)] + [RideBlock(b) for b in blocks]


def ride_x(tokens, inputs):
    """The ride-through twin's x for ``tokens`` and ``inputs``."""
    return torch.cat([tokens.double(), inputs["mask"], inputs["pos"].double()], dim=1)


def flat(model) -> dict[str, torch.Tensor]:
    """The stages' state under the runner's names."""
    from pipeq.checkpoint import flat_model

    return flat_model(list(model)).state_dict()


def assert_states_close(got, want, atol=1e-5):
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=atol, rtol=1e-5, msg=k)
