"""bench/bench_stream.py still runs (its quickest mode, two schedules, so that it does not rot)."""

from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

pytestmark = pytest.mark.timeout(120)


def _bench():
    spec = importlib.util.spec_from_file_location("bench_stream", os.path.join(ROOT, "bench", "bench_stream.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def test_bench_bounds():
    bench = _bench()
    f, b = 5.0, 10.0
    ref = bench.bounds("1f1b", 4, 4, f, b)["plan"]
    assert (ref.step, ref.stream) == (105.0, 105.0)  # (m+N-1)(F+B), streamed or not
    assert bench.bounds("local", 4, 4, f, b)["plan"].stream == 60.0  # m(F+B): ideal 1.75x
    pair = bench.bounds("pairwise", 4, 4, f, b)
    assert pair["plan"].stream == 75.0
    assert pair["model"].stream == 105.0  # each middle stage's forward carries a full B more
    with pytest.raises(ValueError, match="unknown schedule"):
        bench.schedule_of("zero-bubble")


def test_bench_runs_end_to_end(capsys):
    result = _bench().main(["--quick", "--schedules", "local", "--batches", "2", "--warmup", "1",
                            "--forward-ms", "1", "--backward-ms", "2"])
    out = capsys.readouterr().out
    assert set(result) == {(4, "1f1b"), (4, "local")}
    for row in result.values():
        assert row["step"] > 0 and row["stream"] > 0 and row["stream_model"] > 0
    assert result[(4, "local")]["stream_x_bound"] == pytest.approx(1.75)
    assert "streamed local >= 1.5x a 1F1B step loop" in out
    assert "within 10% of its own bound" in out
