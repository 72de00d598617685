"""The tensor-parallel example and benchmark still run (tiny configurations, so they do not rot)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
# At import (collection) time, before any test starts the fork server that stage and probe
# processes are forked from: it keeps the sys.path it started with.
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_tp  # noqa: E402
from examples import tp_mlp  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_mlp_shards_equal_single_process_training(dtype, capsys):
    steps = 201 if dtype == "float64" else 51  # the tutorial's iterations: 161 / 41 updates
    out = tp_mlp.main(["--steps", str(steps), "--every", "50"] + (["--float32"] if dtype == "float32" else []))
    printed = capsys.readouterr().out
    assert "max |loss difference|" in printed and "one process" in printed
    losses, ref = out["losses"], out["ref_losses"]
    updates = steps - steps // 5  # every fifth of the tutorial's slices is empty and skipped
    assert len(losses) == len(ref) == updates
    assert out["iterations"][:5] == [0, 1, 2, 3, 5]
    for i, (a, b) in enumerate(zip(losses, ref)):
        assert abs(a - b) < 1e-5, f"update {i}: pipeq {a!r} against one process {b!r}"
    assert out["max_loss_diff"] < 1e-5 and out["max_param_diff"] < 1e-5
    assert abs(losses[0] - 0.6931) < 1e-4  # the tutorial's first loss, 0.693
    # the same four batches at the start and at the end: training lowered their mean loss
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - (0.005 if dtype == "float64" else 0.0005)
    # two processes, shards 0 and 1 of stage 0; the state is whole again
    assert sorted((w.get("stage"), w.get("shard")) for w in out["workers"]) == [(0, 0), (0, 1)]
    assert len({w.get("pid") for w in out["workers"]}) == 2
    assert out["state"]["0.weight"].shape == (8, 16) and out["state"]["2.weight"].shape == (1, 8)


def test_tutorial_weights_and_batches():
    """No processes: the replayed initial weights give the tutorial's first loss, and its empty
    slice (x[256:0]) is the one skipped."""
    x, target, model = tp_mlp.tutorial_data(torch.float32)
    its = [i for i, _, _ in tp_mlp.batches(x, target, 11)]
    assert its == [0, 1, 2, 3, 5, 6, 7, 8, 10]
    loss = torch.nn.BCELoss()(model(x[:64]), target[:64]).item()
    assert f"{loss:.3f}" == "0.693"
    _, ref = tp_mlp.reference(model, x, target, 2001)
    assert f"{ref[800]:.3f}" == "0.510" and f"{ref[1600]:.3f}" == "0.367"  # iterations 1000, 2000


def test_bench_prints_the_accounting(capsys, monkeypatch):
    monkeypatch.setenv("PIPEQ_BENCH_START", "forkserver")  # its children fork from the warm fork server
    result = bench_tp.main(["--quick", "--width", "64", "--batch", "16", "--microbatches", "2", "--stages", "1",
                            "--steps", "2", "--comm-iters", "5"])
    printed = capsys.readouterr().out
    assert result["problems"] == []
    assert set(result["configs"]) == {(1, 1), (1, 2)}
    for (n, t), res in result["configs"].items():
        assert res["step"] > 0 and res["t_comp"] > 0 and res["ratio"] == res["t_comm"] / res["t_comp"]
        assert len(res["procs"]) == n * t and all(h > 0 for h in res["hwm_mb"])
    r1, r2 = result["configs"][(1, 1)], result["configs"][(1, 2)]
    assert max(abs(a - b) for a, b in zip(r1["losses"], r2["losses"])) < 1e-4  # same model, T = 1 and 2
    assert r2["analytic"]["total"] < r1["analytic"]["total"]
    assert result["comm"]["counts"]["first_stage"] == {"all_reduce": 1}
    assert "T_comm/T_comp" in printed and "What a GPU node would need" in printed
    nv = result["accounting"]["A100 node, NVLink"]
    assert nv["bw_ratio"] == pytest.approx(300e12 * 2 / (3 * 64 * 600e9))


def test_bench_accounting_arithmetic():
    g = bench_tp.gpu_accounting(2048, 128, 2, 300e12, 600e9, 0.0)
    assert g["flops"] == 12 * 128 * 2048 * 2048 / 2 and g["bytes"] == 2 * 128 * 2048 * 2
    assert g["ratio"] == pytest.approx(2 * 300e12 / (3 * 2048 * 600e9))  # (T-1) s F / (3 W BW)
    need = bench_tp.rows_to_pay(2048, 2, 300e12, 600e9, 10e-6)
    assert bench_tp.gpu_accounting(2048, int(need) + 1, 2, 300e12, 600e9, 10e-6)["ratio"] < 1
    assert bench_tp.gpu_accounting(2048, int(need) - 1, 2, 300e12, 600e9, 10e-6)["ratio"] > 1
    assert bench_tp.rows_to_pay(2048, 2, 300e12, 25e9, 10e-6) == float("inf")
    assert bench_tp.shard_numbers(2048, 1) == 2 * (2048 * 2048 + 2048)
    assert bench_tp.shard_numbers(2048, 2) == 2 * 2048 * 1024 + 1024 + 2048
