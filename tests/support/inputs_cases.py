"""Tree input cases: stages taking tuples and dicts, a two-part loss, the data, and the one-process reference."""

from __future__ import annotations

import functools

import torch
from torch import nn

from models import reference_train

SGD = functools.partial(torch.optim.SGD, lr=0.2, momentum=0.5)


class TwoInputs(nn.Module):
    """(tokens, {"mask": m}, scale) -> {"h": ..., "gate": ..., "note": "kept"}: a dict output."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 12)
        self.b = nn.Linear(6, 12)

    def forward(self, x, extra, scale):
        return {"h": torch.tanh(self.a(x)) * scale, "gate": torch.sigmoid(self.b(extra["mask"])), "note": "kept"}


class DictToTuple(nn.Module):
    """{"h", "gate", "note"} -> (features, an integer tensor, None): a tuple with a non-float and a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 12)

    def forward(self, d):
        assert d["note"] == "kept"
        return torch.relu(self.lin(d["h"] * d["gate"])), torch.arange(d["h"].shape[0]), None


class Head(nn.Module):
    """(features, ids, None) -> {"logits": ..., "aux": ...}"""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(12, 3)
        self.aux = nn.Linear(12, 1)

    def forward(self, h, ids, nothing):
        assert nothing is None and ids.dtype == torch.int64
        return {"logits": self.out(h), "aux": self.aux(h).squeeze(1)}


def two_part_loss(out, target):
    """A dict output against a (labels, {"value": regression target}) target."""
    labels, rest = target
    return nn.functional.cross_entropy(out["logits"], labels) + nn.functional.mse_loss(out["aux"], rest["value"])


def stages(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [TwoInputs(), DictToTuple(), Head()]


def batch(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, 6, generator=g), {"mask": torch.randn(n, 6, generator=g)}, 0.5)
    target = (torch.randint(0, 3, (n,), generator=g), {"value": torch.randn(n, generator=g)})
    return x, target


def reference(model_stages, batches):
    """Plain one-process training (:func:`models.reference_train`): (model, losses)."""
    return reference_train(model_stages, two_part_loss, SGD, batches)


def assert_states_close(got, want, atol=1e-6):
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=atol, rtol=1e-5, msg=k)
