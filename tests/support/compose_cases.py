"""Runs that combine the parallelisms with every numerics option, compile, ties and replica fault
tolerance, each against plain single-process training (tests/process/test_compose.py).

The model is a tiny tied language model: token ids in, next-token logits out, in 2 stages (4 for
ZBV's V), each a residual MLP block; stage 0 embeds the tokens, the last stage's head is tied to
the embedding (``ties``). Every width divides by 2, so each stage splits over 2 tensor-parallel
shards: the embedding by rows (vocabulary), the blocks' MLPs column then row, the head by
output rows, so the tied embedding and head hold the same piece of their one tensor on each shard
(or, ``redistribute``, the embedding by columns: the tie is summed whole and cut again).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D, T = 16, 8, 4
SGD = functools.partial(torch.optim.SGD, lr=0.2, momentum=0.9)

#: the features each run combines (one column each), as the issue names them
FEATURES = ("zbv", "zb-h1", "data_parallel", "fsdp", "tensor_parallel", "compile", "ties", "fault_tolerance",
            "recompute", "bf16", "clip_grad_norm")


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        return h + self.mlp(h)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(h)


class Head(Block):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(super().forward(h))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def stages(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [Embed(), *[Block() for _ in range(n - 2)], Head()]


def tp_plans(n: int, redistribute: bool = False) -> list[dict[str, str]]:
    """Each stage's plan; ``redistribute``: the embedding split by columns (its dimension), the tied
    head by rows, so their pieces differ and the tie is summed whole."""
    block = {"mlp.0": "colwise", "mlp.2": "rowwise"}
    return [{"emb": "colwise" if redistribute else "rowwise", **block}, *[dict(block) for _ in range(n - 2)],
            {**block, "head": "colwise"}]


def tie_names(n: int) -> list[list[str]]:
    return [["0.emb.weight", f"{n - 1}.head.weight"]]


def batches(steps: int = 3, size: int = 16, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        seq = torch.randint(0, VOCAB, (size, T + 1), generator=g)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def reference(modules: list[nn.Module], data: Any, *, tied: bool, bf16: bool, clip: float | None):
    """Plain training in this process (:func:`models.reference_train`: the stages in a row, the tied
    head the embedding's tensor itself, full batches); the losses and the state under the runner's names."""
    from models import reference_train

    def tie(model: nn.Module) -> None:
        model[len(model) - 1].head.weight = model[0].emb.weight

    model, losses = reference_train(modules, lm_loss, SGD, data, clip, bf16, tie if tied else None)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def settings(row: dict[str, Any]) -> dict[str, Any]:
    """The runner's keyword arguments for one row of the covering array."""
    n = 4 if row["zbv"] else 2
    kw: dict[str, Any] = {"schedule": "zbv" if row["zbv"] else "zb-h1" if row["zb-h1"] else "1f1b"}
    if row["data_parallel"]:
        kw["data_parallel"] = 2
    if row["fsdp"]:  # with fault tolerance, FSDP's sharded replicas need a copy elsewhere: HSDP, 2 x 2
        kw.update(sharding="hsdp", shard_size=2, data_parallel=4) if row["fault_tolerance"] else \
            kw.update(sharding="fsdp")
    if row["tensor_parallel"]:
        kw.update(tensor_parallel=2, tp_plan=tp_plans(n, redistribute=row.get("redistribute", False)))
    if row["compile"]:
        kw["compile"] = {"backend": "aot_eager"}
    if row["ties"]:
        kw["ties"] = tie_names(n)
    if row["fault_tolerance"]:
        kw["fault_tolerance"] = "replicas"
    if row["recompute"]:
        kw["recompute"] = True
    if row["bf16"]:
        kw["precision"] = "bf16"
    if row["clip_grad_norm"]:
        kw["clip_grad_norm"] = 0.5
    return kw


def uncovered(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The pairs of :data:`FEATURES` that no row combines (zbv and zb-h1 are two schedules: never together)."""
    return [(a, b) for a, b in itertools.combinations(FEATURES, 2)
            if {a, b} != {"zbv", "zb-h1"} and not any(r[a] and r[b] for r in rows)]
