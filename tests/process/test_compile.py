"""Compiled stages (``compile=``) in stage processes train as one eager process does, on lengths that
change, under 1F1B and the split-backward schedules ZB-H1, ZBV and DualPipeV; inductor (the default
backend) compiles stages in a fresh compile cache, and a second run in that cache hits it.

The GPT runs use ``aot_eager``: what they assert (one process's numbers, one compile for every
length, no graph break, the backward cut in two) is Dynamo's and AOTAutograd's work and pipeq's,
the same under inductor, which would add a minute of C++ compiling here. Inductor itself, and its
cache, run on a small MLP.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import pipeq
from compile_cases import BY_NAME, LENGTHS, assert_trains_like_one_process, batches, model, reference, run
from models import reference_train

pytestmark = pytest.mark.timeout(300)
FAST = dict(start_method="forkserver", threads_per_stage=1)


@pytest.fixture(scope="module")
def first_run():
    """The GPT split by module names, compiled (aot_eager), trained under 1F1B on one batch of each
    of the four lengths: (model, data, (losses, state, stats))."""
    m, data = model(), batches()
    return m, data, run(pipeq.split(m, modules=BY_NAME), data, "1f1b", compile={"backend": "aot_eager"}, **FAST)


def test_compiled_stages_train_like_one_process_on_four_lengths_without_recompiling(first_run):
    m, data, got = first_run
    assert_trains_like_one_process(got, reference(m, data))
    for k, s in enumerate(got[2]):
        assert s["compiles"] >= 1 and s["compile_s"] > 0, (k, s)
        # the batch and length dimensions are marked dynamic before the first compile: every length reuses it
        assert s["compiles"] == 1 and s["recompiles"] == 0, (k, s)
        assert s["graph_breaks"] == 0, (k, s)
    print(f"\nfirst run, {len(LENGTHS)} lengths: " + "; ".join(
        f"stage {k} {s['compile_s']:.1f} s, {s['compiles']} graphs, {s['recompiles']} recompile(s)"
        for k, s in enumerate(got[2])))


def _mlp_run(cache: str) -> tuple[list[float], dict, list[dict], tuple]:
    """A 2-stage MLP compiled by inductor in ``cache``, 3 steps: losses, state, stats, and one process's (losses, state)."""
    torch.manual_seed(0)
    flat = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))  # the runner's names are its own
    stages = [flat[:2], flat[2:]]
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(3)]
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    ref, ref_losses = reference_train([flat], nn.CrossEntropyLoss(), sgd, data)
    want = (ref_losses, ref[0].state_dict())
    # what is tested is the cache: unvectorized C++ kernels compile in half the time here
    compile = {"cache_dir": cache, "options": {"cpp.vec_isa_ok": False}}
    with pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), sgd, "1f1b", 2, compile=compile, **FAST) as r:
        return [r.step(x, y) for x, y in data], r.state_dict(), r.stats(), want


def test_inductor_compiles_in_a_fresh_cache_and_a_second_run_hits_it(tmp_path):
    cache = str(tmp_path / "compile-cache")
    first = _mlp_run(cache)
    assert_trains_like_one_process(first[:3], first[3])
    assert all(s["compiles"] == 1 and s["compile_s"] > 0 and s["compile_cache_hits"] == 0 for s in first[2]), first[2]
    again = _mlp_run(cache)
    assert_trains_like_one_process(again[:3], first[3])
    assert all(s["compile_cache_hits"] > 0 for s in again[2]), again[2]
    print("\ninductor compile s, fresh cache -> the same cache: " + "; ".join(
        f"stage {k} {a['compile_s']:.1f} -> {b['compile_s']:.1f}" for k, (a, b) in enumerate(zip(first[2], again[2]))))


@pytest.mark.parametrize("schedule,n_stages,microbatches", [("zb-h1", 2, 2), ("zbv", 4, 2), ("dualpipev", 4, 4)])
def test_split_backward_schedules_train_compiled_like_one_process(schedule, n_stages, microbatches):
    """A compiled stage's backward is cut in two (pipeq.stage.split_backward): its I computes the
    input gradients, its W the weight gradients, the same numbers as one process on three lengths
    (not a compile per length: the lengths are marked dynamic; a stage sent a length as an int
    recompiles once, dynamic in it, as torch's automatic dynamic shapes do). ZBV and DualPipeV: two stages per process (a V). A
    traced split of the tied GPT (its graph compiled, not pipeq's wrapper: no graph break);
    aot_eager keeps it short (what is tested is pipeq's part: the cut is the same with inductor)."""
    m = model()
    data = batches((32, 17, 24))
    stages = pipeq.split(m, (torch.zeros(2, 32, dtype=torch.long),), n_stages=n_stages)
    got = run(stages, data, schedule, microbatches, compile={"backend": "aot_eager"}, **FAST)
    assert_trains_like_one_process(got, reference(m, data))
    assert all(s["compiles"] >= 1 and s["graph_breaks"] == 0 and s["recompiles"] <= 1 for s in got[2]), got[2]
    # stage 0 has no input gradient: its W is its whole backward, which nothing cuts
    assert [s["backward_split"] for s in got[2]] == ["I+W"] * len(got[2]), got[2]
