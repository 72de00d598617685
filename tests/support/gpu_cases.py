"""CUDA cases (tests/gpu/): the marks that skip without CUDA, where the stages go, tiny picklable
models, a process-mode run, and the reference every training test is held against: the same
model, optimizer and data trained as a plain torch loop on cuda:0.

Tolerances (each test names the one it uses):

    FP32_TOL  1e-5  fill-drain and 1F1B equal one process in fp32, as on the CPU (tests/process/).
                    Both sides run the same kernels but on microbatches against whole batches:
                    reductions over the batch differ in order, nothing more. (TF32 stays off:
                    torch's default for matmuls; NVIDIA_TF32_OVERRIDE=1 would break this.)
    FP16_TOL  5e-3  fp16 autocast: a microbatch's fp16 matmul rounds its gradient to fp16 on its
                    own (1 ulp: ~5e-4 relative) before the fp32 sum over microbatches, where one
                    process rounds the whole batch's once, and cuBLAS picks kernels by batch size;
                    after 4 steps of SGD at lr 0.5 the weights move apart by well under 1e-3.
                    (On the CPU, fp16 autocast agrees within 1e-4: tests/unit/stage/.)
    BF16_TOL  2e-2  bf16 autocast: 8 bits of mantissa, the CPU tests' bound.
"""

from __future__ import annotations

import copy
import functools
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import pipeq
from models import flat_state, reference_train

FP32_TOL = 1e-5
FP16_TOL = 5e-3
BF16_TOL = 2e-2

#: ``pytestmark = CUDA`` in every module of tests/gpu/: decided when the module is imported, so
#: that without CUDA each test is collected and reported skipped, and nothing else runs
CUDA = [pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")]


def needs_gpus(n: int) -> pytest.MarkDecorator:
    """Skip unless this machine has ``n`` GPUs or more."""
    have = torch.cuda.device_count()
    return pytest.mark.skipif(have < n, reason=f"needs {n} GPUs, this machine has {have}")


MOMENTUM = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


# -- where the stages go --------------------------------------------------------------------------
def spread() -> int:
    """How many stages to run so that each has a GPU of its own: one per GPU (2 to 4 of them);
    two stages sharing cuda:0 on a machine with one GPU."""
    return max(2, min(torch.cuda.device_count(), 4))


def round_robin(n_stages: int) -> list[str]:
    """``cuda:k`` round-robin over this machine's GPUs: ``devices=`` for ``n_stages`` stages, and
    the placement pipeq picks by default (``devices=None``)."""
    return [f"cuda:{k % torch.cuda.device_count()}" for k in range(n_stages)]


# -- data and models (module level: stage processes unpickle them) ----------------------------------
def batches(n_steps: int, size: int | list[int], seed: int = 1, d_in: int = 8, classes: int = 3):
    """``n_steps`` CPU batches (x, class targets); ``size``: every batch's size, or one per step."""
    g = torch.Generator().manual_seed(seed)
    sizes = size if isinstance(size, list) else [size] * n_steps
    return [(torch.randn(n, d_in, generator=g), torch.randint(0, classes, (n,), generator=g)) for n in sizes]


def mlp(n_stages: int, width: int = 32, d_in: int = 8, classes: int = 3, seed: int = 0) -> list[nn.Module]:
    """Linear + ReLU stages, ``d_in -> width -> ... -> classes`` (the last a plain Linear)."""
    torch.manual_seed(seed)
    widths = [d_in] + [width] * (n_stages - 1) + [classes]
    return [nn.Sequential(nn.Linear(widths[k], widths[k + 1]), nn.ReLU()) if k < n_stages - 1
            else nn.Linear(widths[k], widths[k + 1]) for k in range(n_stages)]


class Fork(nn.Module):
    """Stage 0 of :func:`tuple_stages`: (hidden activation, an int64 flag per sample)."""

    def __init__(self, d_in: int, width: int):
        super().__init__()
        self.lin = nn.Linear(d_in, width)

    def forward(self, x):
        return torch.relu(self.lin(x)), (x[:, 0] > 0).long()


class Carry(nn.Module):
    """The middle stage: passes the flag on, and its activation as a non-contiguous tensor (a
    transposed copy, transposed back), which the wire must send by value, not by its storage."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, h, flag):
        h = torch.tanh(self.lin(h))
        return h.t().contiguous().t(), flag


class Join(nn.Module):
    """The last stage: logits, shifted by the flag (so the int64 tensor must arrive intact)."""

    def __init__(self, width: int, classes: int):
        super().__init__()
        self.lin = nn.Linear(width, classes)

    def forward(self, h, flag):
        return self.lin(h) + flag.unsqueeze(1).float()


def tuple_stages(width: int = 512, d_in: int = 8, classes: int = 3, seed: int = 0) -> list[nn.Module]:
    """Three stages whose messages hold two tensors of two dtypes (float32 and int64)."""
    torch.manual_seed(seed)
    return [Fork(d_in, width), Carry(width), Join(width, classes)]


def dropout_stages(seed: int = 3) -> list[nn.Module]:
    """Two stages with dropout: masks drawn from each stage's CUDA generator."""
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.3), nn.ReLU()),
            nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.2), nn.Tanh(), nn.Linear(64, 3))]


class Wide(nn.Sequential):
    """Eight Linear(256, 256) + ReLU layers: at large batches the activations dominate memory."""

    def __init__(self) -> None:
        super().__init__(*[m for _ in range(8) for m in (nn.Linear(256, 256), nn.ReLU())])


# -- a run and its reference ----------------------------------------------------------------------------
def train(stages, data, make_opt=MOMENTUM, *, schedule="1f1b", microbatches=4, loss_fn=None, x_eval=None,
          save_to=None, **settings) -> SimpleNamespace:
    """Train a process-mode runner on ``data``. Returns ``losses``, ``state`` (its state_dict,
    on the CPU), ``workers`` (every process's READY: device, replica, stage, shard; the leads
    first), ``devices`` (the leads' devices: one per stage of replica 0, then replica 1's...),
    ``stats`` (runner.stats()) and ``pred`` (predict(x_eval), when given). ``save_to``: a
    checkpoint is saved there at the end."""
    runner = pipeq.PipelineRunner(copy.deepcopy(stages), loss_fn or nn.CrossEntropyLoss(), make_opt, schedule,
                                  microbatches, **settings)
    with runner:
        workers = [dict(w) for w in runner.stage_processes]
        losses = [runner.step(x, y) for x, y in data]
        out = SimpleNamespace(losses=losses, state=runner.state_dict(), workers=workers, stats=runner.stats(),
                              pred=runner.predict(x_eval) if x_eval is not None else None)
        if save_to is not None:
            runner.save(str(save_to))
    n_leads = runner.n_stages * runner.data_parallel
    out.devices = [w["device"] for w in workers[:n_leads]]
    return out


def reference(stages, data, make_opt=MOMENTUM, *, loss_fn=None, device="cuda:0", autocast=None, scaler=None,
              clip=None) -> SimpleNamespace:
    """The same model, optimizer and data as a plain torch loop on one device, whole batches:
    ``losses``, ``state`` (CPU copies under the runner's names) and ``model`` (on ``device``).
    ``autocast``: a dtype (torch.autocast); ``scaler``: a torch.amp.GradScaler; ``clip``:
    clip_grad_norm_'s max norm."""
    model, losses = reference_train(stages, loss_fn or nn.CrossEntropyLoss(), make_opt, data, clip, device=device,
                                    autocast=autocast, scaler=scaler)
    state = {k: v.detach().cpu() for k, v in flat_state(model).items()}
    return SimpleNamespace(losses=losses, state=state, model=model)


def assert_states_close(got: dict, want: dict, atol: float) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].device.type == "cpu" and got[k].dtype == want[k].dtype, k
        torch.testing.assert_close(got[k], want[k], atol=atol, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


def assert_matches(run: SimpleNamespace, ref: SimpleNamespace, atol: float) -> None:
    """The run's losses and weights equal the reference's within ``atol``."""
    assert run.losses == pytest.approx(ref.losses, abs=atol, nan_ok=True)
    assert_states_close(run.state, ref.state, atol)


def predict(ref: SimpleNamespace, x: torch.Tensor) -> torch.Tensor:
    """The reference model's output on ``x`` (eval mode), on the CPU."""
    with torch.no_grad():
        return ref.model.eval()(x.to(next(ref.model.parameters()).device)).cpu()


def max_difference(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)
