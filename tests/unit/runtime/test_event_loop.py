"""A stage process's event loop (pipeq.runtime.loop.EventLoop), in this process.

Three stages' event loops run in threads over an in-memory wire, commanded by the driver's own
backend (tests/support/inproc.py): what a runner in process mode computes, without processes.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from inproc import InProcessPipeline
from models import reference_train

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
BATCH = 12


def stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(6, 10), nn.Tanh()), nn.Sequential(nn.Linear(10, 10), nn.Tanh()), nn.Linear(10, 3)]


def batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)) for _ in range(n)]


def reference(modules: list[nn.Module], data) -> tuple[list[float], nn.Module]:
    """The same training in one process (:func:`models.reference_train`): the flat model, one optimizer step per batch."""
    model, losses = reference_train([], nn.functional.cross_entropy, SGD, data, model=nn.Sequential(*copy.deepcopy(modules)))
    return losses, model


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_event_loops_train_as_the_flat_model_does(schedule) -> None:
    modules, data = stages(), batches()
    want, model = reference(modules, data)
    with InProcessPipeline(modules, nn.CrossEntropyLoss(), SGD, schedule=schedule, microbatches=4) as pipe:
        got = [pipe.train(x, y) for x, y in data]
        state = pipe.backend.get_state()
        out = pipe.backend.predict(99, [6, 6], data[0][0])
    assert got == pytest.approx(want, abs=1e-6)
    for k, (names, tensors) in enumerate(state):  # every stage's state, as the flat model's layer k
        expected = model[k].state_dict()
        assert names == list(expected)
        for name, t in zip(names, tensors):
            assert torch.allclose(t, expected[name], atol=1e-6), (k, name)
    # predict: the output stage's result, one per microbatch, as the trained flat model computes it
    with torch.no_grad():
        whole = model(data[0][0])
    assert [len(o) for o in out] == [1, 1]
    assert torch.allclose(torch.cat([o[0] for o in out]), whole, atol=1e-5)


@pytest.mark.timeout(60)
def test_set_state_loads_every_stage_and_training_goes_on_from_it() -> None:
    data = batches(2)
    donor = stages()
    for m in donor:  # other weights than the pipeline's own
        for p in m.parameters():
            nn.init.normal_(p)
    want, _ = reference(donor, data)
    with InProcessPipeline(stages(), nn.CrossEntropyLoss(), SGD, microbatches=3) as pipe:
        pipe.backend.set_state([(list(m.state_dict()), list(m.state_dict().values())) for m in donor])
        got = [pipe.train(x, y) for x, y in data]
    assert got == pytest.approx(want, abs=1e-6)


@pytest.mark.timeout(60)
def test_lr_schedulers_step_after_each_optimizer_step_or_when_told() -> None:
    step_lr = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)
    x, y = batches(1)[0]
    with InProcessPipeline(stages(), nn.CrossEntropyLoss(), SGD, microbatches=2, lr_scheduler=step_lr) as pipe:
        pipe.train(x, y)
        pipe.train(x, y)
        assert pipe.backend.learning_rates() == [[pytest.approx(0.025)]] * 3
    with InProcessPipeline(stages(), nn.CrossEntropyLoss(), SGD, microbatches=2, lr_scheduler=step_lr,
                           lr_scheduler_interval="epoch") as pipe:
        pipe.train(x, y)
        assert pipe.backend.learning_rates() == [[pytest.approx(0.1)]] * 3  # nobody stepped them
        pipe.backend.scheduler_step(None)
        assert pipe.backend.learning_rates() == [[pytest.approx(0.05)]] * 3


@pytest.mark.timeout(60)
def test_a_stream_of_steps_gives_each_steps_loss_in_order() -> None:
    modules, data = stages(), batches(3)
    want, _ = reference(modules, data)
    with InProcessPipeline(modules, nn.CrossEntropyLoss(), SGD, microbatches=2) as pipe:
        steps = [pipe.submit(x, y) for x, y in data]  # all sent before any loss is read
        got = [pipe.backend.result(s) for s in steps]
    assert got == pytest.approx(want, abs=1e-6)
