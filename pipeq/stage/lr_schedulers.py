"""Learning-rate schedulers: when the stages step them, and with what.

Every stage builds one scheduler per optimizer from the runner's ``lr_scheduler`` factory. The
runner's ``lr_scheduler_interval`` says who steps them:

    "step"   (default) each stage, right after each optimizer step (once per microbatch with the
             schedules that update per microbatch, "async" and "al")
    "epoch"  nobody but you: ``runner.scheduler_step(metric)`` steps every stage's scheduler (every
             replica's) once; ``pipeq launch`` calls it between epochs

A scheduler that takes a metric (``torch.optim.lr_scheduler.ReduceLROnPlateau``) is stepped with
one, so it needs ``"epoch"``: a stage has no metric to give it after its optimizer step.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.optim.lr_scheduler import ReduceLROnPlateau

__all__ = ["INTERVALS", "NEEDS_METRIC", "LRSchedule", "takes_metric", "factory_takes_metric", "check", "check_metric",
           "step", "group_rates"]

INTERVALS = ("step", "epoch")

#: What a ReduceLROnPlateau stepped by the stages is refused with (the runner, job files, stages).
NEEDS_METRIC = ("it needs a metric: use lr_scheduler_interval='epoch' and runner.scheduler_step(metric) "
                "(in a job file: lr_scheduler_interval = \"epoch\"; pipeq launch feeds it "
                "lr_scheduler_monitor)")


@dataclass(frozen=True)
class LRSchedule:
    """A run's learning-rate scheduling, as the runner checked it.

    ``interval``: "step" or "epoch" (see the module's docstring); ``scheduled``: the run has an
    ``lr_scheduler``; ``takes_metric``: it is stepped with a metric (ReduceLROnPlateau)."""

    interval: str = "step"
    scheduled: bool = False
    takes_metric: bool = False


def takes_metric(scheduler: Any) -> bool:
    """Whether ``scheduler.step`` is given a metric (ReduceLROnPlateau and its subclasses)."""
    return isinstance(scheduler, ReduceLROnPlateau)


def _factory_class(factory: Any) -> Any:
    """The class a factory builds, when it says so: the class itself or a ``functools.partial``
    of it (nested partials unwrapped); None for anything else (a function, a lambda)."""
    while isinstance(factory, functools.partial):
        factory = factory.func
    return factory if isinstance(factory, type) else None


def factory_takes_metric(optimizer: Callable | None, lr_scheduler: Callable) -> bool:
    """Whether the schedulers ``lr_scheduler`` builds take a metric, found by building one over a
    throwaway parameter (with the run's own ``optimizer`` factory when there is one, as the
    stages will) before any stage process exists. A factory that cannot be built that way (it
    needs the stage's own parameters) is judged by its class alone."""
    cls = _factory_class(lr_scheduler)
    if cls is not None:
        return issubclass(cls, ReduceLROnPlateau)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            param = torch.nn.Parameter(torch.zeros(1))
            opt = optimizer([param]) if optimizer is not None else torch.optim.SGD([param], lr=0.1)
            return takes_metric(lr_scheduler(opt))
    except Exception:  # the stages will say what is wrong with it, with their traceback
        return False


def check(interval: Any, lr_scheduler: Callable | None, optimizer: Callable | None) -> LRSchedule:
    """The runner's ``lr_scheduler_interval`` (None: "step") against its scheduler factory;
    a ``ValueError`` says what cannot work and what to do instead."""
    interval = "step" if interval is None else interval
    if interval not in INTERVALS:
        raise ValueError(f"lr_scheduler_interval must be 'step' (the stages step the scheduler after every "
                         f"optimizer step) or 'epoch' (runner.scheduler_step() steps it), got {interval!r}")
    if lr_scheduler is None:
        if interval == "epoch":
            raise ValueError("lr_scheduler_interval='epoch' but there is no lr_scheduler to step: pass "
                             "lr_scheduler= (a factory called with each stage's optimizer), or drop the interval")
        return LRSchedule(interval)
    metric = factory_takes_metric(optimizer, lr_scheduler)
    if metric and interval == "step":
        raise ValueError(f"lr_scheduler builds a ReduceLROnPlateau, which the stages cannot step after each "
                         f"optimizer step: {NEEDS_METRIC}")
    return LRSchedule(interval, True, metric)


def check_metric(schedule: LRSchedule, metric: Any) -> float | None:
    """``runner.scheduler_step(metric)``'s arguments against the run's schedule: the metric as a
    float (None when the scheduler takes none); a ``ValueError`` says what is wrong."""
    if not schedule.scheduled:
        raise ValueError("runner.scheduler_step(): the runner has no lr_scheduler to step")
    if schedule.interval != "epoch":
        raise ValueError("runner.scheduler_step(): the stages already step the scheduler after every optimizer "
                         "step (lr_scheduler_interval='step'); create the runner with "
                         "lr_scheduler_interval='epoch' to step it yourself")
    if schedule.takes_metric:
        if metric is None:
            raise ValueError("runner.scheduler_step(): the scheduler is a ReduceLROnPlateau, which needs the metric "
                             "it monitors: runner.scheduler_step(metric), e.g. the evaluation's loss")
        try:
            value = float(metric)
        except (TypeError, ValueError):
            raise ValueError(f"runner.scheduler_step(metric={metric!r}): the metric must be a number") from None
        return value
    if metric is not None:
        raise ValueError(f"runner.scheduler_step(metric={metric!r}): the scheduler takes no metric (only a "
                         "ReduceLROnPlateau does); call runner.scheduler_step()")
    return None


def step(scheduler: Any, metric: float | None) -> None:
    """Step one scheduler: with ``metric`` when it takes one (see :func:`check_metric`)."""
    if takes_metric(scheduler):
        if metric is None:
            raise ValueError(f"a ReduceLROnPlateau is stepped with a metric: {NEEDS_METRIC}")
        scheduler.step(metric)
    elif metric is not None:
        raise ValueError(f"{type(scheduler).__name__} takes no metric; step it without one")
    else:
        scheduler.step()


def group_rates(optimizer: torch.optim.Optimizer | None) -> list[float]:
    """The learning rate of each of ``optimizer``'s parameter groups, in order (none without one)."""
    if optimizer is None:
        return []
    return [float(group["lr"]) for group in optimizer.param_groups]
