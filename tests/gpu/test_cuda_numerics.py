"""How CUDA stages compute: fp16 with loss scaling, bf16, clipping, recomputation, peak memory.

Each is held against one process on cuda:0 doing it torch's way (torch.autocast("cuda"),
torch.amp.GradScaler("cuda"), clip_grad_norm_), or against the same run without
recomputation; tolerances: gpu_cases' docstring.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import pipeq
from pipeq import checkpoint
from gpu_cases import (BF16_TOL, CUDA, FP16_TOL, FP32_TOL, Wide, assert_matches, batches, dropout_stages,
                       max_difference, reference, round_robin, train)
from numerics_cases import SGD, data, mlp

pytestmark = [*CUDA, pytest.mark.timeout(300)]


# -- mixed precision -------------------------------------------------------------------------------
@pytest.mark.parametrize("data_parallel", [1, 2])
def test_fp16_scales_and_skips_together_as_one_grad_scaler(data_parallel, tmp_path):
    """fp16 autocast on every stage, LossScaler on each stage's device
    (torch._amp_foreach_non_finite_check_and_unscale_, torch._amp_update_scale_): a batch that
    overflows float16 is skipped by every stage (and every replica), the scale halves on all,
    and the other steps equal GradScaler's."""
    steps = data(4)
    steps[1] = (steps[1][0] * 1e5, steps[1][1])  # inf in the forward: every gradient NaN
    scaler = torch.amp.GradScaler("cuda")
    want = reference(mlp(), steps, SGD, autocast=torch.float16, scaler=scaler)
    got = train(mlp(), steps, SGD, microbatches=3, precision="fp16", devices=round_robin(3),
                data_parallel=data_parallel, save_to=tmp_path / "ckpt")
    assert_matches(got, want, FP16_TOL)
    assert not math.isfinite(got.losses[1]) and all(math.isfinite(v) for v in got.losses[:1] + got.losses[2:])
    assert [s["skipped_steps"] for s in got.stats] == [1, 1, 1]
    assert scaler.get_scale() == 32768.0
    assert checkpoint.load(str(tmp_path / "ckpt")).scaler["scale"] == 32768.0
    assert all(v.dtype == torch.float32 for v in got.state.values())  # master weights stay fp32
    fp32 = reference(mlp(), [steps[0]] + steps[2:], SGD)
    assert max_difference(got.state, fp32.state) > 1e-6  # fp16 did run


def test_bf16_equals_autocast_to_bf16_on_one_device():
    if not torch.cuda.is_bf16_supported():
        pytest.skip(f"{torch.cuda.get_device_name(0)} has no bfloat16")
    steps = data(3)
    want = reference(mlp(), steps, SGD, autocast=torch.bfloat16)
    got = train(mlp(), steps, SGD, microbatches=3, precision="bf16", devices=round_robin(3))
    assert_matches(got, want, BF16_TOL)
    assert all(v.dtype == torch.float32 for v in got.state.values())
    fp32 = reference(mlp(), steps, SGD)
    assert max_difference(got.state, fp32.state) > 1e-5  # bf16 did run


# -- clipping ---------------------------------------------------------------------------------------
def test_clipping_with_replicas_equals_clip_grad_norm_on_one_device():
    """Each stage's norm term computed on its GPU (torch._foreach_norm), after the replicas'
    all-reduce; the gradients scaled there (torch._foreach_mul_)."""
    steps = data(2)
    want = reference(mlp(), steps, SGD, clip=0.05)
    got = train(mlp(), steps, SGD, microbatches=3, data_parallel=2, clip_grad_norm=0.05)
    assert_matches(got, want, FP32_TOL)
    assert max_difference(got.state, reference(mlp(), steps, SGD).state) > 1e-3  # it did clip


# -- recomputation ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["fill-drain", "1f1b"])
def test_recompute_draws_the_same_cuda_dropout_masks(schedule):
    """Recomputing a forward in the backward restores the stage's CUDA RNG state
    (torch.cuda.get_rng_state / set_rng_state on its device): the same dropout masks, so the
    very same numbers as keeping the activations. (Dropout on a CUDA tensor draws from the
    device's generator, never the CPU's: without the CUDA state the masks would differ.)"""
    steps = batches(3, 24)
    runs = [train(dropout_stages(), steps, schedule=schedule, microbatches=3, devices=round_robin(2), recompute=rc)
            for rc in (False, True)]
    assert [s["recompute"] for s in runs[1].stats] == [True, True]
    assert runs[0].losses == runs[1].losses
    for k in runs[0].state:
        assert torch.equal(runs[0].state[k], runs[1].state[k]), k


# -- memory -------------------------------------------------------------------------------------------------
def test_peak_memory_is_cuda_max_memory_allocated():
    """stats() reports each stage's torch.cuda.max_memory_allocated: above what the stage
    must hold (its weights, gradients and momentum, then fill-drain's 8 microbatches of
    activations), below its GPU's memory; reset_peak restarts it; recompute lowers it by the
    activations it no longer keeps (~9 tensors of 1 MiB a microbatch against 1)."""
    torch.manual_seed(0)
    stages = [Wide(), nn.Sequential(Wide(), nn.Linear(256, 4))]
    weights = [sum(p.numel() * 4 for p in s.parameters()) for s in stages]
    x, y = torch.randn(8192, 256), torch.randint(0, 4, (8192,))
    devices = round_robin(2)
    peaks = {}
    for rc in (False, True):
        runner = pipeq.PipelineRunner(copy.deepcopy(stages), nn.CrossEntropyLoss(), SGD, "fill-drain", 8,
                                      recompute=rc, devices=devices)
        with runner:
            at_start = runner.stats()
            runner.step(x, y)  # allocator and optimizer state warmed up
            runner.stats(reset_peak=True)
            runner.step(x, y)
            stats = runner.stats()
        assert [s["memory"] for s in stats] == ["cuda allocated"] * 2
        for k, s in enumerate(stats):
            total = torch.cuda.get_device_properties(torch.device(devices[k])).total_memory
            assert 3 * weights[k] < s["peak_bytes"] < min(total, 1 << 30), (k, s, weights[k])
            assert 0 < at_start[k]["peak_bytes"] < s["peak_bytes"], (k, at_start[k], s)
        peaks[rc] = stats[0]["peak_bytes"]
    assert peaks[False] > 48 << 20, peaks  # 8 microbatches x 8 saved inputs of 1 MiB, at least
    assert peaks[False] - peaks[True] > 40 << 20, peaks


@pytest.mark.parametrize("schedule", ["zbv"])  # two stages per process and a split backward: the hardest
def test_memory_on_cuda_measures_what_the_cpu_measures(schedule):  # (one case: the GPU check's tests run in 330 s)
    """runner.memory() counts saved tensors by their storages, with no allocator involved: CUDA
    stages (process mode) measure what CPU stages of simulated mode measure, up to how the
    transport lays a message's tensors out (a received message is one buffer), each as its plan
    predicts; device_peak_bytes is the allocator's peak, above what the stage holds."""
    rows = {}
    for mode, devices in (("simulated", ["cpu"] * 4), ("process", round_robin(4))):
        runner = pipeq.PipelineRunner([Wide(), Wide(), Wide(), nn.Sequential(Wide(), nn.Linear(256, 4))],
                                      nn.CrossEntropyLoss(), SGD, schedule, 4, mode=mode, devices=devices)
        with runner:
            runner.step(torch.randn(256, 256), torch.randint(0, 4, (256,)))
            rows[mode] = runner.memory()
    for cpu, cuda in zip(rows["simulated"], rows["process"]):
        assert cuda.activation_peak_bytes == pytest.approx(cpu.activation_peak_bytes, rel=0.05), (cpu, cuda)
        assert cuda.activation_peak_bytes == pytest.approx(cuda.predicted_activation_bytes, rel=0.02), cuda
        assert (cuda.param_bytes, cuda.grad_bytes, cuda.optimizer_bytes) == (cpu.param_bytes, cpu.grad_bytes,
                                                                              cpu.optimizer_bytes)
        assert cpu.device_peak_bytes is None and cuda.device_peak_bytes > cuda.state_bytes, cuda


def test_a_split_backward_frees_what_its_w_will_not_read_on_cuda():
    """A stage on cuda:0 whose backward splits (I, then W) frees after each I what its forward
    saved and its W will not read (an explicit softmax's probabilities, GELU's input): the
    allocator holds less after the Is than with the graph kept, the meter's waiting bytes drop
    alike, and the Ws give the whole backward's gradients bit for bit."""
    from pipeq.stage.executor import StageExecutor
    from pipeq.stage.spec import StageSpec

    t, d = 256, 64

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.qk, self.mlp = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Sequential(
                nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            q, k = self.qk(self.ln(h)).chunk(2, -1)
            return h + self.mlp((q @ k.transpose(-1, -2) / d ** 0.5).softmax(-1) @ h)

    def run(split: bool, frees: bool, m: int = 4):
        torch.manual_seed(0)
        ex = StageExecutor(1, 3, StageSpec(nn.Sequential(Block(), Block()), SGD, None), torch.device("cuda:0"))
        g = torch.Generator().manual_seed(3)
        xs = [(torch.randn(8, t, d, generator=g).cuda(),) for _ in range(m)]
        gs = [(torch.randn(8, t, d, generator=g).cuda(),) for _ in range(m)]
        ex.memory.ask()
        ex.begin(1, [8] * m, True)
        ex.memory.split(split and frees)
        for j in range(m):
            ex.forward(j, xs[j])
        del xs
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        for j in range(m):
            ex.input_grad(j, gs[j]) if split else ex.backward(j, gs[j])
        torch.cuda.synchronize()
        after_i = torch.cuda.memory_allocated() - base
        for j in range(m) if split else ():
            ex.weight_grad(j)
        return [p.grad for p in ex.module.parameters()], after_i, ex.memory.figures()["activation_bytes_waiting_w"]

    whole, _, _ = run(False, False)
    kept, kept_bytes, kept_waiting = run(True, False)
    freed, freed_bytes, waiting = run(True, True)
    assert all(torch.equal(a, b) for a, b in zip(freed, whole)) and all(torch.equal(a, b) for a, b in zip(kept, whole))
    assert freed_bytes < kept_bytes - 4 * (kept_waiting - waiting) // 2, (freed_bytes, kept_bytes)
    assert waiting < 0.75 * kept_waiting, (waiting, kept_waiting)  # (0.61 on the CPU)
