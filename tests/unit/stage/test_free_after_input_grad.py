"""A split backward frees, after a microbatch's ``I``, what its forward saved that its ``W`` will not
read (pipeq.stage.memory's ``keep_for_w``, pipeq.stage.grad_graph's ``weight_nodes``): on a block
of activation-heavy non-linear ops (explicit softmax attention, GELU, LayerNorm, dropout) a
microbatch waiting for its ``W`` holds less than after its ``F``, the ``W`` still gives ``B``'s
gradients bit for bit, and a backward that would read a freed tensor fails loudly."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pipeq
from pipeq.stage.executor import StageExecutor
from pipeq.stage.loss import microbatch_weights
from pipeq.stage.memory import FreedTensorError
from pipeq.stage.numerics import Numerics
from pipeq.stage.spec import StageSpec
from pipeq.testing import backend_of

pytestmark = pytest.mark.timeout(60)

D, T, HEADS = 16, 32, 4
SIZES = [2, 2, 2]
SGD = functools.partial(torch.optim.SGD, lr=0.1)


class _Block(nn.Module):
    """Pre-norm attention with an explicit softmax (its T x T probabilities saved) and dropout, and
    a 4x GELU MLP: what a split backward's W does not read dominates what the F saves."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.drop = nn.Dropout(0.1)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b = h.shape[0]
        q, k, v = self.qkv(self.ln1(h)).view(b, T, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        att = self.drop((q @ k.transpose(-1, -2) / (D // HEADS) ** 0.5).softmax(-1))
        h = h + self.proj((att @ v).transpose(1, 2).reshape(b, T, D))
        return h + self.mlp(self.ln2(h))


def _run(index: int, split: bool, frees: bool = True, recompute: bool = False):
    """Stage ``index`` of 3 (two blocks), one measured step of 3 microbatches, forwards then
    backwards in another order: its executor, input gradients and parameter gradients."""
    torch.manual_seed(0)
    module = nn.Sequential(_Block(), _Block())
    ex = StageExecutor(index, 3, StageSpec(module, SGD, nn.MSELoss() if index == 2 else None), torch.device("cpu"))
    ex.set_numerics(Numerics(recompute=(recompute,) * 3))
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(6, T, D, generator=g), torch.randn(6, T, D, generator=g)
    ex.memory.ask()
    ex.begin(1, SIZES, True, x=x if index == 0 else None, target=y if index == 2 else None,
             weights=microbatch_weights(nn.MSELoss(), y, SIZES))
    ex.memory.split(split and frees)
    received = [None if index == 0 else (torch.randn(n, T, D, generator=g),) for n in SIZES]
    grads = [None if index == 2 else (torch.randn(n, T, D, generator=g),) for n in SIZES]
    torch.manual_seed(1)  # the dropout masks
    for j in range(3):
        ex.forward(j, received[j])
    ins = []
    for j in (2, 0, 1):
        ins.append(ex.input_grad(j, grads[j]) if split else ex.backward(j, grads[j]))
    for j in (0, 2, 1) if split else ():
        ex.weight_grad(j)
    return ex, ins, [p.grad.clone() for p in ex.module.parameters()]


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("index", [0, 1, 2])
def test_w_after_freeing_gives_b_bits_and_a_waiting_microbatch_holds_less_than_after_its_f(index, recompute):
    _, b_ins, b_grads = _run(index, split=False, recompute=recompute)
    ex, ins, grads = _run(index, split=True, recompute=recompute)
    assert all(torch.equal(a, b) for a, b in zip(grads, b_grads))  # bit for bit
    for a, b in zip(ins, b_ins):
        assert (a is None and b is None) or all(torch.equal(u, v) for u, v in zip(a, b))
    f = ex.memory.figures()
    if index == 0:  # stage 0 has no input gradient: its W is the whole backward, nothing freed
        assert f["activation_bytes_waiting_w"] >= f["activation_bytes_per_microbatch"] * (0 if recompute else 1)
        return
    # (the attention's probabilities and dropout masks, GELU's input: freed; the Linears' inputs
    # and the gradients at their outputs, what the W computes from, kept)
    # (recomputing, the forward runs again in the I: its bytes are the I's transient)
    forward = f["activation_bytes_per_microbatch"] + f["activation_bytes_in_backward"]
    assert 0 < f["activation_bytes_waiting_w"] < 0.6 * forward, f
    # freed as the I runs, node by node: the I never holds the whole forward beside its captures
    kept = _run(index, split=True, frees=False, recompute=recompute)[0].memory.figures()
    assert kept["activation_bytes_waiting_w"] > forward > f["activation_bytes_waiting_w"]
    assert kept["activation_bytes_in_input_grad"] > f["activation_bytes_in_input_grad"]


def test_a_backward_that_reads_a_freed_tensor_fails_loudly():
    """What a W will not read is freed; anything that read it anyway (here a whole backward from the
    stage's output after the I) raises rather than computes."""
    torch.manual_seed(0)
    ex = StageExecutor(1, 3, StageSpec(nn.Sequential(_Block()), SGD, None), torch.device("cpu"))
    ex.begin(0, [2], True)
    ex.memory.split(True)
    ex.forward(0, (torch.randn(2, T, D),))
    _, outs, _ = ex.stash[0]
    g = torch.randn(2, T, D)
    ex.input_grad(0, (g,))
    with pytest.raises(FreedTensorError, match="freed after the input"):
        torch.autograd.backward(outs, (g,))


def test_only_a_split_backward_hooks_every_forward():
    """1F1B's unmeasured steps run no saved-tensor hooks; ZB-H1's do (and then free), measured or not."""
    torch.manual_seed(0)
    stages = [nn.Sequential(_Block()) for _ in range(2)]
    x, y = torch.randn(8, T, D), torch.randn(8, T, D)
    for name, hooked in (("1f1b", False), ("zb-h1", True)):
        runner = pipeq.PipelineRunner(stages, nn.MSELoss(), SGD, schedule=name, microbatches=4,
                                      mode="simulated")
        with runner:
            runner.step(x, y)
            runner.step(x, y)
            assert [ex.memory.hooked for ex in backend_of(runner).executors] == [hooked, hooked]
