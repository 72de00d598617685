"""ReduceLROnPlateau fed its metric by epoch: with replicas in stage processes (equal to a plain
loop, through a checkpoint), and in ``pipeq launch`` (the lr it lowers, resumed mid-epoch and at an
epoch's end). The launches run in this process, from tests/support/ (launch_jobs.py holds the
job's functions), its fork server shared; the checks without processes are in
tests/unit/control/test_schedulers_in_process.py."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau

import pipeq
from job_files import MLP, launch, write
from launch_util import metrics, model_state
from pipeq import checkpoint
from scheduler_cases import (
    PLATEAU, PLATEAU_METRICS, SGD, assert_close, epochs_of_data, make_stages, reference, train_by_epoch
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.timeout(90)
def test_plateau_with_data_parallel_processes_equals_the_loop_and_checkpoints(tmp_path) -> None:
    """Process mode, two replicas (4 processes): every replica's schedulers step; the
    scheduler's state (inf, strings) travels in a checkpoint and comes back."""
    data = epochs_of_data()
    ref_state, ref_lrs = reference(PLATEAU, PLATEAU_METRICS, data)
    runner = pipeq.PipelineRunner(make_stages(), nn.CrossEntropyLoss(), SGD, "1f1b", 2, lr_scheduler=PLATEAU,
                                  lr_scheduler_interval="epoch", data_parallel=2, start_method="forkserver",
                                  threads_per_stage=1)
    with runner:
        lrs = train_by_epoch(runner, PLATEAU_METRICS, data)
        assert lrs == pytest.approx(ref_lrs)
        assert_close(runner.state_dict(), ref_state)
        runner.save(str(tmp_path / "ckpt"))
        sched = checkpoint.load(str(tmp_path / "ckpt")).sched
        assert [s["best"] for s in sched] == [0.5, 0.5] and sched[0]["mode"] == "min"
        assert sched[0]["mode_worse"] == float("inf")
        runner.scheduler_step(2.0)  # no better: the lr halves again ...
        assert runner.learning_rates() == [[0.05], [0.05]]
        runner.load(str(tmp_path / "ckpt"))  # ... and the checkpoint brings back 0.1 and its best
        assert runner.learning_rates() == [[0.1], [0.1]]
        runner.scheduler_step(0.6)  # worse than the restored best 0.5: halves, on every replica
        for x, y in data[0]:
            runner.step(x, y)
            assert runner.last_step_lr == 0.05
        from pipeq.testing import backend_of
        from pipeq.wire.messages import Kind

        every = backend_of(runner).ask_each(Kind.GET_LR, Kind.LR, "learning_rates", range(4))  # replica 1's too
        assert [every[g].extra["lrs"] for g in range(4)] == [[0.05]] * 4


# -- pipeq launch: ReduceLROnPlateau on a plateau, resumed mid-epoch and at an epoch's end ----------------
#: 5 epochs of 4 batches; the eval loss improves by less than 15% an epoch: a plateau to the scheduler
PLATEAU_JOB = MLP.replace("lr = 0.1", "lr = 0.5") + """\
lr_scheduler = "torch.optim.lr_scheduler:ReduceLROnPlateau"
lr_scheduler_args = { patience = 0, factor = 0.5, threshold = 0.15 }
lr_scheduler_interval = "epoch"
data_args = { batches = 4 }
metrics = { top2 = "launch_jobs:top2" }
epochs = 5
checkpoint_every = 6
"""


@pytest.fixture(scope="module")
def plateau_run(tmp_path_factory) -> tuple[str, str]:
    base = tmp_path_factory.mktemp("plateau")
    out = str(base / "out")
    job = write(base, PLATEAU_JOB + f'out = "{out}"\n')
    launch(job)
    return job, out


def test_launched_plateau_lowers_the_lr_fed_the_eval_loss(plateau_run) -> None:
    _, out = plateau_run
    lines = metrics(out)
    assert [ln["step"] for ln in lines] == list(range(1, 21))
    by_epoch = [[ln["lr"] for ln in lines if ln["epoch"] == e] for e in range(5)]
    assert all(len(set(lrs)) == 1 for lrs in by_epoch), by_epoch  # stepped between epochs only
    lrs = [lrs[0] for lrs in by_epoch]
    # each epoch's end was evaluated (its last line), and the job's metric beside the defaults
    ends = [ln for ln in lines if "eval_loss" in ln]
    assert [ln["step"] for ln in ends] == [4, 8, 12, 16, 20]
    assert all(0 <= ln["eval_top2"] <= 1 and ln["eval_top2"] >= ln["eval_accuracy"] for ln in ends)
    # a ReduceLROnPlateau fed those eval losses gives those rates: it got the eval loss
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
    replay = ReduceLROnPlateau(opt, patience=0, factor=0.5, threshold=0.15)
    expected = []
    for ln in ends:
        expected.append(opt.param_groups[0]["lr"])
        replay.step(ln["eval_loss"])
    assert lrs == expected
    assert lrs[0] == 0.5 and lrs[-1] < 0.5, lrs  # the plateau lowered it


@pytest.mark.parametrize("resume_at", [6, 12], ids=["mid-epoch", "epoch-end"])
def test_launched_plateau_resumes_to_the_same_run(plateau_run, tmp_path, resume_at) -> None:
    """Step 6 is in epoch 1; step 12 ends epoch 2, checkpointed before its scheduler step (the
    resumed run takes it first, fed the same eval loss)."""
    job, out = plateau_run
    copy_out = str(tmp_path / "out")
    shutil.copytree(out, copy_out)
    shutil.rmtree(os.path.join(copy_out, "final"))
    for name in os.listdir(os.path.join(copy_out, "checkpoints")):
        if int(name.split("-")[1]) > resume_at:
            shutil.rmtree(os.path.join(copy_out, "checkpoints", name))
    launch(job, "--resume", "--out", copy_out)
    assert [ln.get("lr") for ln in metrics(copy_out)] == [ln.get("lr") for ln in metrics(out)]
    resumed, first = model_state(copy_out), model_state(out)
    for k in first:
        assert torch.allclose(resumed[k], first[k], rtol=0, atol=1e-6), k
