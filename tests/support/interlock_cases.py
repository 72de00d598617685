"""Interlock cases: the scalar chain, small Linear stages with heads, a runner, and the digits data."""

from __future__ import annotations

import functools

import torch
from torch import nn

import pipeq

from models import Mul, SumSq


FAST = dict(start_method="forkserver")  # ~0.1 s per process-mode runner instead of ~3-5 s
SCHEMES = [("global", None), ("local", None), ("pairwise", None), ("nwise", 2)]
SCHEME_IDS = ["global", "local", "pairwise", "nwise2"]
SGD1 = functools.partial(torch.optim.SGD, lr=1.0)


def scheme(schedule, d=None):
    """The schedule argument: a name, or for "nwise" the Interlock object with its distance."""
    return pipeq.schedules.Interlock("nwise", distance=d) if schedule == "nwise" else schedule


# main_k(x) = x * w_k, head_k(a) = a * h_k; every loss is (out - y)^2 (SumSq), SGD at lr 1.
W = (2.0, 3.0, 0.5, 1.5)
H = (1.0, 2.0, 0.5)


def scalar_runner(schedule, d=None, *, w=W, h=H, microbatches=1, reduction="sum", mode="simulated"):
    return pipeq.PipelineRunner(
        [Mul(v) for v in w], SumSq(reduction), SGD1, scheme(schedule, d), microbatches, mode=mode,
        aux_heads=[Mul(v) for v in h], aux_loss=SumSq(reduction), **FAST,
    )


def scalar_step(schedule, d, x, y, **kw):
    """Main weights [w_0..w_3] after one step on (x, y) (lists of samples)."""
    runner = scalar_runner(schedule, d, **kw)
    with runner:
        runner.step(torch.tensor(x).reshape(-1, 1), torch.tensor(y).reshape(-1, 1))
        sd = runner.state_dict()
    assert list(sd) == ["0.w", "1.w", "2.w", "3.w"]  # the main modules only, no head
    return [sd[f"{k}.w"].item() for k in range(4)]


# Second sample x = -2, y = 1. Forward: a = (-4, -12, -6, -9); z = (-4, -24, -3).
# dL_k/dz_k = (-10, -50, -8); dL_3/da_3 = 2 (-9 - 1) = -20; dL_k/da_k = (-10, -100, -4), -20.
# Per-sample gradients of this sample (first sample's in brackets), summed: "sum" weights are 1.
#   global:   dw_3 = -20 a_2 = 120 [24]; dw_2 = -20 w_3 a_1 = 360 [72];
#             dw_1 = -20 w_3 w_2 a_0 = 60 [12]; dw_0 = -20 w_3 w_2 w_1 x = 90 [18]
#   local:    dw_0 = -10 x = 20 [3]; dw_1 = -100 a_0 = 400 [92]; dw_2 = -4 a_1 = 48 [6]
#   pairwise: dw_0 = -100 w_1 x = 600 [138]; dw_1 = -4 w_2 a_0 = 8 [1]; dw_2 = 360 [72]
#   nwise2:   dw_0 = -4 w_2 w_1 x = 12 [1.5]; dw_1 = -20 w_3 w_2 a_0 = 60 [12]; dw_2 = 360 [72]
TWO_SAMPLES = {
    "global": [2 - (18 + 90), 3 - (12 + 60), 0.5 - (72 + 360), 1.5 - (24 + 120)],
    "local": [2 - (3 + 20), 3 - (92 + 400), 0.5 - (6 + 48), 1.5 - (24 + 120)],
    "pairwise": [2 - (138 + 600), 3 - (1 + 8), 0.5 - (72 + 360), 1.5 - (24 + 120)],
    "nwise2": [2 - (1.5 + 12), 3 - (12 + 60), 0.5 - (72 + 360), 1.5 - (24 + 120)],
}

WIDTHS = (6, 8, 8, 8, 4)


def linear_stages(seed=0):
    torch.manual_seed(seed)
    n = len(WIDTHS) - 1
    return [nn.Sequential(nn.Linear(WIDTHS[k], WIDTHS[k + 1]), nn.ReLU()) if k < n - 1
            else nn.Linear(WIDTHS[k], WIDTHS[k + 1]) for k in range(n)]


def linear_heads(seed=1):
    torch.manual_seed(seed)
    return [nn.Linear(WIDTHS[k + 1], WIDTHS[-1]) for k in range(len(WIDTHS) - 2)]


def batches(steps, size=10, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, WIDTHS[0], generator=g), torch.randint(0, WIDTHS[-1], (size,), generator=g))
            for _ in range(steps)]


MOMENTUM = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def run(schedule, d=None, *, stages=None, heads="default", data, microbatches=3, mode="simulated",
        make_opt=MOMENTUM, x_eval=None):
    """(state_dict, losses, predict(x_eval)) after training on ``data`` through the runner."""
    heads = linear_heads() if heads == "default" else heads
    runner = pipeq.PipelineRunner(
        stages if stages is not None else linear_stages(), nn.CrossEntropyLoss(), make_opt,
        scheme(schedule, d), microbatches, mode=mode, aux_heads=heads, **FAST,
    )
    with runner:
        losses = [runner.step(x, y) for x, y in data]
        out = runner.predict(x_eval) if x_eval is not None else None
        return runner.state_dict(), losses, out


def assert_state_equal(a, b, exact=True, atol=1e-6):
    assert list(a) == list(b)
    for key in a:
        if exact:
            assert torch.equal(a[key], b[key]), key
        else:
            torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0, msg=key)


def digits_split():
    """The digits data set, shuffled, standardized: (x_train, y_train, x_test, y_test)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    y = torch.tensor(data.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    x_test, y_test, x_train, y_train = x[:360], y[:360], x[360:], y[360:]
    mean, std = x_train.mean(0), x_train.std(0).clamp(min=1.0)  # constant pixels: no blow-up
    return (x_train - mean) / std, y_train, (x_test - mean) / std, y_test


def digits_accuracy(digits, schedule, d=None, mode="simulated"):
    x_train, y_train, x_test, y_test = digits
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(3)] + [nn.Linear(64, 10)]
    heads = [nn.Linear(64, 10) for _ in range(3)]
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), functools.partial(torch.optim.Adam, lr=3e-3),
                                  scheme(schedule, d), 2, mode=mode, aux_heads=heads, **FAST)
    with runner:
        before = (runner.predict(x_test).argmax(1) == y_test).float().mean().item()
        for _ in range(3):
            for i in range(0, len(x_train), 64):
                runner.step(x_train[i : i + 64], y_train[i : i + 64])
        after = (runner.predict(x_test).argmax(1) == y_test).float().mean().item()
    assert before < 0.3
    return after
