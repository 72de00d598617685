"""A launch's evaluations: every eval_every steps, at the end, and the metric the schedulers get after an epoch."""

from __future__ import annotations

from typing import Any

from pipeq.launch.data import EpochLosses
from pipeq.launch.job import Job

__all__ = ["Evaluator"]


class Evaluator:
    """The job's eval set and metrics (resolved when made), run on the runner as metrics.jsonl
    names the values: eval_loss (the job's loss; with Associated Learning the cross-entropy of
    predict's class scores), eval_accuracy (classification) and eval_NAME for each metric."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.batches = job.eval_batches()  # None: the job has no eval_data
        self.every = job.eval_every if self.batches is not None else 0
        self.metric_fns = job.metric_fns()

    def due(self, step: int) -> bool:
        """Whether ``step`` is one of the job's periodic evaluations."""
        return bool(self.every) and step % self.every == 0

    def run(self, runner: Any) -> dict[str, float]:
        """``runner.evaluate`` over the eval set (the job has one), its values named eval_*."""
        return {f"eval_{name}": value for name, value in runner.evaluate(self.batches, self.metric_fns).items()}

    def epoch_metric(self, runner: Any, epoch: int, evaluated: dict[str, float] | None,
                     losses: EpochLosses) -> tuple[float | None, dict[str, float] | None]:
        """At the end of ``epoch``: what the schedulers are stepped with (None unless they take a
        metric: a ReduceLROnPlateau gets the job's monitor), and the evaluation this took (the
        one ``evaluated`` at this step already, or a new one; None without)."""
        if not runner.lr_schedule.takes_metric:
            return None, evaluated
        monitor = self.job.monitor()
        if monitor == "train_loss":
            return losses.mean(epoch), evaluated
        if evaluated is None and self.batches is not None:
            evaluated = self.run(runner)
        if evaluated is None or monitor not in evaluated:
            measured = sorted(evaluated or {}) + ["train_loss"]
            raise ValueError(f"lr_scheduler_monitor = {monitor!r}, but the run measures {measured}")
        return evaluated[monitor], evaluated
