"""pipeq.split: a traced stage computing a constant (torch.arange of position ids) still runs once pickled."""

from __future__ import annotations

import pickle

import torch
from torch import nn

import pipeq


class Positions(nn.Module):
    """Learned positions from ``torch.arange(T)``: export records a call on constants alone."""

    def __init__(self, d: int = 8, context: int = 6) -> None:
        super().__init__()
        self.tok = nn.Embedding(10, d)
        self.pos = nn.Embedding(context, d)
        self.mid = nn.Linear(d, d)
        self.head = nn.Linear(d, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(torch.tanh(self.mid(h)))


def _chain(stages, x):
    value = (x,)
    for s in stages:
        value = s(*value)
        value = value if isinstance(value, tuple) else (value,)
    return value[0]


def test_a_pickled_stage_keeps_the_constants_its_rebuilt_graph_holds():
    torch.manual_seed(0)
    model = Positions()
    idx = torch.randint(0, 10, (2, 6))
    stages = pipeq.split(model, (idx,), split_points=["mid"])
    # unpickling re-traces each graph's code: arange(6) becomes a tensor of the rebuilt graph
    copies = pickle.loads(pickle.dumps(list(stages)))
    x = torch.randint(0, 10, (5, 6))
    with torch.no_grad():
        assert torch.allclose(_chain(copies, x), model(x), atol=1e-6)
    # a buffer of the stage (moved with it), not a tensor of the model's state
    assert set(copies[0].state_dict()) == set(stages[0].state_dict())
    assert any(b.dtype == torch.int64 for b in copies[0].buffers())
