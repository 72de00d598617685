"""Edge cases a runner handles before (or without) starting a process: devices, restarts, in-place layers, loss weights, shared modules, queue capacity, eval mode."""

from __future__ import annotations

import functools
import time

import pytest
import torch
from torch import nn

import pipeq

from models import reference_train

SGD = functools.partial(torch.optim.SGD, lr=0.1)
FAST = dict(start_method="forkserver")


def xy(batch=16, d=8, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, d, generator=g), torch.randint(0, classes, (batch,), generator=g)


@pytest.mark.timeout(60)
def test_bad_device_is_refused_with_a_message_naming_the_device():
    runner_args = ([nn.Linear(8, 8), nn.Linear(8, 3)], nn.CrossEntropyLoss(), SGD)
    with pytest.raises((ValueError, pipeq.PipelineError)) as info:
        with pipeq.PipelineRunner(*runner_args, devices=["cpu", "cuda"], **FAST):
            pass
    assert "cuda" in str(info.value).lower()  # today: "exited with code 1", nothing else


# -- 6. a stage whose first op is in-place on its input (ReLU(inplace=True)) ----------------------
@pytest.mark.timeout(60)
def test_stage_starting_with_inplace_relu_trains_like_single_process():
    torch.manual_seed(0)
    stages = [nn.Linear(8, 8), nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 3))]
    data = [xy(seed=1)]
    _, ref_losses = reference_train(stages, nn.CrossEntropyLoss(), SGD, data)  # fine in one process
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), SGD, microbatches=2,
                                  mode="simulated")
    with runner:
        # PipelineError: a leaf Variable that requires grad is being used in an in-place operation
        losses = [runner.step(*d) for d in data]
    assert losses == pytest.approx(ref_losses, abs=1e-5)


# -- 7. per-microbatch loss weights n_j/n are wrong for ignore_index / class weights --------------
@pytest.mark.parametrize("loss_fn", [
    nn.CrossEntropyLoss(ignore_index=-100),
    nn.CrossEntropyLoss(weight=torch.tensor([1.0, 5.0, 0.2])),
], ids=["ignore_index", "class_weight"])
def test_mean_loss_with_ignore_index_or_class_weights_equals_full_batch(loss_fn):
    torch.manual_seed(0)
    stages = [nn.Linear(8, 8), nn.Linear(8, 3)]
    x, y = xy(batch=8, seed=2)
    y[:3] = -100 if loss_fn.weight is None else y[:3]  # padding in the first microbatch
    if loss_fn.weight is not None:
        y[:4] = 1  # first microbatch all heavy class
    model, ref_losses = reference_train(stages, loss_fn, SGD, [(x, y)])
    runner = pipeq.PipelineRunner(stages, loss_fn, SGD, microbatches=2, mode="simulated")
    with runner:
        loss = runner.step(x, y)
        state = runner.state_dict()
    assert loss == pytest.approx(ref_losses[0], abs=1e-5)
    torch.testing.assert_close(state["1.weight"], model.state_dict()["1.weight"], atol=1e-5, rtol=0)


# -- 9. modules shared between stages (tied weights) are silently untied --------------------------
def test_module_shared_between_stages_is_refused_or_kept_tied():
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    stages = [shared, nn.Sequential(nn.Tanh(), shared, nn.Linear(8, 3))]
    data = [xy(seed=3), xy(seed=4)]
    _, ref_losses = reference_train(stages, nn.CrossEntropyLoss(), SGD, data)
    try:
        runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), SGD, microbatches=2,
                                      mode="simulated")
    except ValueError:
        return  # refusing shared parameters is an acceptable fix
    with runner:
        losses = [runner.step(*d) for d in data]
    assert losses == pytest.approx(ref_losses, abs=1e-5)


# -- 10. queue_capacity is not checked against the schedule --------------------------------------
class SlowLinear(nn.Linear):
    def forward(self, x):
        time.sleep(0.05)
        return super().forward(x)


@pytest.mark.timeout(60)
def test_queue_capacity_below_microbatches_is_refused_up_front():
    stages = [nn.Linear(8, 8), SlowLinear(8, 3)]
    try:
        runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), SGD, schedule="fill-drain",
                                      microbatches=8, queue_capacity=2, **FAST)
    except ValueError:
        return  # the fix: refuse (or dry-run with the capacity) before anything starts
    with runner:
        # PipelineError: "stage 1 forward queue is full ... a peer is running ahead of the schedule"
        runner.step(*xy(batch=16))


# -- 12. every step forces module.train(True): submodules the user put in eval mode are overridden -
def test_submodules_in_eval_mode_stay_in_eval_mode_during_training():
    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    head[1].eval()  # fine-tuning with frozen BatchNorm statistics
    stages = [head, nn.Linear(8, 3)]
    model, ref_losses = reference_train(stages, nn.CrossEntropyLoss(), SGD, [xy(seed=5)])
    runner = pipeq.PipelineRunner(stages, nn.CrossEntropyLoss(), SGD, microbatches=2,
                                  mode="simulated")
    with runner:
        losses = [runner.step(*xy(seed=5))]
        state = runner.state_dict()
    # pipeq calls stage.train(True) at every step: BN switches to batch statistics, updates
    # running stats and num_batches_tracked
    assert int(state["1.num_batches_tracked"]) == 0
    assert losses == pytest.approx(ref_losses, abs=1e-5)
