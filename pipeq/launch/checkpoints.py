"""A launch's checkpoints: where --resume starts, one every checkpoint_every steps and at a stop, the final state."""

from __future__ import annotations

import os
from typing import Any, Callable

from pipeq import checkpoint
from pipeq.checkpoint.export import save_model
from pipeq import schedules
from pipeq.launch.job import Job
from pipeq.launch.progress import shown_epoch
from pipeq.launch.rundir import RunDir, checkpoint_step

__all__ = ["Checkpoints"]


class Checkpoints:
    """The job's checkpoints in its run directory: ``checkpoints/step-<n>/`` (the newest
    ``keep_checkpoints`` kept), ``final/`` and ``model.pt``. Each holds the step, the epoch and the
    batch index the next step starts at, and the job, schedule and microbatches it trained with."""

    def __init__(self, job: Job, run_dir: RunDir, log: Callable[[str], None]) -> None:
        self.job = job
        self.run_dir = run_dir
        self.log = log
        self.source = "start"  # where the last resume_point came from: "start", "disk" or "memory"

    def resume_point(self, runner: Any, resume: bool, memory: Any = None) -> tuple[int, int, int]:
        """(step, epoch, batch index in it) to start from: 0s, or (``resume``) the newest complete
        checkpoint's, loaded into ``runner``: of checkpoints/, or final/ (a finished run given
        more steps); or ``memory``'s, an in-memory snapshot and the position after its step
        (:class:`~pipeq.launch.snapshots.Snapshots`), when it is as new or newer (no disk read)."""
        self.source = "start"
        if not resume:
            return 0, 0, 0
        found = self.run_dir.newest_checkpoint()
        on_disk = checkpoint_step(found) if found is not None else None
        if memory is not None and (on_disk is None or memory[0].step >= on_disk):
            snap, (epoch, skip) = memory
            runner.restore_snapshot(snap)
            self.source = "memory"
            self.log(f"resumed from the in-memory snapshot of step {snap.step} (epoch {shown_epoch(epoch, skip)})")
            return snap.step, epoch, skip
        if found is None:
            self.log(f"--resume: no complete checkpoint under {self.run_dir.checkpoints}; starting fresh")
            return 0, 0, 0
        try:
            meta = runner.load(found)
        except checkpoint.DamagedCheckpointError as exc:  # said with what to do (never an older one by itself)
            raise checkpoint.DamagedCheckpointError(
                f"{exc}. {found} is the newest checkpoint, the one --resume (and a restart) loads: move it out of "
                f"{os.path.dirname(found)} and run again with --resume to continue from the one before it") from None
        self.source = "disk"
        step, epoch, skip = int(meta["step"]), int(meta["epoch"]), int(meta["batch"])
        self.log(f"resumed from {found} (step {step}, epoch {shown_epoch(epoch, skip)})")
        return step, epoch, skip

    def due(self, step: int) -> bool:
        """Whether ``step`` is one of the job's periodic checkpoints."""
        every = self.job.checkpoint_every
        return bool(every) and step % every == 0

    def save(self, runner: Any, step: int, pos: tuple[int, int]) -> str:
        """Checkpoint ``step`` (the next batch: ``pos``, (epoch, index)) into checkpoints/; its path."""
        directory = checkpoint.checkpoint_dir(self.run_dir.checkpoints, step)
        self._save(runner, directory, step, *pos)
        return directory

    def stopped(self, runner: Any, step: int, pos: tuple[int, int], start_step: int, signal_name: str) -> None:
        """A signal stopped training after ``step`` (every step sent is done, the state is
        consistent): checkpoint it, so that --resume continues with the next step."""
        how = f"stopped by {signal_name} after step {step}"
        if step == start_step:
            self.log(f"{how}, before training any step; nothing new to save")
            return
        directory = checkpoint.checkpoint_dir(self.run_dir.checkpoints, step)
        if not self.due(step):  # else just saved
            self.save(runner, step, pos)
        self.log(f"{how}; checkpoint {directory} written: pass --resume to continue from step {step + 1}")

    def write_final(self, runner: Any, step: int, pos: tuple[int, int], samples: int) -> None:
        """final/ (plus the last checkpoint), and model.pt: final/'s model state."""
        final = self.run_dir.final
        self._save(runner, final, step, *pos)
        if samples and self.job.checkpoint_every and not self.due(step):  # else just saved
            self.save(runner, step, pos)
        self.write_model()

    def write_model(self) -> None:
        """model.pt: final/'s model state (tied parameters under each of their names, as the model
        has them), crash-safe; a full disk raises a NoSpaceError saying final/ is intact."""
        save_model(self.run_dir.final, self.run_dir.model,
                   "Free some space and run again with --resume: it writes model.pt from the final state")

    def _save(self, runner: Any, directory: str, step: int, epoch: int, batch: int) -> None:
        schedule = self.job.schedule
        if isinstance(schedule, str) and schedule == "auto":  # the one the runner chose
            schedule = runner.schedule
        runner.save(directory, {"step": step, "epoch": epoch, "batch": batch, "job": self.job.path,
                                "schedule": schedules.schedule_name(schedule),
                                "schedule_options": schedules.options_of(schedule),
                                "microbatches": self.job.microbatches})
        if os.path.dirname(directory) == self.run_dir.checkpoints:
            checkpoint.prune(self.run_dir.checkpoints, self.job.keep_checkpoints)
