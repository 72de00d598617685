"""The interlocking example and benchmark still run (tiny configurations, so they do not rot)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

import pipeq

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path.insert(0, ROOT)  # the example imports as examples.interlock_digits (stage processes re-import it)
from examples import interlock_digits  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_interlock", os.path.join(ROOT, "bench", "bench_interlock.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def test_example_trains_two_schemes_in_stage_processes(capsys):
    rows = interlock_digits.compare(["global", "pairwise"], mode="process", epochs=1, verbose=False,
                                    steps_per_epoch=10)
    out = capsys.readouterr().out
    assert [r[0] for r in rows] == ["global", "pairwise"]
    for scheme, acc, secs in rows:
        assert acc > 0.5, f"{scheme}: held-out accuracy {acc:.1%} after 10 steps (chance: 10%)"
        assert secs > 0
        assert scheme in out
    assert "held-out accuracy" in out
    assert "(359 held-out images, 1 epoch of 10 steps, process mode)" in out


def test_example_model_comes_from_pipeq_resnet():
    stages, heads = interlock_digits.make_model(0)
    again = interlock_digits.make_model(0)[0]
    for a, b in zip(stages, again):  # the same weights for the same seed
        assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    assert len(stages) == interlock_digits.N_STAGES and len(heads) == interlock_digits.N_STAGES - 1
    x = torch.randn(3, 1, 8, 8)
    for k, stage in enumerate(stages):
        x = stage(x)
        if k < len(heads):
            assert heads[k](x).shape == (3, 10)
    assert x.shape == (3, 10)
    # another architecture and head spec: the heads follow the channels of their stage
    stages, heads = interlock_digits.make_model(0, arch="8,2/16,1", head="gbpl_fc")
    assert [h[-1].in_features for h in heads] == [16, 8, 8]


def test_example_command_line_takes_arch_and_head(capsys):
    rows = interlock_digits.main(["--quick", "--mode", "simulated", "--schemes", "local",
                                  "--arch", "8,1/16,1", "--head", "gbpl_fc"])
    assert [r[0] for r in rows] == ["local"]
    assert "(359 held-out images, 1 epoch, simulated mode)" in capsys.readouterr().out
    for argv, message in [(["--head", "conv32_fc"], "head spec 'conv32_fc': fc comes before gbpl"),
                          (["--arch", "16,1"], "4 components, but the network has 3 blocks"),
                          (["--schemes", "5-wise"], "unknown scheme '5-wise'")]:
        with pytest.raises(SystemExit) as exit:
            interlock_digits.main(argv)
        assert exit.value.code == 2
        assert message in capsys.readouterr().err


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
