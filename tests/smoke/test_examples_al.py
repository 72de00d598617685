"""The Associated Learning example and benchmark still run (tiny configurations, so they do not rot)."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import pytest
import torch
from torch import nn

import pipeq
from pipeq.research import ALLayer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path.insert(0, ROOT)
from examples import al_digits  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _bench():
    spec = importlib.util.spec_from_file_location("bench_al", os.path.join(ROOT, "bench", "bench_al.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def test_example_al_learns_in_stage_processes(capsys):
    rows = al_digits.compare(mode="process", epochs=3, verbose=False)
    out = capsys.readouterr().out
    assert [r[0] for r in rows] == ["AL", "1F1B"]
    for method, acc, secs in rows:
        assert secs > 0
        assert method in out
    acc_al = rows[0][1]
    assert acc_al > 0.85, f"AL: held-out accuracy {acc_al:.1%} after three epochs (chance: 10%)"
    assert "held-out accuracy" in out and "process mode" in out


def test_example_both_methods_start_from_the_same_blocks():
    al = al_digits.make_al(seed=3)
    bp = al_digits.make_backprop(seed=3)
    for k, layer in enumerate(al):
        block = layer.f[0]  # build_al wraps each block as Sequential(block, Flatten)
        ref = bp[k] if k < len(bp) - 1 else bp[k][0]
        for p, q in zip(block.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q)
    with pytest.raises(ValueError, match="unknown method"):
        al_digits.make_runner("gpipe")


class _Recorder(nn.Module):
    """Linear that logs which stage ran a forward (simulated mode: one process, one log)."""

    log: list[int] = []

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _Recorder.log.append(self.k)
        return self.lin(x)


def test_simulated_al_runs_layer_after_layer():
    """What the benchmark's 'sequential AL' relies on: simulated mode does each stage's whole step
    before the next stage's (no interleaving), in one process."""
    layers = [ALLayer(_Recorder(k), nn.Linear(4, 4), nn.Linear(3 if k == 0 else 4, 4),
                      nn.Linear(4, 3 if k == 0 else 4)) for k in range(3)]
    runner = pipeq.PipelineRunner(layers, None, functools.partial(torch.optim.SGD, lr=0.1), "al", 4,
                                  mode="simulated")
    with runner:
        _Recorder.log.clear()
        runner.step(torch.randn(8, 4), torch.randint(0, 3, (8,)))
    assert _Recorder.log == [0] * 4 + [1] * 4 + [2] * 4


def test_bench_ideals():
    bench = _bench()
    n, m, f, b = 4, 8, 1.0, 2.0
    assert bench.ideal_ms("AL pipelined", n, m, f, b) == (n - 1) * f + m * (f + b)
    assert bench.ideal_ms("AL sequential", n, m, f, b) == n * m * (f + b)
    assert bench.ideal_ms("1F1B", n, m, f, b) == (m + n - 1) * (f + b)


def test_bench_prints_the_ratios(capsys):
    result = _bench().main(["--rounds", "1", "--steps", "2", "--microbatches", "2",
                            "--forward-ms", "1", "--backward-ms", "2"])
    out = capsys.readouterr().out
    assert set(result) == {"sleep", "digits"}
    for part in ("sleep", "digits"):
        res = result[part]
        for method in ("AL pipelined", "AL sequential", "1F1B"):
            assert res[method]["steps_per_s"] > 0
        assert res["vs_sequential"] > 0 and res["vs_1f1b"] > 0
    assert out.count("pipelined AL / sequential AL") == 2
    assert out.count("pipelined AL / 1F1B") == 2
    assert "ideal" in out
