"""The interlocking example and benchmark still run (tiny configurations, so they do not rot)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

import pipeq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # stage processes unpickle examples.interlock_digits' classes
from examples import interlock_digits  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_interlock", os.path.join(ROOT, "bench", "bench_interlock.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def test_example_trains_two_schemes_in_stage_processes(capsys):
    rows = interlock_digits.compare(["global", "pairwise"], mode="process", epochs=1, verbose=False)
    out = capsys.readouterr().out
    assert [r[0] for r in rows] == ["global", "pairwise"]
    for scheme, acc, secs in rows:
        assert acc > 0.5, f"{scheme}: held-out accuracy {acc:.1%} after one epoch (chance: 10%)"
        assert secs > 0
        assert scheme in out
    assert "held-out accuracy" in out


def test_example_scheme_names():
    assert interlock_digits.scheme_args("3-wise") == {"schedule": pipeq.schedules.Interlock("nwise", distance=2)}
    assert interlock_digits.scheme_args("local") == {"schedule": "local"}
    with pytest.raises(ValueError, match="unknown scheme"):
        interlock_digits.scheme_args("5-wise")


def test_bench_model_of_global_is_1f1b():
    bench = _bench()
    n, m, f, b = 4, 8, 1.0, 2.0
    ideal = (m + n - 1) * (f + b)  # 1F1B's makespan with equal stages
    assert bench.plan_makespan("global", n, m, f, b) == ideal
    assert bench.model_step_time("global", n, m, f, b) == pytest.approx(ideal)
    # local sends nothing backward: stage k just trails stage 0 by k forwards
    assert bench.model_step_time("local", n, m, f, b) == pytest.approx((n - 1) * f + m * (f + b))


def test_bench_prints_the_ratios(capsys):
    result = _bench().main(["--rounds", "1", "--steps", "3", "--microbatches", "4",
                            "--forward-ms", "1", "--backward-ms", "2"])
    out = capsys.readouterr().out
    assert set(result) == {"global", "pairwise", "local"}
    for s in ("pairwise", "local"):
        assert f"{s}/global: measured" in out
        assert result[s]["ratio"] > 0 and result[s]["plan"] > 0 and result[s]["model"] > 0
    assert result["global"]["steps_per_s"] > 0
