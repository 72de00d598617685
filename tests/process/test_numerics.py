"""Mixed precision, loss scaling, clipping by the global norm, finiteness checks, recomputation.

Each is held against what one process does with the whole model: torch.autocast,
torch.amp.GradScaler, torch.nn.utils.clip_grad_norm_, or the same run without recomputation.
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from torch import nn

import pipeq
from numerics_cases import SGD, assert_close, data, mlp, reference, run
from pipeq.errors import PipelineError


@pytest.mark.timeout(120)
def test_clipping_with_replicas_equals_clip_grad_norm_on_the_whole_batch():
    """Two replicas of three stage processes: the norm is taken after the all-reduce."""
    batches = data(2)
    want = reference(mlp(), batches, clip=0.05)
    got, _, stats = run(mlp(), batches, mode="process", data_parallel=2, clip_grad_norm=0.05,
                        start_method="forkserver")
    assert_close(got, want, atol=1e-6)
    assert [s["memory"] for s in stats] == ["process peak RSS"] * 3 and all(s["peak_bytes"] > 0 for s in stats)


# -- finiteness ---------------------------------------------------------------------------------------
class Blows(nn.Module):
    """Multiplies by 1e60 (Inf in float32) the samples whose first feature is over 100."""

    def forward(self, x):
        scale = torch.where(x[:, :1] > 100, 1e30, 1.0)
        return x * scale * scale


@pytest.mark.timeout(120)
def test_check_finite_names_the_stage_whose_output_is_not_finite():
    x, y = data(1)[0]
    x = x.clone()
    x[5, 0] = 1000.0  # microbatch 1: stage 1's Blows turns it into Inf
    first = nn.Linear(6, 6)
    with torch.no_grad():  # the identity: the large feature reaches stage 1 as it is
        first.weight.copy_(torch.eye(6))
        first.bias.zero_()
    stages = [first, nn.Sequential(Blows(), nn.Linear(6, 4))]
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), SGD, microbatches=3, check_finite=True,
                                  start_method="forkserver")
    with runner, pytest.raises(PipelineError, match=r"stage 1.*the output of microbatch 1 \(step 1\) holds NaN or Inf"):
        runner.step(x, y)


class Wide(nn.Sequential):
    """Eight Linear(256, 256) + ReLU layers: activations dominate the memory at large batches."""

    def __init__(self) -> None:
        super().__init__(*[m for _ in range(8) for m in (nn.Linear(256, 256), nn.ReLU())])


@pytest.mark.timeout(180)
def test_recompute_lowers_the_measured_peak_memory():
    """Fill-drain holds all 8 microbatches' activations until the backwards; with recompute
    only their inputs: about 9 saved tensors of 1 MiB a microbatch against 1 (~70 MiB saved)."""
    torch.manual_seed(0)
    stages = [Wide(), nn.Sequential(Wide(), nn.Linear(256, 4))]
    x, y = torch.randn(8192, 256), torch.randint(0, 4, (8192,))
    peaks = {}
    for rc in (False, True):
        runner = pipeq.PipelineRunner(copy.deepcopy(stages), nn.CrossEntropyLoss(), SGD, "fill-drain", 8,
                                      recompute=rc, start_method="forkserver")
        with runner:
            runner.step(x, y)  # allocator and optimizer state warmed up
            runner.stats(reset_peak=True)
            runner.step(x, y)
            peaks[rc] = runner.stats()[0]["peak_bytes"]
    saved = peaks[False] - peaks[True]
    assert saved > 40 << 20, peaks


# -- job files and pipeq launch --------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_launched_job_trains_with_the_numerics_it_names(tmp_path):
    """The job's precision, clipping, check_finite and recompute reach every stage: the launched
    run's weights equal a simulated runner's with the same options (launch_jobs' MLP, seed 0)."""
    from launch_util import model_state
    from job_files import MLP, launch, write

    import launch_jobs

    options = 'precision = "bf16"\nclip_grad_norm = 0.5\nclip_norm_type = inf\ncheck_finite = "skip"\nrecompute = [true, false, true]\n'
    out = tmp_path / "out"
    launch(write(tmp_path, MLP + options + f'steps = 2\nseed = 0\nout = "{out}"\n'))
    torch.manual_seed(0)
    stages = launch_jobs.mlp_stages()
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1), "1f1b", 2,
                                  mode="simulated", precision="bf16", clip_grad_norm=0.5, clip_norm_type=math.inf,
                                  check_finite="skip", recompute=[True, False, True])
    with runner:
        for x, y in list(launch_jobs.train_batches(0))[:2]:
            runner.step(x, y)
        want = runner.state_dict()
    assert_close(model_state(str(out)), want, atol=1e-6)
