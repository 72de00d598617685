"""A W that starts where its I stopped: B's gradients, bitwise, on awkward graphs, and no input-side node run twice."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from pipeq.stage.executor import StageExecutor
from pipeq.stage.numerics import Numerics
from pipeq.stage.spec import StageSpec

pytestmark = pytest.mark.timeout(60)

SGD = functools.partial(torch.optim.SGD, lr=0.1)
SIZES = [3, 2, 3]
W = 6


class _Count(torch.autograd.Function):
    """Identity that counts its backward calls."""

    calls = 0

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        _Count.calls += 1
        return g


class Shared(nn.Module):
    """One Linear applied twice (entries at two depths of one group), a frozen layer, an unused one."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.a, self.b, self.c, self.frozen, self.unused = (nn.Linear(W, W) for _ in range(5))
        self.frozen.requires_grad_(False)
        self.tied = tied

    def forward(self, x):
        h = self.a(x)
        if h.requires_grad:
            h.register_hook(lambda g: g * 2.0)  # on an entry's output: applied once, as in B
        h = torch.tanh(h)
        h = _Count.apply(self.frozen(h))
        return (self.a if self.tied else self.c)(torch.relu(self.b(h)))


class Untied(Shared):
    """As :class:`Shared`, each Linear used once (a hook on an entry's output, no chain)."""

    def __init__(self) -> None:
        super().__init__(tied=False)


class Outputs(nn.Module):
    """Outputs that do not all depend on the input: a parameter-only output, a parameter itself,
    a non-floating output, chunks (a node with two outputs), a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(W, 2 * W)
        self.norm = nn.LayerNorm(W)
        self.p = nn.Parameter(torch.randn(W))
        self.q = nn.Parameter(torch.randn(W))

    def forward(self, x):
        u, v = self.lin(x).chunk(2, dim=-1)
        h = self.p * 2.0
        return self.norm(u * torch.sigmoid(v)) + h, h.expand_as(x) * 3.0, self.q.expand_as(x) + 0.0, (x > 0).long()


class Block(nn.Module):
    """A small transformer block."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(W, 2, 2 * W, dropout=0.0, batch_first=True)

    def forward(self, x):
        return self.layer(x.view(x.shape[0], 2, W // 2).repeat(1, 1, 2))[:, 0]


def _run(make, index: int, split: bool, numerics: Numerics, frees: bool = False) -> list:
    """``frees``: the I frees what the W will not read (a split backward's stage in a run does)."""
    torch.manual_seed(0)
    module = make()
    last = index == 2
    ex = StageExecutor(index, 3, StageSpec(module, SGD, nn.MSELoss() if last else None), torch.device("cpu"))
    ex.set_numerics(numerics)
    g = torch.Generator().manual_seed(3)
    n = sum(SIZES)
    x, y = torch.randn(n, W, generator=g), torch.randn(n, W, generator=g)
    ex.begin(0, SIZES, True, x=x if index == 0 else None, target=y if last else None)
    ex.memory.split(frees)
    outs = [ex.forward(j, None if index == 0 else (torch.randn(m, W, generator=g),)) for j, m in enumerate(SIZES)]
    grads = []
    for o in outs:
        grads.append(None if last else tuple(torch.randn(t.shape, generator=g) for t in o if t.is_floating_point()))
    ins = [ex.input_grad(j, grads[j]) if split else ex.backward(j, grads[j]) for j in (1, 0, 2)]
    if split:
        for j in (0, 1, 2):  # the sum over microbatches in B's order (1, 0, 2 sums as 0, 1, 2)
            ex.weight_grad(j)
        assert not ex.backprop.pending
    return [ins, [p.grad for p in module.parameters()]]


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for u, v in zip(a, b):
            _same(u, v)
    else:
        assert a is None and b is None


NUMERICS = {"plain": Numerics(), "recompute": Numerics(recompute=(True,) * 3),
            "bf16": Numerics(precision="bf16"), "fp16": Numerics(precision="fp16")}


@pytest.mark.parametrize("numerics", list(NUMERICS))
@pytest.mark.parametrize("index", [0, 1, 2])
@pytest.mark.parametrize("make", [Shared, Untied, Outputs, Block], ids=lambda m: m.__name__)
def test_split_backward_is_bitwise_the_whole_backward(make, index, numerics):
    if make is Outputs and index == 2:
        pytest.skip("the loss takes one output")
    whole = _run(make, index, False, NUMERICS[numerics])
    split = _run(make, index, True, NUMERICS[numerics])
    _same(split, whole)
    assert any(g is not None and g.abs().sum() > 0 for g in split[1])


@pytest.mark.parametrize("numerics", list(NUMERICS))
@pytest.mark.parametrize("index", [0, 1, 2])
@pytest.mark.parametrize("make", [Shared, Untied, Outputs, Block], ids=lambda m: m.__name__)
def test_freeing_after_I_what_W_will_not_read_keeps_the_bits(make, index, numerics):
    """The same awkward graphs with what each I's W will not read freed (pipeq.stage.memory):
    B's bits still, and no W reads a freed tensor (it would raise FreedTensorError)."""
    if make is Outputs and index == 2:
        pytest.skip("the loss takes one output")
    _same(_run(make, index, True, NUMERICS[numerics], frees=True), _run(make, index, False, NUMERICS[numerics]))


def test_W_does_not_run_the_input_side_again():
    _Count.calls = 0
    _run(Untied, 1, False, Numerics())
    whole = _Count.calls
    _Count.calls = 0
    _run(Untied, 1, True, Numerics())
    assert whole == 3 and _Count.calls == 3  # once per microbatch, in I (W starts below it)


def test_W_frees_what_it_needed():
    import gc
    import weakref

    torch.manual_seed(0)
    module = Shared(tied=False)
    ex = StageExecutor(1, 3, StageSpec(module, SGD), torch.device("cpu"))
    ex.begin(0, [4], True)
    (out,) = ex.forward(0, (torch.randn(4, W),))
    leaves, outs, _ = ex.stash[0]
    saved = weakref.ref(outs[0].grad_fn._saved_mat1)  # the top Linear's input, which W needs
    del leaves, outs
    ex.input_grad(0, (torch.randn(4, W),))
    gc.collect()
    assert saved() is not None
    ex.weight_grad(0)
    gc.collect()
    assert saved() is None and not ex.backprop.pending
