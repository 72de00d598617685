"""Sequences of changing length between CUDA stages: the CUDA IPC slots grow when an activation
outgrows them and are reused when it shrinks again (pipeq.wire.cuda_slots; the writer's
bookkeeping is also tested without a GPU in tests/unit/wire/test_slot_growth.py).

Two stages on cuda:0 (one GPU is enough), 2048 features: a microbatch of 4 sequences of length
T carries 32 KiB x T of activation (and as much gradient back), so lengths 32 (1 MiB, the slots'
first size), 40 and 64 (a new generation of 2 MiB) and 24, 17, 8 (reused) cross in turn, in one
runner; equal to the same model trained in one process on cuda:0.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import pipeq

import compile_cases as cc
from gpu_cases import CUDA, FP32_TOL, assert_matches, reference, train

pytestmark = [*CUDA, pytest.mark.timeout(300)]
LENGTHS = [32, 24, 40, 17, 64, 8, 40]
SGD = functools.partial(torch.optim.SGD, lr=0.01)  # 2048 features: lr 0.1 would diverge


def test_activations_of_changing_length_cross_cuda_ipc_slots_that_grow_and_are_reused():
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(8, 2048), nn.ReLU()), nn.Linear(2048, 3)]
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, T, 8, generator=g), torch.randn(16, T, 3, generator=g)) for T in LENGTHS]
    got = train(stages, data, SGD, schedule="1f1b", microbatches=4, loss_fn=nn.MSELoss(), devices=["cuda:0"] * 2,
                transport="ipc")
    assert got.devices == ["cuda:0", "cuda:0"]
    assert_matches(got, reference(stages, data, SGD, loss_fn=nn.MSELoss()), FP32_TOL)


def _on_cuda(data):
    return [(x.cuda(), y.cuda()) for x, y in data]


def test_a_split_traced_on_the_cpu_runs_its_position_ids_on_the_stages_cuda_device():
    """pipeq.split traces on the CPU: positions ``torch.arange(T, device=idx.device)`` of a dynamic
    length become an arange node on the CPU, which each stage moves to its CUDA device with its
    tensors (GraphStage; before, stage 0 failed: index on cpu, weights on cuda:0). Lengths 32, 24,
    40, 17; equal to the model trained in one process on cuda:0."""
    model, data = cc.model(), cc.batches()
    stages = pipeq.split(model, (data[0][0],), n_stages=2)
    losses, state, _ = cc.run(stages, data, devices=["cuda:0"] * 2)
    want_losses, want_state = cc.reference(copy.deepcopy(model).cuda(), _on_cuda(data))
    assert losses == pytest.approx(want_losses, abs=FP32_TOL)
    for k, v in state.items():
        torch.testing.assert_close(v, want_state[k].cpu(), atol=FP32_TOL, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
