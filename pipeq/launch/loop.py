"""The training loop of ``pipeq launch``: each step's metrics line, evaluations, checkpoints and scheduler steps."""

from __future__ import annotations

from typing import Any, Callable

from pipeq.control.reports import memory_table
from pipeq.launch.checkpoints import Checkpoints
from pipeq.launch.data import Batches, EpochLosses, job_batches, total_steps
from pipeq.launch.evaluator import Evaluator
from pipeq.launch.job import Job
from pipeq.launch.metrics import MetricsLog
from pipeq.launch.progress import MovingRate, Progress, Tally
from pipeq.launch.rundir import RunDir
from pipeq.launch.signals import StopSignals
from pipeq.launch.snapshots import Snapshots
from pipeq.launch.stream import EpochEnd, StepDone, StepNumbers, segment_end, train_steps
from pipeq.launch.tensorboard import Board
from pipeq.stage.compiled import NO_COMPILE_FIGURES

__all__ = ["TrainingLoop"]


class TrainingLoop:
    """One launch's training on a started runner, from ``start`` (step, epoch, batch index in
    it: where a resumed run continues) to the job's last step, the end of its data, or a stop
    signal. Made before it runs: the metrics log trimmed to ``start``, the eval set resolved.
    Each metrics.jsonl line also goes to ``board`` (TensorBoard's event files; its owner closes it),
    and each step's samples and loss to ``run_tally`` too (the launch's, across restarts)."""

    def __init__(self, job: Job, runner: Any, start: tuple[int, int, int], *, run_dir: RunDir,
                 checkpoints: Checkpoints, signals: StopSignals, progress: Progress,
                 log: Callable[[str], None], snapshots: Snapshots | None = None, board: Board | None = None,
                 run_tally: Tally | None = None) -> None:
        step, epoch, skip = start
        self.job = job
        self.runner = runner
        self.checkpoints = checkpoints
        self.signals = signals
        self.progress = progress
        self.log = log
        self.start_step = self.step = self.arrived = step  # arrived: the newest step whose loss came
        self.pos = (epoch, skip)  # where the next batch comes from: (epoch, index in it)
        self.metrics = MetricsLog(run_dir.metrics)
        self.metrics.trim(step)
        self.evaluator = Evaluator(job)
        self.by_epoch = runner.lr_schedule.interval == "epoch"  # the schedulers step between epochs
        self.losses = EpochLosses(epoch, self.metrics.losses(epoch))
        self.total = total_steps(job)
        self.tally = Tally()  # this attempt's; run_tally: the launch's, every attempt's (restarts)
        self.run_tally = run_tally if run_tally is not None else self.tally
        self.rate = MovingRate()  # samples/s over the last steps (metrics.jsonl: samples_per_s_avg)
        self.progress.start(self.total, step)
        self.last_eval: dict[str, float] = {}
        self.last: dict[str, Any] | None = None  # the last step's line, written with the final evaluation
        self.snapshots = snapshots if snapshots is not None else Snapshots(0)
        self.snapshots.attach(runner, step)
        self.board = board if board is not None else Board(run_dir.tb)  # without a writer: writes nothing
        self._memory_at: int | None = step + 1  # the step after which every byte each stage holds is asked for
        self.numbers = StepNumbers(runner)  # the run's step of a step the stages name (a failure's message)

    def run(self) -> bool:
        """Train; True: to the end (the final state is due), False: a signal stopped it (its
        last step is checkpointed)."""
        with self.metrics:
            if self.total is not None and self.step >= self.total:
                self.log(f"already trained {self.step} of {self.total} steps; writing the final state")
            source = Batches(job_batches(self.job, *self.pos), self.pos[0])
            every = (self.evaluator.every, self.job.checkpoint_every)
            if self.runner.schedule.streams_across_batches:  # its snapshots wait for a drain
                every += (self.snapshots.every,)
                # and its memory figures too: asking waits for the steps in flight, a drain of its own
                # (where an uninterrupted run has none: a resumed one's weights would differ)
                self._memory_at = segment_end(self.step, self.total, every)
            for done in train_steps(self.runner, source, self.step, self.total, every, self.by_epoch, self.signals,
                                    self._arrived, self.numbers):
                if isinstance(done, EpochEnd):  # resumed at the end of an epoch: its step first
                    metric, _ = self.evaluator.epoch_metric(self.runner, done.epoch, None, self.losses)
                    self.runner.scheduler_step(metric)
                    self.pos = (done.next_epoch, 0)
                elif self._trained(done):
                    break
            if self.signals.stopping and self.last is None:  # stopped before the last step
                self.progress.close()
                self.checkpoints.stopped(self.runner, self.step, self.pos, self.start_step, self.signals.name())
                return False
            self._finish()
        self.progress.close()
        return True

    def _arrived(self, step: int) -> None:
        self.arrived = step

    def _trained(self, done: StepDone) -> bool:
        """After step ``done``: its evaluation, checkpoint, line and (at an epoch's end) the
        schedulers' step. True: it was the last step (its line waits for the final evaluation)."""
        self.step, self.pos = done.step, (done.epoch, done.batch + 1)
        self.tally.add(done.size, done.loss)
        if self.run_tally is not self.tally:
            self.run_tally.add(done.size, done.loss)
        self.losses.add(done.epoch, done.loss)
        line = done.line()
        average = self.rate.add(done.size, done.seconds)
        if average is not None:
            line["samples_per_s_avg"] = average
        final = self.total is not None and self.step >= self.total
        evaluated = None
        # train_steps ends a segment at these steps: the state is this step's
        if self.evaluator.due(self.step) and not final and not self.signals.stopping:
            self.last_eval = evaluated = self.evaluator.run(self.runner)
            line.update(self.last_eval)
        metric = None
        if done.next_epoch is not None:  # (a segment's end too) the metric the schedulers get
            metric, evaluated = self.evaluator.epoch_metric(self.runner, done.epoch, evaluated, self.losses)
            if evaluated is not None:
                self.last_eval = evaluated
                line.update(evaluated)
        if self.checkpoints.due(self.step):
            # at an epoch's end: before its schedulers' step (a resumed run takes it, see EpochEnd)
            self.checkpoints.save(self.runner, self.step, self.pos)
        self.snapshots.finished(self.runner, self.step, self.pos)
        if self.step == self._memory_at:  # the launch's first step (or first drain): every byte each stage holds
            try:
                line["memory"] = self._memory_figures()
            except BaseException:  # asking waits for the steps in flight: a stage failed meanwhile
                self._write(line)  # (a restart follows) and this step, done, keeps its line
                raise
        if final:  # its line is written by _finish, with the final evaluation
            self.last = line
            return True
        self._write(line)
        self.progress.report(line)
        if done.next_epoch is not None:
            self.runner.scheduler_step(metric)
            self.pos = (done.next_epoch, 0)  # a checkpoint from here on holds the step taken
        return False

    def _finish(self) -> None:
        """The final evaluation, and the last step's line with it."""
        if self.step == 0:
            raise ValueError(f"the job's data ({self.job.data}) yielded no batch")
        if self.evaluator.batches is not None:
            self.last_eval = self.evaluator.run(self.runner)
            if self.last is None and self.tally.samples:  # data ran out before a step count: a line of its own
                self.last = {"step": self.step, "epoch": self.pos[0]}
        compiled = self._compile_figures()
        if self.last is not None:
            self.last.update(self.last_eval)
            if compiled is not None:
                self.last["compile"] = compiled
            self._write(self.last)
            if "loss" in self.last:
                self.progress.report(self.last)

    def _compile_figures(self) -> list[dict[str, Any]] | None:
        """With ``compile``: each stage's compile figures (``runner.stats()``), logged, for the last
        step's metrics.jsonl line; None without."""
        if self.job.compile is False:
            return None
        figures = [{k: s[k] for k in NO_COMPILE_FIGURES} for s in self.runner.stats()]
        self.log("compiled stages: " + "; ".join(
            f"stage {k}: {f['compile_s']:.1f} s compiling, {f['compiles']} graph(s), {f['recompiles']} recompile(s), "
            f"{f['compile_cache_hits']} cache hit(s)" for k, f in enumerate(figures)))
        return figures

    def _memory_figures(self) -> list[dict[str, Any]]:
        """Each stage's bytes after the first step (``runner.memory()``), logged as a table, for that
        step's metrics.jsonl line (its ``memory``: one dict per stage and replica)."""
        rows = self.runner.memory()
        self.log(memory_table(rows))
        return [r.as_dict() for r in rows]

    def _write(self, line: dict[str, Any]) -> None:
        """A step's line, to metrics.jsonl and TensorBoard's pending scalars."""
        self.metrics.write(line)
        self.board.record(line)
