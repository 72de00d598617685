"""A stage's optimizer step: gradient sync, the step the stages agree on (clipping, fp16 loss
scaling, finiteness checks) and its learning-rate schedulers.

The gradients are final once they are reduced over the stage's other processes
(:meth:`Stepper.sync_replicas`: a sharded stage's reduce-scatter, the replicas' all-reduce, see
:mod:`pipeq.parallel.layers`) and then, for tied weights, summed over the stages holding a copy
(the interpreter's exchange, see :mod:`pipeq.stage.ties`). A tied parameter counts in the global
gradient norm once, on its owner; a gradient a process holds a piece of (tensor parallelism,
FSDP) counts by its piece, and the pieces' terms are combined over the stage's processes
before the stages combine theirs.

:class:`Stepper` is held by :class:`~pipeq.stage.executor.StageExecutor`, which forwards its
public step methods to it. A step runs one of two ways: :meth:`~Stepper.step` when the stages
need not agree first, or :meth:`~Stepper.stats` then :meth:`~Stepper.apply` with the statistics
every stage combined (see :mod:`pipeq.stage.numerics`). A stage may train with several
optimizers (AL's two paths: :meth:`~Stepper.add`); they step in the order they were added, each
followed by its scheduler, and the first one's parameters are the ones the replicas all-reduce
and the global norm counts.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pipeq.stage import lr_schedulers
from pipeq.stage.memory import local
from pipeq.stage.numerics import LossScaler, Numerics, StepStats, all_finite, clip_, norm_term, total_norm
from pipeq.stage.spec import StageSpec

__all__ = ["Stepper"]


class Stepper:
    """Stage ``index``'s optimizers and lr schedulers, its loss scaler, and how a step updates
    them (see the module). ``module``: the stage's, named in a non-finite gradient's error;
    ``tied``: its tied weights (:class:`~pipeq.stage.ties.TiedGrads`, or None)."""

    def __init__(self, index: int, module: nn.Module, device: torch.device, spec: StageSpec,
                 params: list[torch.Tensor], tied: Any = None) -> None:
        self.index = index
        self.module = module
        self.device = device
        self.tied = tied
        # stepped once per training step, right after its optimizer (every stage alike), or
        # (interval "epoch") by scheduler_step only
        self.interval = spec.lr_scheduler_interval
        self._pairs: list[tuple[torch.optim.Optimizer | None, Any]] = []
        self.add(spec, params)
        #: the stage's parallel layers (pipeq.parallel.layers.StageParallel: the reductions before
        #: the step, the statistics over the stage's processes), None for a stage of one process
        self.parallel: Any = None
        self.skipped_steps = 0  # steps skipped for non-finite gradients (fp16, check_finite='skip')
        self.set_numerics(Numerics())
        self._backwards = 0  # this step's so far
        self._expected = 0  # this step's backwards, all told
        self._synced = False  # this step's gradients are summed over the replicas

    def add(self, spec: StageSpec, params: list[torch.Tensor]) -> None:
        """Train ``params`` with another of ``spec``'s optimizers and its lr scheduler, stepped after
        the ones before (none when there is nothing to train)."""
        optimizer = spec.optimizer(params) if params else None
        scheduler = spec.lr_scheduler(optimizer) if spec.lr_scheduler is not None and optimizer is not None else None
        if scheduler is not None and spec.lr_scheduler_interval == "step" and lr_schedulers.takes_metric(scheduler):
            raise ValueError(f"lr_scheduler built a ReduceLROnPlateau: {lr_schedulers.NEEDS_METRIC}")
        self._pairs.append((optimizer, scheduler))

    def set_numerics(self, numerics: Numerics) -> None:
        """The run's clipping, checks and loss scaling (a fresh scaler for fp16)."""
        self.numerics = numerics
        self.scaler = LossScaler(self.device) if numerics.scales_loss else None

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The first optimizer (None without trainable parameters)."""
        return self._pairs[0][0]

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` as the backward starts from it: times the loss scale (fp16), else itself."""
        return loss * self.scaler.scale if self.scaler is not None else loss

    # -- a step's course ---------------------------------------------------------------------------
    def begin(self, training: bool, backwards: int) -> None:
        """Start a step of ``backwards`` backwards: the gradients cleared (training)."""
        if training:
            self.zero_grad()
        self._backwards = 0
        self._expected = backwards
        self._synced = False

    def zero_grad(self) -> None:
        """Every optimizer's gradients set to None."""
        for optimizer in self.optimizers():
            optimizer.zero_grad(set_to_none=True)

    def before_backward(self) -> None:
        """Called before each backward: before the step's last one, its reductions are armed (each
        bucket goes as soon as its gradients are final)."""
        if self.parallel is not None and self._backwards == self._expected - 1:
            self.parallel.arm()

    def backward_done(self) -> None:
        """Called after each backward: after the step's last one, the gradients' reductions start."""
        self._backwards += 1
        if self.parallel is not None and self._backwards == self._expected:
            self.parallel.start()

    def sync_replicas(self) -> None:
        """Reduce this step's gradients over the stage's other processes (shards, replicas), once per step."""
        if self.parallel is not None and not self._synced:
            self.parallel.finish()
        self._synced = True

    def params(self) -> list[torch.Tensor]:
        """The parameters the first optimizer updates, in its groups' order."""
        optimizer = self.optimizer
        return [p for g in optimizer.param_groups for p in g["params"]] if optimizer else []

    def step(self) -> None:
        """The step of a run whose stages need not agree first (see :meth:`stats`)."""
        self.sync_replicas()
        self._update()

    def _update(self) -> None:
        """Each optimizer's step, each followed by its scheduler's if it steps with it (interval "step")."""
        for optimizer, scheduler in self._pairs:
            if optimizer is not None:
                optimizer.step()
                if scheduler is not None and self.interval == "step":
                    scheduler.step()

    # -- steps the stages agree on (clipping, fp16, check_finite; see pipeq.stage.numerics) --------
    def _grads(self) -> list[torch.Tensor]:
        """This process's gradients (its pieces of a DTensor's)."""
        return [local(p.grad) for p in self.params() if p.grad is not None]

    def _norm_grads(self) -> tuple[list[torch.Tensor], list[float] | None]:
        """The gradients this stage counts in the global norm (its own, and the tied parameters it
        owns: each tied parameter counts once, as in one process), as this process's pieces, and
        the share of each piece's term it counts (None: whole)."""
        skip = self.tied.not_owned() if self.tied is not None else set()
        grads = [p.grad for p in self.params() if p.grad is not None and id(p) not in skip]
        weights = self.parallel.weighted(grads) if self.parallel is not None else None
        return [local(g) for g in grads], weights

    def stats(self) -> StepStats:
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
        term = norm_term(*self._norm_grads(), p) if self.numerics.clip_grad_norm is not None and not bad else 0.0
        mine = StepStats(term, float(self.index) if bad else math.inf)
        return self.parallel.combine(mine, p) if self.parallel is not None else mine

    def apply(self, total: StepStats, step: int) -> None:
        """Step ``step``'s optimizer step (or its skip) that every stage decides alike from ``total``."""
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
                    f"Inf after the backwards of step {step}; check_finite='raise' stopped the "
                    "run before any optimizer step")
            return  # that stage reports it; nobody steps
        if bad:
            self.skipped_steps += 1
            if self.interval == "step":  # a skipped step still counts for the schedule, as in a torch loop
                for scheduler in self.schedulers():
                    scheduler.step()
            return
        if nm.clip_grad_norm is not None:
            clip_(self._grads(), nm.clip_grad_norm, total_norm(total, nm.clip_norm_type))
        self._update()

    # -- learning-rate schedule --------------------------------------------------------------------
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """This stage's optimizers, in step order (none for a stage without trainable parameters)."""
        return [o for o, _ in self._pairs if o is not None]

    def schedulers(self) -> list[Any]:
        """This stage's lr schedulers (one per optimizer that has one), in step order."""
        return [s for _, s in self._pairs if s is not None]

    def scheduler_step(self, metric: float | None) -> None:
        """Step every scheduler once (``runner.scheduler_step``), with ``metric`` when it takes one
        (see :func:`pipeq.stage.lr_schedulers.step`)."""
        for scheduler in self.schedulers():
            lr_schedulers.step(scheduler, metric)

    def learning_rates(self) -> list[float]:
        """The learning rate of every parameter group of every optimizer, in order."""
        return [lr for opt in self.optimizers() for lr in lr_schedulers.group_rates(opt)]

    def learning_rate(self) -> float | None:
        """The first parameter group's learning rate, None without an optimizer."""
        rates = self.learning_rates()
        return rates[0] if rates else None
