"""Compiled stages (``compile=``) in stage processes train as one eager process does, on lengths that
change, under 1F1B and the split-backward schedules ZB-H1 and ZBV; a second run in the same compile
cache hits it.

The tests share one compile cache directory (module-scoped) and the first run (inductor, four
lengths), so that only that run pays inductor's full compile.
"""

from __future__ import annotations

import pytest
import torch

import pipeq
from compile_cases import BY_NAME, LENGTHS, assert_trains_like_one_process, batches, model, reference, run

pytestmark = pytest.mark.timeout(300)
FAST = dict(start_method="forkserver", threads_per_stage=1)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("compile-cache"))


@pytest.fixture(scope="module")
def first_run(cache):
    """The GPT split by module names, compiled by inductor (the default backend) in a fresh cache,
    trained under 1F1B on one batch of each of the four lengths: (model, data, (losses, state, stats))."""
    m, data = model(), batches()
    return m, data, run(pipeq.split(m, modules=BY_NAME), data, "1f1b", compile={"cache_dir": cache}, **FAST)


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


def test_a_second_run_in_the_same_cache_hits_it_and_compiles_faster(first_run, cache):
    m, data, first = first_run
    got = run(pipeq.split(m, modules=BY_NAME), data, "1f1b", compile={"cache_dir": cache}, **FAST)
    assert_trains_like_one_process(got, reference(m, data))
    for k, (s, before) in enumerate(zip(got[2], first[2])):
        assert s["compile_cache_hits"] > 0, (k, s)
        assert s["recompiles"] <= before["recompiles"], (k, s, before)
    print("\ncompile s, first run -> cached run: " + "; ".join(
        f"stage {k} {a['compile_s']:.1f} -> {b['compile_s']:.1f}" for k, (a, b) in enumerate(zip(first[2], got[2]))))


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
