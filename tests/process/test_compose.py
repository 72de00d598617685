"""Every parallelism with every other and with every numerics option, compile and tied weights,
each run equal to plain single-process training.

The 11 features (ZBV, ZB-H1, data parallelism, FSDP, tensor parallelism, compile, tied weights,
``fault_tolerance="replicas"``, recompute, bf16, clipping) are combined by a pairwise covering
array: every pair of them runs together in at least one row, and every pair of a feature on and
another off too (the rows were found by a greedy search over the feasible combinations; the
test checks that they cover). A row with FSDP and fault tolerance shards with HSDP (2 shard
groups of 2 replicas: a lost replica's pieces have a copy in the other group), which is also the
HSDP x pipeline 2 run. Float32 rows equal the reference within 1e-5; bf16 rows are compared with
a bf16 reference (autocast on the CPU) within 1e-2, relative and absolute: bf16 keeps 8 bits of
mantissa (a relative step of 4e-3), and pipeq's microbatches and replicas round their matrix
products on other shapes than the reference's whole batch.
"""

from __future__ import annotations

import pytest
import torch

import pipeq

from compose_cases import FEATURES, SGD, batches, lm_loss, reference, settings, stages, uncovered
from strays import wait_no_strays

pytestmark = pytest.mark.timeout(240)

FAST = dict(start_method="forkserver", threads_per_stage=1)

#: the covering array: one row per run, the features it combines
ROWS = [
    dict(zbv=1, compile=1, recompute=1, bf16=1, clip_grad_norm=1),
    dict(data_parallel=1, fsdp=1, ties=1, fault_tolerance=1),  # HSDP 2 x 2, pipeline 2
    dict(**{"zb-h1": 1}, tensor_parallel=1, compile=1, ties=1, redistribute=1),
    dict(**{"zb-h1": 1}, data_parallel=1, fsdp=1, tensor_parallel=1, recompute=1, bf16=1, clip_grad_norm=1),
    dict(data_parallel=1, compile=1, ties=1, fault_tolerance=1, bf16=1, clip_grad_norm=1),
    dict(zbv=1, data_parallel=1, tensor_parallel=1, fault_tolerance=1, bf16=1, ties=1),
    dict(clip_grad_norm=1),
    dict(data_parallel=1, fsdp=1, compile=1, ties=1),
    dict(zbv=1, data_parallel=1, fsdp=1, recompute=1),
    dict(**{"zb-h1": 1}, data_parallel=1, ties=1, fault_tolerance=1, recompute=1, bf16=1),
]
ROWS = [{f: bool(row.get(f)) for f in FEATURES} | {"redistribute": bool(row.get("redistribute"))} for row in ROWS]


def _name(row: dict) -> str:
    return "+".join(f for f in FEATURES if row[f]) + ("+redistribute" if row["redistribute"] else "")


def test_the_rows_cover_every_pair_of_features():
    assert uncovered(ROWS) == []


@pytest.mark.parametrize("row", ROWS, ids=[_name(r) for r in ROWS])
def test_combined_features_train_like_one_process(row):
    kw = settings(row)
    n = 4 if row["zbv"] else 2
    modules, data = stages(n), batches()
    ref, ref_losses = reference(modules, data, tied=row["ties"], bf16=row["bf16"],
                                clip=kw.get("clip_grad_norm"))
    runner = pipeq.PipelineRunner(modules, lm_loss, SGD, kw.pop("schedule"), 4, **FAST, **kw)
    with runner:
        losses = [runner.step(x, y) for x, y in data]
        state = runner.state_dict()
    assert not wait_no_strays(5.0), "stage processes outlived the run"
    atol, rtol = (1e-2, 1e-2) if row["bf16"] else (1e-5, 0.0)
    assert losses == pytest.approx(ref_losses, abs=atol, rel=rtol)
    assert set(state) <= set(ref)
    for key, value in state.items():
        torch.testing.assert_close(value, ref[key], atol=atol, rtol=rtol, msg=key)


def test_the_gpt_example_in_2_stages_x_fsdp_2_x_tp_2_trains_like_one_process():
    """examples/gpt.py's GPT (tied embedding and head), split by module names into 2 stages, each
    sharded over 2 replicas (FSDP2) and split over 2 tensor-parallel shards: 8 processes, each
    holding a quarter of its stage. The embedding is split by rows (its vocabulary) and the head
    by output rows, so each shard swaps its piece of the tied gradient with the same shard of the
    other stage; the MLPs column then row. It trains like the model in one process."""
    from examples.gpt import GPT, QUICK, lm_loss as gpt_loss, random_batch
    from models import reference_train

    torch.manual_seed(0)
    model = GPT(QUICK)
    stages = pipeq.split(model, modules=[["tok_emb", "pos_emb", "blocks.0"], ["blocks.1", "norm", "lm_head"]])
    mlp = {"mlp.0": "colwise", "mlp.2": "rowwise"}
    plans = [{"tok_emb": "rowwise", **{f"blocks.0.{k}": v for k, v in mlp.items()}},
             {**{f"blocks.1.{k}": v for k, v in mlp.items()}, "lm_head": "colwise"}]
    g = torch.Generator().manual_seed(1)
    data = [random_batch(torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g), 8, QUICK.context, g)
            for _ in range(3)]
    ref, want = reference_train([model], gpt_loss, SGD, data)
    with pipeq.PipelineRunner(stages, gpt_loss, SGD, "1f1b", 4, data_parallel=2, sharding="fsdp", tensor_parallel=2,
                              tp_plan=plans, **FAST) as runner:
        assert len(runner.stage_processes) == 8
        got = [runner.step(x, y) for x, y in data]
        state = runner.state_dict()
    assert not wait_no_strays(5.0), "stage processes outlived the run"
    assert got == pytest.approx(want, abs=1e-5, rel=0)
    expected = ref[0].state_dict()
    assert set(state) <= set(expected)
    for key, value in state.items():
        torch.testing.assert_close(value, expected[key], atol=1e-5, rtol=0, msg=key)
