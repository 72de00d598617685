"""Sharded replicas: ``PipelineRunner(..., data_parallel=2, sharding="fsdp")`` (pipeq.parallel.fsdp).

Each stage's two replicas shard its parameters, gradients and optimizer state with torch's FSDP2
over their own process group; the gradients reduce-scatter once per step. So a step must still
equal single-process full-batch training (losses, every tensor of the whole state, predict),
under 1F1B, the split backward of ZB-H1 and the two stages per process of ZBV, with either
reshard policy; clipping's global norm must count every piece once; and ``pipeq launch`` must
checkpoint a sharded run whole, so that it resumes at ``data_parallel=1`` and goes on as an
uninterrupted run does.
"""

from __future__ import annotations

import functools
import shutil

import pytest
import torch
from torch import nn

import pipeq
from attacker import listening_addresses
from launch_util import model_state
from models import flat_state, mlp_stages, reference_train
from strays import wait_no_strays

pytestmark = pytest.mark.timeout(240)

FAST = dict(start_method="forkserver")  # stages fork from a preloaded server: ~0.1 s each
ADAM = functools.partial(torch.optim.Adam, lr=0.01)
MOMENTUM = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)  # (Adam's steps hide a gradient's scale)
TOL = dict(atol=1e-5, rtol=1e-5)
#: launch_jobs.py's MLP job, trained with Adam
MLP_ADAM = """\
stages = "launch_jobs:mlp_stages"
loss = "torch.nn:CrossEntropyLoss"
optimizer = "torch.optim:Adam"
optimizer_args = { lr = 0.01 }
data = "launch_jobs:train_batches"
microbatches = 4
"""


def batches(n_steps: int, size: int, seed: int = 0, width: int = 8, classes: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, width, generator=g), torch.randint(0, classes, (size,), generator=g))
            for _ in range(n_steps)]


def assert_close_states(got, want):
    assert list(got) == list(want)
    for key in want:
        assert got[key].shape == want[key].shape, key
        torch.testing.assert_close(got[key], want[key], **TOL, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("widths,schedule,reshard", [
    ((8, 16, 3), "1f1b", "step"),
    ((8, 16, 3), "zb-h1", "step"),
    ((8, 16, 3), "zbv", "microbatch"),  # one process per replica holding both stages
    ((8, 16, 12, 16, 3), "zbv", "step"),  # four stages, two per process: two FSDP roots over one group
], ids=["2-stage-1f1b", "2-stage-zb-h1", "2-stage-zbv-microbatch", "4-stage-zbv"])
def test_sharded_replicas_equal_single_process_full_batch_training(widths, schedule, reshard):
    stages = mlp_stages(widths, seed=0)
    data = batches(3, 16)
    ref, ref_losses = reference_train(stages, nn.CrossEntropyLoss(), MOMENTUM, data)
    with pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), MOMENTUM, schedule, 4, data_parallel=2, sharding="fsdp",
                              fsdp_reshard=reshard, **FAST) as runner:
        losses = [runner.step(x, y) for x, y in data]
        # the replicas' process group (gloo) listens on loopback only, as every other socket of the run
        listening = listening_addresses([w["pid"] for w in runner.stage_processes])
        assert listening and {addr for addr, _ in listening} == {"127.0.0.1"}, listening
        state = runner.state_dict()
        held = [m.param_bytes for m in runner.memory()]
        out = runner.predict(data[0][0])
        assert [m.param_bytes for m in runner.memory()] == held  # a predict leaves each replica its pieces only
        if reshard == "microbatch":  # 7 samples over 2 replicas: 4 and 3 microbatches, a gather one would wait for
            with pytest.raises(ValueError, match=r"fsdp_reshard='microbatch'.* gives them \[4, 3\]"):
                runner.step(data[0][0][:7], data[0][1][:7])
    assert losses == pytest.approx(ref_losses, abs=1e-5)  # the whole batch's loss
    assert_close_states(state, flat_state(ref))  # whole tensors under the usual names
    torch.testing.assert_close(out, ref(data[0][0]), **TOL)
    assert not torch.allclose(state["0.weight"], stages[0][0].weight, atol=1e-3)  # training moved it
    wait_no_strays()


class Unused(nn.Module):
    """A stage with a parameter its forward never uses and a frozen one."""

    def __init__(self):
        super().__init__()
        self.a, self.unused, self.frozen = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return torch.tanh(self.frozen(self.a(x)))


def test_unused_frozen_and_no_parameters_shard_alike():
    """A stage without parameters, one with a parameter it never uses (every replica's
    reduce-scatter still holds it: zeros) and a frozen one: full-batch training's numbers."""
    torch.manual_seed(5)
    stages = [Unused(), nn.ReLU(), nn.Linear(8, 3)]
    data = batches(3, 16, seed=6)
    ref, ref_losses = reference_train(stages, nn.CrossEntropyLoss(), MOMENTUM, data)
    with pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), MOMENTUM, "zb-h1", 4, data_parallel=2,
                              sharding="fsdp", **FAST) as runner:
        losses = [runner.step(x, y) for x, y in data]
        state = runner.state_dict()
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    assert_close_states(state, flat_state(ref))


def test_clipping_counts_every_piece_once_and_recompute_composes():
    """The global norm over every stage and both replicas' pieces, as clip_grad_norm_ on the whole
    model: a clip that bites (0.05) gives full-batch training's clipped steps."""
    stages = mlp_stages((8, 16, 3), seed=1)
    data = batches(3, 16, seed=3)
    ref, ref_losses = reference_train(stages, nn.CrossEntropyLoss(), MOMENTUM, data, clip=0.05)
    with pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), MOMENTUM, "zb-h1", 4, data_parallel=2, sharding="fsdp",
                              clip_grad_norm=0.05, recompute=True, **FAST) as runner:
        losses = [runner.step(x, y) for x, y in data]
        state = runner.state_dict()
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    assert_close_states(state, flat_state(ref))


def test_a_snapshot_of_a_sharded_run_restarts_it_sharded_or_whole():
    """A restart from an in-memory snapshot (what ``pipeq launch --max-restarts`` restores): whole
    tensors and momentum, taken from the pieces, restored into a fresh sharded run and into a
    whole one; both go on as the uninterrupted run does."""
    stages = mlp_stages((8, 16, 3), seed=2)
    data = batches(4, 16, seed=4)
    ref, ref_losses = reference_train(stages, nn.CrossEntropyLoss(), MOMENTUM, data)
    sharded = dict(data_parallel=2, sharding="fsdp", **FAST)
    with pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), MOMENTUM, "zbv", 4, **sharded) as first:
        first.keep_snapshots(2)
        losses = [first.step(x, y) for x, y in data[:2]]
        first.state_dict()  # (asked after the snapshot: it has come back by now)
        snap = first.snapshot
    assert snap is not None and snap.step == 2
    for settings in (sharded, FAST):
        with pipeq.PipelineRunner(mlp_stages((8, 16, 3), seed=9), nn.CrossEntropyLoss(), MOMENTUM, "zbv", 4,
                                  **settings) as again:
            again.restore_snapshot(snap)
            rest = [again.step(x, y) for x, y in data[2:]]
            state = again.state_dict()
        assert losses + rest == pytest.approx(ref_losses, abs=1e-5)
        assert_close_states(state, flat_state(ref))


def test_a_sharded_launch_checkpoints_whole_and_resumes_at_data_parallel_1(tmp_path):
    """``pipeq launch`` of a sharded job (2 replicas) checkpoints at step 2; the checkpoint, whole,
    resumes with ``data_parallel=1`` to step 4 and ends where an uninterrupted run ends."""
    from job_files import write
    from launch_util import SUPPORT, launch_here

    job = MLP_ADAM + 'schedule = "zb-h1"\ntensorboard = false\nseed = 0\n'
    sharded = write(tmp_path, job + 'data_parallel = 2\nsharding = "fsdp"\n', "sharded")
    whole = write(tmp_path, job, "whole")
    out, resumed_out, straight = (str(tmp_path / name) for name in ("run", "resumed", "straight"))
    first = launch_here("--steps", "2", "--checkpoint-every", "2", "--out", out, job=sharded, cwd=SUPPORT)
    assert first.returncode == 0, first.stderr
    shutil.copytree(out, resumed_out)
    resumed = launch_here("--steps", "4", "--checkpoint-every", "2", "--out", resumed_out, "--resume", job=whole,
                          cwd=SUPPORT)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr and "step 2" in resumed.stderr
    done = launch_here("--steps", "4", "--out", straight, job=whole, cwd=SUPPORT)
    assert done.returncode == 0, done.stderr
    assert_close_states(model_state(resumed_out), model_state(straight))
    # the sharded run's exported model is whole: the flat model's names and shapes
    assert {k: v.shape for k, v in model_state(out).items()} == {k: v.shape for k, v in model_state(straight).items()}
    wait_no_strays()


def test_gathers_frees_and_reductions_are_in_the_trace_and_in_the_memory_figures(tmp_path):
    """A traced sharded run records, on each stage's track, the step's gather of its parameters
    and its reductions (``parallel`` events: GATHER with the bytes it holds whole, REDUCE), and
    ``runner.memory()`` counts the gathered parameters and the replicas' buckets beside the pieces;
    with ``fsdp_reshard="microbatch"``, a gather and a free around every action."""
    from pipeq.trace.format import load_trace
    from pipeq.trace.report import analyze, format_report

    stages = mlp_stages((8, 16, 3), seed=0)
    data = batches(2, 8)
    for reshard, gathers in (("step", 1), ("microbatch", 2 * 2)):  # per stage and step: F and B of a replica's 2 microbatches
        path = tmp_path / f"{reshard}.json"
        with pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), MOMENTUM, "1f1b", 4, data_parallel=4,
                                  sharding="hsdp", shard_size=2, fsdp_reshard=reshard, trace=str(path),
                                  **FAST) as runner:
            for x, y in data:
                runner.step(x, y)
            rows = runner.memory()
        trace = load_trace(str(path))
        assert "parallel" in format_report(analyze(trace)).splitlines()[3]  # the report's column of them
        events = [e for e in trace.events if e.cat == "parallel" and e.replica == 0]
        for k, whole in enumerate((8 * 16 + 16, 16 * 3 + 3)):
            mine = [e for e in events if e.stage == k and e.step == 2]
            assert len([e for e in mine if e.op == "GATHER"]) == gathers, mine
            assert {e.bytes for e in mine if e.op == "GATHER"} == {4 * whole}
            assert len([e for e in mine if e.op == "REDUCE"]) == 2  # started after the last backward, finished at STEP
            assert len([e for e in mine if e.op == "FREE"]) == (gathers if reshard == "microbatch" else 0)
        for row in rows:
            assert row.gathered_param_bytes == 4 * (8 * 16 + 16 if row.stage == 0 else 16 * 3 + 3)
            assert 0 < row.reduce_bytes < row.gathered_param_bytes  # the pieces the shard groups all-reduce
            assert row.predicted_peak_bytes is not None and row.predicted_peak_bytes > row.state_bytes
