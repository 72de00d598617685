"""Learning-rate scheduling (pipeq.stage.lr_schedulers): what the runner accepts, how a stage
steps a scheduler, and what ``runner.scheduler_step`` takes; all before any process starts."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.optim import lr_scheduler as sched

from pipeq.stage import lr_schedulers as lrs

SGD = functools.partial(torch.optim.SGD, lr=0.1)
PLATEAU = functools.partial(sched.ReduceLROnPlateau, patience=0, factor=0.5)
STEP = functools.partial(sched.StepLR, step_size=1, gamma=0.5)


def optimizer(lr: float = 0.1, groups: int = 1) -> torch.optim.Optimizer:
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr * (g + 1)}
                            for g in range(groups)], lr=lr)


def test_no_scheduler_is_stepped_per_step_and_takes_no_metric() -> None:
    assert lrs.check(None, None, SGD) == lrs.LRSchedule("step", False, False)


@pytest.mark.parametrize("factory", [STEP, sched.ExponentialLR, functools.partial(functools.partial(STEP))])
def test_a_plain_scheduler_is_accepted_both_ways(factory) -> None:
    assert lrs.check("step", factory, SGD) == lrs.LRSchedule("step", True, False)
    assert lrs.check("epoch", factory, SGD) == lrs.LRSchedule("epoch", True, False)


@pytest.mark.parametrize("factory", [PLATEAU, sched.ReduceLROnPlateau,
                                     lambda opt: sched.ReduceLROnPlateau(opt, patience=3)])
def test_a_plateau_scheduler_is_found_even_behind_a_lambda_and_needs_the_epoch_interval(factory) -> None:
    assert lrs.check("epoch", factory, SGD) == lrs.LRSchedule("epoch", True, True)
    with pytest.raises(ValueError, match="ReduceLROnPlateau") as info:
        lrs.check("step", factory, SGD)
    assert "lr_scheduler_interval='epoch'" in str(info.value)  # says what to do instead


def test_a_factory_that_needs_the_stages_own_parameters_is_left_to_the_stages() -> None:
    def per_stage(opt):
        return sched.LambdaLR(opt, [lambda e: 1.0, lambda e: 0.5])  # two groups: a stage's own optimizer

    assert lrs.check("step", per_stage, SGD) == lrs.LRSchedule("step", True, False)


@pytest.mark.parametrize("interval, factory, message", [
    ("batch", STEP, "must be 'step'"),
    ("epoch", None, "no lr_scheduler to step"),
])
def test_settings_that_cannot_apply_are_refused_saying_why(interval, factory, message) -> None:
    with pytest.raises(ValueError, match=message):
        lrs.check(interval, factory, SGD)


def test_scheduler_step_takes_a_metric_exactly_when_the_scheduler_does() -> None:
    plateau = lrs.LRSchedule("epoch", True, True)
    plain = lrs.LRSchedule("epoch", True, False)
    assert lrs.check_metric(plateau, 0.25) == 0.25
    assert lrs.check_metric(plateau, torch.tensor(2.0)) == 2.0 and type(lrs.check_metric(plateau, 3)) is float
    assert lrs.check_metric(plain, None) is None
    for schedule, metric, message in [
        (plateau, None, "needs the metric"),
        (plateau, "low", "must be a number"),
        (plain, 0.5, "takes no metric"),
        (lrs.LRSchedule("step", True, False), None, "already step the scheduler"),
        (lrs.LRSchedule("step"), None, "no lr_scheduler"),
    ]:
        with pytest.raises(ValueError, match=message):
            lrs.check_metric(schedule, metric)


def test_step_steps_a_plateau_with_its_metric_and_any_other_without() -> None:
    opt = optimizer()
    plateau = PLATEAU(opt)
    opt.step()
    lrs.step(plateau, 1.0)
    lrs.step(plateau, 2.0)  # worse: patience 0 halves the rate
    assert lrs.group_rates(opt) == [0.05]
    with pytest.raises(ValueError, match="stepped with a metric"):
        lrs.step(plateau, None)
    opt2 = optimizer()
    steps = STEP(opt2)
    opt2.step()
    lrs.step(steps, None)
    assert lrs.group_rates(opt2) == [0.05]
    with pytest.raises(ValueError, match="StepLR takes no metric"):
        lrs.step(steps, 1.0)
    assert lrs.group_rates(opt2) == [0.05]  # refused before it stepped


def test_group_rates_lists_every_parameter_group_in_order() -> None:
    assert lrs.group_rates(optimizer(0.1, groups=3)) == pytest.approx([0.1, 0.2, 0.3])
    assert lrs.group_rates(None) == []
    assert all(type(r) is float for r in lrs.group_rates(optimizer()))
