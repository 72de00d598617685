"""The data-parallel examples and benchmark still run (tiny configurations, so they do not rot)."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
# At import (collection) time, before any test starts the fork server that stage and probe
# processes are forked from: it keeps the sys.path it started with, and they unpickle
# examples.dp_mlp's MLP and bench_dp's probe function by name.
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_dp  # noqa: E402
from examples import dp_digits, dp_mlp  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_mlp_replicas_equal_single_process_training(dtype, capsys):
    steps = 60 if dtype is torch.float64 else 20
    out = dp_mlp.train(steps=steps, every=10, dtype=dtype)
    printed = capsys.readouterr().out
    assert "max |parameter difference|" in printed and "step    10: loss" in printed
    assert out["max_diff"] < 1e-5, f"replicas vs one process: {out['max_diff']:.2e}"
    assert out["parted_at"] is None
    losses = out["losses"]
    assert len(losses) == steps and all(0 < v < 1 for v in losses)
    if dtype is torch.float64:  # 60 steps = 12 passes over the 320 samples: it learns
        assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.005


def test_mlp_learning_rate_is_the_tutorials_doubled():
    """pipeq averages over the 64 samples, the tutorial sums two 32-sample means at lr 0.5."""
    x, target, model = dp_mlp.tutorial_data(torch.float64)
    xb, yb = next(dp_mlp.batches(x, target, 1, 64))
    a = copy.deepcopy(model)
    loss = torch.nn.BCELoss()
    (loss(a(xb[:32]), yb[:32]) + loss(a(xb[32:]), yb[32:])).backward()  # the tutorial's g_0 + g_1
    torch.optim.SGD(a.parameters(), lr=dp_mlp.LR).step()
    ref, _, _ = dp_mlp.reference(model, x, target, 1, 64, dp_mlp.LR * dp_mlp.REPLICAS)
    for p, q in zip(a.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


def test_digits_two_by_two_learns_like_one_replica(capsys):
    runs = dp_digits.compare(replicas=2, epochs=2)
    printed = capsys.readouterr().out
    r2, r1 = runs
    assert (r2["replicas"], r1["replicas"]) == (2, 1)
    for r in runs:
        assert r["accuracy"] > 0.8, f"R = {r['replicas']}: {r['accuracy']:.1%} after two epochs (chance 10%)"
        assert r["seconds"] > 0 and r["steps"] == 2 * 23
    assert abs(r2["accuracy"] - r1["accuracy"]) <= 2 / 360  # the same model up to rounding
    assert r2["max_diff_vs_r1"] < 1e-4
    assert "R = 2 x N = 2 (4 processes)" in printed and "held-out accuracy" in printed


def test_bench_prints_the_ratio(capsys):
    result = bench_dp.main(["--rounds", "1", "--steps", "2", "--width", "64", "--layers", "2",
                            "--batch", "32", "--microbatches", "2"])
    printed = capsys.readouterr().out
    assert set(result) == {1, 2}
    for n, res in result.items():
        assert res["steps_per_s_r1"] > 0 and res["steps_per_s_r2"] > 0
        assert res["t_comp"] > 0 and res["t_sync"] > 0 and res["ratio"] == res["t_sync"] / res["t_comp"]
        assert res["contention"] > 0
        assert f"N = {n}, R = 2 ({2 * n} processes" in printed
    assert "T_sync / T_comp" in printed
    assert "distribution pays while T_sync / T_comp < R - 1 = 1" in printed


def test_bench_model_splits_evenly():
    stages = bench_dp.make_stages(32, 4, 2)
    assert len(stages) == 2
    assert sum(p.numel() for s in stages for p in s.parameters()) == bench_dp.n_params(32, 4)
    x = torch.randn(3, 32)
    assert stages[1](stages[0](x)).shape == (3, 32)
    with pytest.raises(ValueError, match="equal stages"):
        bench_dp.make_stages(32, 3, 2)
