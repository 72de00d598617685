"""The driver of ``pipeq launch``: the run directory claimed, the stages started and trained, failures as exit codes."""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any, Sequence, TextIO

from pipeq import checkpoint
from pipeq.control import rendezvous as rdzv
from pipeq.errors import PipelineError
from pipeq.checkpoint.full import is_no_space
from pipeq.launch.checkpoints import Checkpoints
from pipeq.launch.data import DataError, check_first_batch, total_steps
from pipeq.launch.elastic import GIVE_UP, REPLACE, Decision, Elastic
from pipeq.launch.job import Job
from pipeq.launch.loop import TrainingLoop
from pipeq.launch.progress import Progress, Tally, print_summary
from pipeq.launch.restarts import Restarts
from pipeq.launch.rundir import RunDir, RunDirError, checkpoint_step
from pipeq.launch.signals import StopSignals
from pipeq.launch.snapshots import Snapshots
from pipeq.launch.tensorboard import Board, stage_times, writer_class
from pipeq.runtime import faults

__all__ = ["Trainer"]


class Trainer:
    """The driver side of ``pipeq launch``: the training loop, checkpoints, metrics, summary."""

    def __init__(self, job: Job, rz: rdzv.Rendezvous | None, *, resume: bool = False, overwrite: bool = False,
                 quiet: bool = False, stream: TextIO | None = None, signals: StopSignals | None = None) -> None:
        self.job = job
        self.rz = rz
        self.resume = resume
        self.overwrite = overwrite
        self.signals = signals or StopSignals()
        self.quiet = quiet
        self.stream = stream or sys.stderr
        self.out = os.path.abspath(job.out)
        self.run_dir = RunDir(self.out)
        self.checkpoints = Checkpoints(job, self.run_dir, self.log)
        self._loop: TrainingLoop | None = None  # the running attempt's loop (its step: where a failure hit)
        self._restarts: Restarts | None = None
        self._recipe: Any = None  # the job's recipe, its stages made once (Recipe.stages_made)
        self.snapshots = Snapshots(job.snapshot_every)  # outlives each attempt's runner
        self._writer: Any = None  # TensorBoard's SummaryWriter class (None: no event files), found by _run
        self._board = Board(self.run_dir.tb)  # each attempt's event files (this one: none)
        self._tally: Tally | None = None  # the launch's samples, losses and time: every attempt's

    def log(self, line: str) -> None:
        print(f"pipeq launch: {line}", file=self.stream, flush=True)

    # -- the command ---------------------------------------------------------------------
    def run(self) -> int:
        """Claim the output directory, train, release it: the exit code (0 = ok, 1 = a failure,
        2 = refused before anything started, 128 + a signal's number = stopped by it)."""
        try:
            gone = self.run_dir.claim(resume=self.resume, overwrite=self.overwrite)
        except RunDirError as exc:
            self.log(str(exc))
            return 2
        except OSError as exc:
            self.log(f"cannot use --out {self.out}: {exc}")
            return 2
        try:
            if gone:
                self.log(f"--overwrite: deleted the previous run's {', '.join(gone)} in {self.out}")
            done = self._finished()
            if done is not None:
                self.log(done)
                return self._model_file()
            return self._run()
        finally:
            self.run_dir.release()

    def _finished(self) -> str | None:
        """--resume of a run whose final state already holds the job's last step (one host): what
        to say instead of starting the stages. None: there is more to train, or the job's length
        is only known as it trains (a generator's epochs), or other nodes wait for this one."""
        if not self.resume or self.rz is not None:
            return None
        final_step = checkpoint_step(self.run_dir.final)
        newest = self.run_dir.newest_checkpoint()
        if final_step is None or newest is None or checkpoint_step(newest) != final_step:
            return None
        try:
            total = total_steps(self.job)
        except Exception:  # the data's own error: said where the run checks its data
            return None
        if total is None or final_step < total:
            return None
        return (f"--resume: this run already trained all {total} steps of the job (its final state is "
                f"step {final_step}); no new step, no stage started. Pass a larger --steps or --epochs to "
                "train it further")

    def _model_file(self) -> int:
        """A finished run's model.pt, written from its final state when it is missing or older
        than it (the disk filled as the run wrote it): the exit code."""
        model, final = self.run_dir.model, os.path.join(self.run_dir.final, checkpoint.MANIFEST)
        try:
            if os.path.getmtime(model) >= os.path.getmtime(final):
                return 0
            why = "it was older than the final state"
        except FileNotFoundError:
            why = "it was missing"
        try:
            self.checkpoints.write_model()
        except checkpoint.NoSpaceError as exc:
            self.log(str(exc))
            return 1
        self.log(f"wrote {model} from the final state {self.run_dir.final} ({why})")
        return 0

    def _runner(self) -> Any:
        """The job's PipelineRunner, not started yet (a ``ValueError`` names what is wrong)."""
        from pipeq.control.runner import PipelineRunner

        from pipeq import compat

        job = self.job
        job.check()  # data, eval_data, metrics and their arguments, before any process starts
        compat.check(job.run_config(), multi_host=self.rz is not None)  # the settings alone: before data is read
        if self._recipe is None:  # made once per run: a restart's stages are the very same
            check_first_batch(job)
            self._recipe = job.recipe.stages_made()
        runner = PipelineRunner(self._recipe, None, None, config=job.run_config(), rendezvous=self.rz)
        faults.from_environ(runner.n_stages, replicas=job.data_parallel)  # a fault that would never fire: refused
        if job.lr_scheduler_monitor is not None and not runner.lr_schedule.takes_metric:
            raise ValueError(f"lr_scheduler_monitor = {job.lr_scheduler_monitor!r}, but {job.recipe.lr_scheduler} "
                             "takes no metric (only a ReduceLROnPlateau does): drop lr_scheduler_monitor")
        return runner

    def _run(self) -> int:
        """Train; with ``max_restarts``, a stage failure restarts from the newest checkpoint (multi-host:
        after the nodes regroup, see :mod:`pipeq.launch.elastic`)."""
        restarts = Restarts(self.job.max_restarts, self.run_dir.metrics, self.log)
        try:
            self._writer = writer_class(self.job.tensorboard, self.log)  # tensorboard = true: installed, or refused
            elastic = Elastic.of(self.job, self.rz, self.log)
        except ValueError as exc:
            self.log(str(exc))
            return 2
        if elastic is not None:
            try:
                elastic.open()
            except RuntimeError as exc:  # the rendezvous store cannot be hosted (its port in use)
                self.log(str(exc))
                return 1
        code = 1
        try:
            while True:
                if elastic is not None:
                    self.rz = elastic.rendezvous()
                self._board = Board(self.run_dir.tb, self._writer, self.log)
                try:
                    code, failure = self._attempt(restarts)
                finally:  # a failed attempt's too: its writer's thread ends
                    self._board.close()
                if failure is None or not self._restart(failure, restarts, elastic):
                    return code
                self.resume = True
        finally:  # however the launch ends (given up, regroup refused, an error): a restart pending is on record
            restarts.ended(code)
            if elastic is not None:
                elastic.close()

    def _restart(self, failure: PipelineError, restarts: Restarts, elastic: Elastic | None) -> bool:
        """Whether the run starts again after ``failure``. Multi-host, while a restart is left,
        the nodes regroup first: a start in which a node was lost failed from outside, and is
        never "the same step failed twice" (:meth:`Restarts.again`)."""
        failed_at, step = time.monotonic(), self._failed_step()
        if elastic is None or not restarts.left:
            return restarts.again(failure, step, failed_at=failed_at)
        decision = self._regroup(elastic)
        lost = list(decision.lost or decision.rejoined)
        if not restarts.again(failure, step, lost, start=decision.action != GIVE_UP, failed_at=failed_at):
            return False
        # (a run given up is on record too: the nodes left, and the ones lost)
        restarts.note(nodes=len(decision.nodes), lost_nodes=lost, rejoined=list(decision.rejoined),
                      replaced=decision.action == REPLACE)
        return decision.action != GIVE_UP

    def _regroup(self, elastic: Elastic) -> Decision:
        """Multi-host: wait for the nodes to say they are there for the restart (:meth:`Elastic.regroup`)."""
        # the processes each node leads (only to name the stages re-placed in the log)
        runner = self._loop.runner if self._loop is not None else None
        place = None
        if runner is not None:  # whole processes (several stages each, with virtual stages) per node
            from pipeq.control.processes import Numbering, place_leads

            num = Numbering(runner.n_stages, self.job.data_parallel, runner.tensor_parallel)
            nnodes, schedule, nodes = elastic.rz.nnodes, runner.schedule, self.job.placement

            def place(alive: Sequence[int] | None) -> list[list[int]]:
                return place_leads(num, schedule, nnodes, alive, nodes)
        return elastic.regroup(place=place)

    def _failed_step(self) -> int:
        """The first step the failed attempt did not finish: the one after the newest whose loss
        came; an attempt that failed as its stages started, the one it would have started with."""
        loop = self._loop
        if loop is not None:
            return loop.arrived + 1
        if not self.resume:
            return 1
        newest, memory = self.run_dir.newest_checkpoint(), self.snapshots.newest()
        on_disk = checkpoint_step(newest) if newest is not None else None
        return max(on_disk or 0, memory[0].step if memory is not None else 0) + 1

    def _attempt(self, restarts: "Restarts") -> tuple[int, PipelineError | None]:
        """One start of the stages and their training: the exit code, and the failure (if a stage failed)."""
        self._loop = None
        self._restarts = restarts
        try:
            runner = self._runner()
        except ValueError as exc:
            self.log(str(exc))
            return 2, None
        try:
            self.log(f"starting {self._processes(runner)}...")
            t0 = time.perf_counter()
            with runner:
                self.log(f"stages ready in {time.perf_counter() - t0:.1f} s")
                self.signals.graceful = True
                try:
                    self.train(runner)
                finally:
                    self.signals.graceful = False
            self._stage_times()  # the runner wrote its trace as it stopped
        except PipelineError as exc:
            if self._loop is not None:  # the snapshots that had arrived, for a restart
                self.snapshots.adopt(runner, self._loop.step)
                exc = self._run_steps(exc, self._loop.numbers)
            where = f"stage {exc.stage}" if exc.stage is not None else "the pipeline"
            self.log(f"{where} failed: {exc.message}")
            if exc.remote_traceback:
                print(f"--- traceback of {where} ---\n{exc.remote_traceback.rstrip()}",
                      file=self.stream, flush=True)
            return 1, exc
        except KeyboardInterrupt:
            self.log(f"interrupted by {self.signals.name()}; every stage is stopped (the steps in flight "
                     "were abandoned; --resume continues from the newest checkpoint)")
            return self.signals.exit_code(), None
        except checkpoint.NoSpaceError as exc:  # said in full: no traceback adds to it
            newest = checkpoint.latest(self.run_dir.checkpoints)
            then = newest is not None and exc.path != self.run_dir.model  # model.pt's error says what --resume does
            self.log(f"{exc}" + (f"; --resume continues from {newest}" if then else ""))
            return 1, None
        except DataError as exc:  # (a generator's batch) said in full: no traceback adds to it
            self.log(str(exc))
            return 1, None
        except checkpoint.CheckpointError as exc:  # names the file and what to do: no traceback adds to it
            self.log(f"CheckpointError: {exc}")
            return 1, None
        except (ValueError, TypeError, OSError) as exc:
            self.log(f"{type(exc).__name__}: {exc}")
            if is_no_space(exc):  # said plainly: the write that failed, and where --resume goes on
                newest = checkpoint.latest(self.run_dir.checkpoints)
                self.log(f"the disk of {self.run_dir.out} is full; free some space and run again with --resume"
                         + (f" (it continues from {newest})" if newest is not None else ""))
            else:
                traceback.print_exc(file=self.stream)
            return 1, None
        if self.signals.stopping:
            return self.signals.exit_code(), None
        return 0, None

    @staticmethod
    def _run_steps(exc: PipelineError, numbers: Any) -> PipelineError:
        """``exc`` naming the run's steps, where the stages named their runner's (from 1 in each
        start, evaluations' batches counted: :class:`~pipeq.launch.stream.StepNumbers`); the
        traceback's own lines (indented: the code) are left as they are."""
        tb = exc.remote_traceback
        if tb is not None:
            tb = "".join(ln if ln[:1].isspace() else numbers.rewrite(ln) for ln in tb.splitlines(keepends=True))
        return PipelineError(numbers.rewrite(exc.message), exc.stage, tb, replica=exc.replica, shard=exc.shard)

    def _stage_times(self) -> None:
        """With ``trace`` and TensorBoard: each stage's busy time and bubble in each step this
        attempt trained, from its trace (:func:`pipeq.launch.tensorboard.stage_times`)."""
        loop = self._loop
        if not self.job.trace or not self._board.active or loop is None or loop.step <= loop.start_step:
            return
        try:
            self._board.scalars(stage_times(self.job.trace, loop.step))
        except (OSError, ValueError) as exc:  # the run itself went well: only these scalars are missing
            self.log(f"TensorBoard: no stage times from the trace {self.job.trace}: {exc}")

    def _processes(self, runner: Any) -> str:
        """What the runner starts: "3 stages", or "12 stage processes (3 stages x 2 replicas x 2 shards)"."""
        n, dp, tp = runner.n_stages, self.job.data_parallel, self.job.tensor_parallel
        if dp * tp == 1:
            return f"{n} stage{'s' if n != 1 else ''}"
        parts = [f"{n} stages"] + ([f"{dp} replicas"] if dp > 1 else []) + ([f"{tp} shards"] if tp > 1 else [])
        return f"{n * dp * tp} stage processes ({' x '.join(parts)})"

    def train(self, runner: Any) -> None:
        """Train the job on ``runner`` (its stages started), from the start or (--resume) the
        newest checkpoint; then write final/ and model.pt, and print the summary. A stop signal
        ends it early, its last step checkpointed (see :class:`~pipeq.launch.signals.StopSignals`)."""
        os.makedirs(self.out, exist_ok=True)
        progress = Progress(quiet=self.quiet, stream=self.stream, log_every=self.job.log_every, log=self.log)
        progress.restarts = self._restarts.count if self._restarts is not None else 0
        start = self.checkpoints.resume_point(runner, self.resume, self.snapshots.newest())
        self._board.start(start[0])
        if self._tally is None:  # the first attempt's training starts: the summary's time counts from here
            self._tally = Tally()
        loop = self._loop = TrainingLoop(self.job, runner, start, run_dir=self.run_dir, checkpoints=self.checkpoints,
                                         signals=self.signals, progress=progress, log=self.log,
                                         snapshots=self.snapshots, board=self._board, run_tally=self._tally)
        if self._restarts is not None:
            restart = self._restarts.resumed(loop.step, self.checkpoints.source)
            if restart is not None:
                self._board.record(restart)
        try:
            finished = loop.run()
        except BaseException:
            progress.close()  # the failure's lines below a finished bar, not through it
            raise
        if not finished:
            return
        elapsed = self._tally.elapsed()
        self.checkpoints.write_final(runner, loop.step, loop.pos, loop.tally.samples)
        nnodes = (len(self.rz.nodes) if self.rz.nodes else self.rz.nnodes) if self.rz is not None else None
        print_summary(self.job, self.run_dir, loop.step, runner.n_stages, nnodes, self._tally, loop.last_eval, elapsed,
                      tensorboard=self._board.active, restarts=progress.restarts)
