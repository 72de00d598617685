"""A stage's optimizer step: gradient sync, the step the stages agree on (clipping, fp16 loss
scaling, finiteness checks) and its learning-rate schedulers.

The gradients are final once they are summed over the replicas (:meth:`OptimizerStep.sync_replicas`)
and then, for tied weights, over the stages holding a copy (the interpreter's exchange, see
:mod:`pipeq.stage.ties`); a tied parameter counts in the global gradient norm once, on its owner.

:class:`OptimizerStep` is a part of :class:`~pipeq.StageExecutor`. A step runs
one of two ways: :meth:`~OptimizerStep.optimizer_step` when the stages need not agree first, or
:meth:`~OptimizerStep.step_stats` then :meth:`~OptimizerStep.apply_step` with the statistics
every stage combined (see :mod:`pipeq.stage.numerics`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pipeq.stage import lr_schedulers
from pipeq.stage.numerics import LossScaler, Numerics, StepStats, all_finite, clip_, norm_term, total_norm
from pipeq.stage.spec import StageSpec

__all__ = ["OptimizerStep"]


class OptimizerStep:
    """The optimizer and lr scheduler of a stage, and how a step updates them (see the module)."""

    # what the executor provides
    index: int
    module: nn.Module
    numerics: Numerics
    scaler: LossScaler | None
    grad_sync: Any  # data parallelism: a pipeq.parallel.data.GradSync, or None
    tied: Any  # tied weights: a pipeq.stage.ties.TiedGrads, or None
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    scheduler_interval: str
    weights: list[float]
    step_index: int
    skipped_steps: int
    _backwards: int
    _synced: bool  # this step's gradients are summed over the replicas (reset by each step's begin)

    @staticmethod
    def make_optimizer(spec: StageSpec, params: list[torch.Tensor]) -> torch.optim.Optimizer | None:
        """``spec``'s optimizer over ``params`` (None when there is nothing to train)."""
        return spec.optimizer(params) if params else None

    @staticmethod
    def make_scheduler(spec: StageSpec, optimizer: torch.optim.Optimizer | None) -> Any:
        """``spec``'s lr scheduler of ``optimizer`` (None without either)."""
        if spec.lr_scheduler is None or optimizer is None:
            return None
        scheduler = spec.lr_scheduler(optimizer)
        if spec.lr_scheduler_interval == "step" and lr_schedulers.takes_metric(scheduler):
            raise ValueError(f"lr_scheduler built a ReduceLROnPlateau: {lr_schedulers.NEEDS_METRIC}")
        return scheduler

    def backward_done(self) -> None:
        """Called after each backward: after the step's last one, the gradients' all-reduce starts."""
        self._backwards += 1
        if self.grad_sync is not None and self._backwards == len(self.weights):
            self.grad_sync.start()

    def optimizer_params(self) -> list[torch.Tensor]:
        """The parameters the optimizer updates, in its groups' order."""
        return [p for g in self.optimizer.param_groups for p in g["params"]] if self.optimizer else []

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.optimizer_params() if p.grad is not None]

    def _norm_grads(self) -> list[torch.Tensor]:
        """The gradients this stage counts in the global norm: its own, and the tied parameters
        it owns (each tied parameter counts once, as in one process)."""
        skip = self.tied.not_owned() if self.tied is not None else set()
        return [p.grad for p in self.optimizer_params() if p.grad is not None and id(p) not in skip]

    def sync_replicas(self) -> None:
        """Sum this step's gradients over the replicas (data parallelism), once per step."""
        if self.grad_sync is not None and not self._synced:
            self.grad_sync.finish()
        self._synced = True

    def optimizer_step(self) -> None:
        """The step of a run whose stages need not agree first (see :meth:`step_stats`)."""
        self.sync_replicas()
        self._update()

    def _update(self) -> None:
        """The optimizer's step (executors with more optimizers add theirs, see :meth:`_step`)."""
        self._step(self.optimizer, self.scheduler)

    def _step(self, optimizer: torch.optim.Optimizer | None, scheduler: Any) -> None:
        """``optimizer``'s step, then ``scheduler``'s if it steps with it (interval "step")."""
        if optimizer is not None:
            optimizer.step()
            if scheduler is not None and self.scheduler_interval == "step":
                scheduler.step()

    # -- steps the stages agree on (clipping, fp16, check_finite; see pipeq.stage.numerics) ------
    def step_stats(self) -> StepStats:
        """This stage's part of the step's global statistics, once its gradients are final (and
        all-reduced over the replicas, and summed over tied copies); fp16 gradients are unscaled here."""
        self.sync_replicas()
        grads = self._grads()
        if self.scaler is not None:
            bad = self.scaler.unscale_(grads)
        elif self.numerics.check_finite:
            bad = not all_finite(grads)
        else:
            bad = False
        p = self.numerics.clip_norm_type
        term = norm_term(self._norm_grads(), p) if self.numerics.clip_grad_norm is not None and not bad else 0.0
        return StepStats(term, float(self.index) if bad else math.inf)

    def apply_step(self, total: StepStats) -> None:
        """The optimizer step (or its skip) that every stage decides alike from ``total``."""
        nm = self.numerics
        bad = total.first_bad != math.inf
        if self.scaler is not None:
            self.scaler.update(bad)
        elif bad and nm.check_finite == "raise":
            if total.first_bad == self.index:
                names = [n for n, p in self.module.named_parameters() if p.grad is not None
                         and not all_finite((p.grad,))]
                raise FloatingPointError(
                    f"stage {self.index}: the gradient of {', '.join(names) or 'a parameter'} holds NaN or "
                    f"Inf after the backwards of step {self.step_index}; check_finite='raise' stopped the "
                    "run before any optimizer step")
            return  # that stage reports it; nobody steps
        if bad:
            self.skipped_steps += 1
            if self.scheduler is not None and self.scheduler_interval == "step":
                self.scheduler.step()  # a skipped step still counts for the schedule, as in a torch loop
            return
        if nm.clip_grad_norm is not None:
            clip_(self._grads(), nm.clip_grad_norm, total_norm(total, nm.clip_norm_type))
        self._update()

    # -- learning-rate schedule ------------------------------------------------------------------
    def schedulers(self) -> list[Any]:
        """This stage's lr schedulers (one per optimizer that has one)."""
        return [self.scheduler] if self.scheduler is not None else []

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """This stage's optimizers (none for a stage without trainable parameters)."""
        return [self.optimizer] if self.optimizer is not None else []

    def scheduler_step(self, metric: float | None) -> None:
        """Step every scheduler of this stage once (``runner.scheduler_step``), with ``metric``
        when it takes one (see :func:`pipeq.stage.lr_schedulers.step`)."""
        for scheduler in self.schedulers():
            lr_schedulers.step(scheduler, metric)

    def learning_rates(self) -> list[float]:
        """The learning rate of every parameter group of every optimizer of this stage, in order."""
        return [lr for opt in self.optimizers() for lr in lr_schedulers.group_rates(opt)]

    def learning_rate(self) -> float | None:
        """The first parameter group's learning rate (reported with each step's loss), None
        for a stage without an optimizer."""
        rates = self.learning_rates()
        return rates[0] if rates else None
