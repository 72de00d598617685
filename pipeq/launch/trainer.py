"""``pipeq launch JOB.toml``: train a job file, on one host or several.

On one host (the default) this process is the driver and starts every stage. In a multi-host run
(``--nnodes``/``--node-rank``/``--master-addr``/``--master-port``, or torchrun's / srun's
environment) node 0 is the driver and every other node runs an agent that starts its stages::

    anywhere: pipeq secret --out job.secret          # then copy it to every host (mode 0600)
    host A: pipeq launch job.toml --nnodes 2 --node-rank 0 --master-addr A --secret-file job.secret
    host B: pipeq launch job.toml --nnodes 2 --node-rank 1 --master-addr A --secret-file job.secret

(``PIPEQ_SECRET`` in the environment instead of ``--secret-file``). Node 0 runs the driver and
stage 0, node 1 stages 1 and 2; nothing without the secret can join or redirect the run.

The driver trains for the job's steps or epochs with ``runner.stream`` (the pipeline stays full
across batches; it drains only before an evaluation, a checkpoint and the end), shows progress
(tqdm; ``--quiet`` logs plain lines), checkpoints every ``--checkpoint-every`` steps
(``--resume`` continues from the newest complete one), and writes into the output directory::

    checkpoints/step-00000020/   manifest.json + stage-<k>.pt (global names; loads into any split)
    final/                       the same, for the final state
    model.pt                     the final parameters and buffers, a plain state_dict of the
                                 flat model nn.Sequential(*layers) (global names)
    metrics.jsonl                one JSON line per step: step, epoch, loss, samples_per_s, lr (the
                                 learning rate the step trained with), and eval_loss /
                                 eval_accuracy / eval_NAME (the job's metrics) where evaluated

With ``lr_scheduler_interval = "epoch"`` the stream also drains at the end of each epoch that
another follows, and the schedulers step there (``runner.scheduler_step``), before the next
epoch's first batch: a ReduceLROnPlateau with the job's ``lr_scheduler_monitor`` (evaluated then,
or the mean of the epoch's step losses). An epoch is one pass over ``data(epoch)``, also in a job
that counts steps. A checkpoint at an epoch's last step holds the state before that step of the
schedulers; a run resumed from it takes it first (:class:`EpochEnd`).

Runs with auxiliary heads (interlocking) or Associated Learning cannot be checkpointed yet: such
a job with ``checkpoint_every`` > 0 or ``--resume`` is refused, and at the end it writes model.pt
(``runner.state_dict()``, under the same flat-model names: the main path, or the AL layers) but
no final/.

A failing stage ends the command with exit code 1 and that stage's traceback.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import errno
import fcntl
import itertools
import json
import math
import os
import re
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Iterator, TextIO

import torch

from pipeq import checkpoint
from pipeq.control.config import RunConfig
from pipeq import schedules
from pipeq.control import rendezvous as rdzv
from pipeq.errors import PipelineError
from pipeq.launch.job import LENGTH_RULE, Job, load_job

METRICS = "metrics.jsonl"
LOCK = ".lock"
#: What a run leaves in its output directory (and the leftovers of its interrupted writes).
RUN_FILES = re.compile(r"metrics\.jsonl(\.tmp)?|model\.pt(\.tmp)?|checkpoints|final|\.final\.(old|[0-9a-f]{16}\.tmp)")

EPILOG = (
    f"Length: {LENGTH_RULE}. "
    "Output directory: it belongs to one run. Launching into an --out that holds another run's files "
    "is refused (nothing in it changes) unless --resume continues that run or --overwrite deletes its "
    "files first; a second launch into a directory in use is refused (OUT/.lock). "
    "SIGINT (Ctrl-C) or SIGTERM: the steps already sent finish, a checkpoint of the last one is "
    "written, every stage stops, and the command exits with 130 / 143; --resume continues from that "
    "step. A second signal abandons the steps in flight (the last checkpoint stays)."
)


@dataclass
class StepDone:
    """One trained batch, as the stream hands it back."""

    step: int
    epoch: int
    batch: int  # its index in the epoch
    size: int  # samples
    loss: float
    seconds: float  # wall time since the previous loss (see Trainer._stream)
    lr: float | None = None  # the learning rate it trained with (runner.last_step_lr)
    # lr_scheduler_interval "epoch": the last step of an epoch that another follows (that epoch's
    # number); the schedulers step after it, before the next epoch's first batch
    next_epoch: int | None = None


@dataclass
class EpochEnd:
    """A resumed run starts at the end of ``epoch`` (its checkpoint was written before the
    schedulers stepped for it): they step before ``next_epoch``'s first batch."""

    epoch: int
    next_epoch: int


class Batches:
    """The job's batches in order, as (epoch, index in it, batch) triples, with a look at the next
    one: an epoch ends where the next triple belongs to another epoch."""

    def __init__(self, items: Iterator[tuple[int, int, Any]], epoch: int) -> None:
        self._items = items
        self._next: tuple[int, int, Any] | None = None
        self._peeked = False
        self.epoch = epoch  # the epoch under way: the last triple's (at first, the resumed one)

    def peek(self) -> tuple[int, int, Any] | None:
        if not self._peeked:
            self._next = next(self._items, None)
            self._peeked = True
        return self._next

    def take(self) -> tuple[int, int, Any] | None:
        item = self.peek()
        self._next, self._peeked = None, False
        if item is not None:
            self.epoch = item[0]
        return item

    def next_epoch(self) -> int | None:
        """The epoch whose first batch comes next, when the one under way is done (None: it goes
        on, or the data is done)."""
        item = self.peek()
        return item[0] if item is not None and item[0] != self.epoch else None

    def enter(self, epoch: int) -> None:
        """The schedulers stepped for the epoch under way: ``epoch`` is under way now."""
        self.epoch = epoch


class EpochLosses:
    """The step losses of the epoch under way: its ``train_loss`` (their mean), which a
    ReduceLROnPlateau may monitor. A resumed run starts from the ones metrics.jsonl holds."""

    def __init__(self, epoch: int, losses: list[float]) -> None:
        self.epoch = epoch
        self.losses = list(losses)

    def add(self, epoch: int, loss: float) -> None:
        if epoch != self.epoch:
            self.epoch, self.losses = epoch, []
        self.losses.append(loss)

    def mean(self, epoch: int) -> float:
        if epoch != self.epoch or not self.losses:
            raise ValueError(f"lr_scheduler_monitor = 'train_loss': no step loss of epoch {epoch} to average")
        return sum(self.losses) / len(self.losses)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    p.add_argument("job", help="the job file (TOML)")
    g = p.add_argument_group("training (override the job file's keys)")
    length = g.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="optimizer steps to train (replaces the file's steps or epochs)")
    length.add_argument("--epochs", type=int, help="passes over the job's data (replaces the file's steps or epochs)")
    g.add_argument("--schedule", help="schedule name, e.g. 1f1b or pairwise (replaces the job's schedule "
                   "table; options need the table)")
    g.add_argument("--microbatches", type=int)
    g.add_argument("--out", help="output directory")
    g.add_argument("--seed", type=int, help="seed of the stages' initial weights")
    g.add_argument("--checkpoint-every", type=int, metavar="N", help="checkpoint every N steps (0: never)")
    g.add_argument("--keep-checkpoints", type=int, metavar="K", help="keep the newest K checkpoints (0: all)")
    g.add_argument("--eval-every", type=int, metavar="N", help="evaluate every N steps (0: at the end)")
    g.add_argument("--threads-per-stage", type=int)
    g.add_argument("--data-parallel", type=int, metavar="R", help="R replicas of the pipeline, gradients all-reduced")
    g.add_argument("--tensor-parallel", type=int, metavar="T",
                   help="each stage split over T processes of one host, as the job's tp_plan says")
    g.add_argument("--heartbeat-timeout", type=float, help="seconds of silence before a stage is failed")
    g.add_argument("--trace", metavar="PATH", help="write a Chrome trace of every stage's actions "
                   "(read it with pipeq report PATH)")
    g.add_argument("--start-timeout", type=float, help="seconds to wait for every stage (and node) to start")
    run_dir = p.add_mutually_exclusive_group()
    run_dir.add_argument("--resume", action="store_true",
                         help="continue the run in --out from its newest complete checkpoint")
    run_dir.add_argument("--overwrite", action="store_true",
                         help="delete the files of the run in --out (metrics, checkpoints, final/, model.pt) "
                              "and start a new one there")
    p.add_argument("--quiet", action="store_true", help="plain log lines instead of a progress bar")
    m = p.add_argument_group("multi-host (default: torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, "
                             "or SLURM_PROCID/SLURM_NTASKS)")
    m.add_argument("--nnodes", type=int, help="number of pipeq nodes (node 0 runs the driver)")
    m.add_argument("--node-rank", type=int, help="this node's rank")
    m.add_argument("--master-addr", help="node 0's address (the rendezvous store)")
    m.add_argument("--master-port", type=int, help=f"the rendezvous store's port (default {rdzv.DEFAULT_PORT})")
    m.add_argument("--bind", help="address or interface this node's processes bind to (default: "
                                  "the one that routes to the master address)")
    m.add_argument("--run-id", help="keeps concurrent runs on one store apart")
    m.add_argument("--secret-file", metavar="PATH",
                   help="the job's secret, the same on every node, in a file only its owner may read "
                        "(make one with `pipeq secret --out PATH`); default: $PIPEQ_SECRET. A multi-host "
                        "run refuses to start without one; a single-host run makes its own")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("steps", "epochs", "schedule", "microbatches", "out", "seed", "checkpoint_every",
            "keep_checkpoints", "eval_every", "threads_per_stage", "heartbeat_timeout", "start_timeout", "trace", "data_parallel",
            "tensor_parallel")
    return {k: getattr(args, k) for k in keys}


def run(args: argparse.Namespace) -> int:
    signals = StopSignals()
    with signals.installed():
        try:
            return _run(args, signals)
        except KeyboardInterrupt:
            print(f"pipeq launch: interrupted by {signals.name()}", file=sys.stderr, flush=True)
            return signals.exit_code()


def _run(args: argparse.Namespace, signals: "StopSignals") -> int:
    try:
        job = load_job(args.job, _overrides(args))
        rz = rdzv.from_settings(args.nnodes, args.node_rank, args.master_addr, args.master_port,
                                args.bind, args.run_id, secret_file=args.secret_file)
    except ValueError as exc:
        print(f"pipeq launch: {exc}", file=sys.stderr)
        return 2
    if rz is not None and rz.node_rank != 0:
        return _run_agent(job, rz)
    return Trainer(job, rz, resume=args.resume, overwrite=getattr(args, "overwrite", False), quiet=args.quiet,
                   signals=signals).run()


def _run_agent(job: Job, rz: rdzv.Rendezvous) -> int:
    from pipeq.launch.agent import AgentError, run_agent
    from pipeq.control.processes import StageSettings

    def log(line: str) -> None:
        print(f"pipeq launch: {line}", file=sys.stderr, flush=True)

    try:
        n = job.recipe.count_stages()
        tp_plans = None
        if job.tensor_parallel > 1:
            from pipeq.parallel import tensor as tensorpar

            tp_plans = tensorpar.check_plans(None, job.tp_plan, job.tensor_parallel, n)
        config = RunConfig.from_kwargs(job.schedule, job.microbatches, threads_per_stage=job.threads_per_stage,
                                       max_message_mb=job.max_message_mb, tensor_parallel=job.tensor_parallel,
                                       **job.numerics_args())
        settings = StageSettings.of(config, config.numerics_for(n), tp_plans)
        return run_agent(rz, job.recipe, n, job.schedule, settings, heartbeat_timeout=job.heartbeat_timeout,
                         start_timeout=job.start_timeout, log=log, data_parallel=job.data_parallel)
    except (AgentError, RuntimeError, ValueError) as exc:
        log(str(exc))
        return 1


def _samples(x: Any) -> int:
    """The samples of a batch's x: dim 0 of a tensor, or of the first tensor of a tuple / dict
    (a batch that is not one the runner checks and refuses, naming what is wrong)."""
    from pipeq.tree import tensors_of

    tensors = [x] if isinstance(x, torch.Tensor) else tensors_of(x) if isinstance(x, (tuple, list, dict)) else []
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() > 0 else 0


def _checkpoint_step(directory: str) -> int | None:
    """The step in a complete checkpoint's manifest (None: none there, or unreadable)."""
    try:
        with open(os.path.join(directory, checkpoint.MANIFEST)) as f:
            return int(json.load(f)["meta"]["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class StopSignals:
    """SIGINT and SIGTERM while ``pipeq launch`` runs.

    While the training loop runs (:attr:`graceful`), the first signal only asks it to stop: no
    batch is sent after it, the ones sent finish, and the loop checkpoints the last step (see
    :meth:`Trainer.train`). Anywhere else (start-up, or a second signal) it raises
    KeyboardInterrupt at once. The command exits with 128 + the first signal's number."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self.graceful = False

    @contextlib.contextmanager
    def installed(self) -> Iterator["StopSignals"]:
        if threading.current_thread() is not threading.main_thread():
            yield self  # signals reach the main thread only: nothing to install
            return
        previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        first = self.received is None
        if first:
            self.received = signum
        if not (first and self.graceful):
            raise KeyboardInterrupt

    @property
    def stopping(self) -> bool:
        return self.received is not None

    def name(self) -> str:
        return signal.Signals(self.received or signal.SIGINT).name

    def exit_code(self) -> int:
        return 128 + int(self.received or signal.SIGINT)


class RunDirError(ValueError):
    """The output directory cannot be used by this launch (exit code 2)."""


class RunDir:
    """The output directory, owned by one run: ``OUT/.lock`` (``fcntl.flock``, with the pid in
    it) is held for the run's life, and another run's files there are refused unless the launch
    resumes that run or overwrites it. A refused launch changes nothing in the directory."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.lock_path = os.path.join(out, LOCK)
        self._fd: int | None = None

    def run_files(self) -> list[str]:
        """The names of a run's files in the directory (see :data:`RUN_FILES`)."""
        try:
            return sorted(e for e in os.listdir(self.out) if RUN_FILES.fullmatch(e))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _busy(self, holder: str) -> RunDirError:
        who = f" (pid {holder})" if holder else ""
        return RunDirError(f"{self.out} is in use by another pipeq launch{who}, which holds {self.lock_path}; "
                           "wait for it to end, or choose another --out")

    @staticmethod
    def _try_lock(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise

    def _holder(self) -> str | None:
        """The pid a live launch wrote into the lock (None: nobody holds it). Reads only."""
        try:
            fd = os.open(self.lock_path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            if self._try_lock(fd):
                return None
            return os.pread(fd, 64, 0).decode(errors="replace").strip()
        finally:
            os.close(fd)  # closing drops a lock we took

    def _refuse_other_run(self, resume: bool, overwrite: bool) -> None:
        found = self.run_files()
        if found and not (resume or overwrite):
            raise RunDirError(
                f"{self.out} holds another run ({', '.join(found)}): pass --resume to continue it, "
                "--overwrite to delete its files and start a new run there, or choose another --out; "
                "nothing in it was changed")

    def claim(self, *, resume: bool, overwrite: bool) -> list[str]:
        """Lock the directory for this run (made if need be); with ``overwrite`` delete the old
        run's files. Raises :class:`RunDirError`, before any change, when another launch holds it
        or (without ``resume`` / ``overwrite``) it holds another run. The names deleted."""
        if os.path.exists(self.out) and not os.path.isdir(self.out):
            raise RunDirError(f"--out {self.out} is a file, not a directory")
        holder = self._holder()
        if holder is not None:
            raise self._busy(holder)
        self._refuse_other_run(resume, overwrite)
        os.makedirs(self.out, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        if not self._try_lock(fd):  # another launch got here first
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            os.close(fd)
            raise self._busy(holder)
        self._fd = fd
        try:
            self._refuse_other_run(resume, overwrite)  # again, under the lock
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            gone = self.run_files() if overwrite else []
            for name in gone:
                path = os.path.join(self.out, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
        except BaseException:
            self.release()
            raise
        return gone

    def release(self) -> None:
        """Unlock (the lock file stays: removing it would race with a launch opening it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


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
        self.ckpt_root = os.path.join(self.out, "checkpoints")

    def log(self, line: str) -> None:
        print(f"pipeq launch: {line}", file=self.stream, flush=True)

    # -- the command ---------------------------------------------------------------------
    def run(self) -> int:
        run_dir = RunDir(self.out)
        try:
            gone = run_dir.claim(resume=self.resume, overwrite=self.overwrite)
        except RunDirError as exc:
            self.log(str(exc))
            return 2
        except OSError as exc:
            self.log(f"cannot use --out {self.out}: {exc}")
            return 2
        try:
            if gone:
                self.log(f"--overwrite: deleted the previous run's {', '.join(gone)} in {self.out}")
            return self._run()
        finally:
            run_dir.release()

    def _run(self) -> int:
        from pipeq.control.runner import PipelineRunner

        job = self.job
        try:
            job.check()  # data, eval_data, metrics and their arguments, before any process starts
            runner = PipelineRunner(
                job.recipe, None, None, job.schedule, job.microbatches,
                threads_per_stage=job.threads_per_stage, heartbeat_timeout=job.heartbeat_timeout,
                step_timeout=job.step_timeout or None,  # 0 in the job file: off
                start_timeout=job.start_timeout, rendezvous=self.rz, placement=job.placement,
                trace=job.trace, data_parallel=job.data_parallel, start_method="forkserver",
                tensor_parallel=job.tensor_parallel,  # (--tensor-parallel 1: the plan is not used)
                tp_plan=job.tp_plan if job.tensor_parallel > 1 else None,
                tcp_security=job.tcp_security, max_message_mb=job.max_message_mb, shm_slots=job.shm_slots,
                **job.numerics_args(),
            )
            if job.lr_scheduler_monitor is not None and not runner.lr_schedule.takes_metric:
                raise ValueError(f"lr_scheduler_monitor = {job.lr_scheduler_monitor!r}, but {job.recipe.lr_scheduler} "
                                 "takes no metric (only a ReduceLROnPlateau does): drop lr_scheduler_monitor")
        except ValueError as exc:
            self.log(str(exc))
            return 2
        try:
            t0 = time.perf_counter()
            with runner:
                self.log(f"{runner.n_stages * job.data_parallel * job.tensor_parallel} stage processes started in "
                         f"{time.perf_counter() - t0:.1f} s")
                self.signals.graceful = True
                try:
                    self.train(runner)
                finally:
                    self.signals.graceful = False
        except PipelineError as exc:
            where = f"stage {exc.stage}" if exc.stage is not None else "the pipeline"
            self.log(f"{where} failed: {exc.message}")
            if exc.remote_traceback:
                print(f"--- traceback of {where} ---\n{exc.remote_traceback.rstrip()}",
                      file=self.stream, flush=True)
            return 1
        except KeyboardInterrupt:
            self.log(f"interrupted by {self.signals.name()}; every stage is stopped (the steps in flight "
                     "were abandoned; --resume continues from the newest checkpoint)")
            return self.signals.exit_code()
        except (ValueError, TypeError, OSError, checkpoint.CheckpointError) as exc:
            self.log(f"{type(exc).__name__}: {exc}")
            traceback.print_exc(file=self.stream)
            return 1
        if self.signals.stopping:
            return self.signals.exit_code()
        return 0

    def train(self, runner: Any) -> None:
        job = self.job
        os.makedirs(self.out, exist_ok=True)
        step, epoch, skip = self._resume_point(runner)
        start_step = step
        metrics_path = os.path.join(self.out, METRICS)
        self._trim_metrics(metrics_path, step)
        eval_set = job.eval_batches()
        eval_every = job.eval_every if eval_set is not None else 0
        metric_fns = job.metric_fns()
        by_epoch = runner.lr_schedule.interval == "epoch"  # the schedulers step between epochs
        epoch_losses = EpochLosses(epoch, self._logged_losses(metrics_path, epoch))
        total = self._total_steps()
        first_loss = last_loss = float("nan")
        samples = 0
        started = time.perf_counter()
        bar = self._progress(total, step)
        last_eval: dict[str, float] = {}
        pos = (epoch, skip)  # where the next batch comes from: (epoch, index in it)
        last: dict[str, Any] | None = None
        with open(metrics_path, "a") as metrics:
            if total is not None and step >= total:
                self.log(f"already trained {step} of {total} steps; writing the final state")
            source = Batches(self._batches(epoch, skip), epoch)
            for done in self._stream(runner, source, step, total, eval_every, by_epoch):
                if isinstance(done, EpochEnd):  # resumed at the end of an epoch: its step first
                    metric, _ = self._epoch_metric(runner, done.epoch, eval_set, metric_fns, None, epoch_losses)
                    runner.scheduler_step(metric)
                    pos = (done.next_epoch, 0)
                    continue
                step, pos = done.step, (done.epoch, done.batch + 1)
                samples += done.size
                epoch_losses.add(done.epoch, done.loss)
                if math.isnan(first_loss):
                    first_loss = done.loss
                last_loss = done.loss
                line: dict[str, Any] = {"step": step, "epoch": done.epoch, "loss": done.loss,
                                        "samples_per_s": done.size / done.seconds if done.seconds > 0 else None}
                if done.lr is not None:
                    line["lr"] = done.lr
                final = total is not None and step >= total
                evaluated = None
                # _stream ends a segment at these steps: the state is this step's
                if eval_every and step % eval_every == 0 and not final and not self.signals.stopping:
                    last_eval = evaluated = self.evaluate(runner, eval_set, metric_fns)
                    line.update(last_eval)
                metric = None
                if done.next_epoch is not None:  # (a segment's end too) the metric the schedulers get
                    metric, evaluated = self._epoch_metric(runner, done.epoch, eval_set, metric_fns, evaluated,
                                                           epoch_losses)
                    if evaluated is not None:
                        last_eval = evaluated
                        line.update(evaluated)
                if job.checkpoint_every and step % job.checkpoint_every == 0:
                    # at an epoch's end: before its schedulers' step (a resumed run takes it, see EpochEnd)
                    self._save(runner, checkpoint.checkpoint_dir(self.ckpt_root, step), step, *pos)
                if final:  # its line is written below, with the final evaluation
                    last = line
                    break
                metrics.write(json.dumps(line) + "\n")
                metrics.flush()
                self._report(bar, line, total)
                if done.next_epoch is not None:
                    runner.scheduler_step(metric)
                    pos = (done.next_epoch, 0)  # a checkpoint from here on holds the step taken
            if self.signals.stopping and last is None:  # stopped before the last step
                if bar is not None:
                    bar.close()
                self._stopped(runner, step, pos, start_step)
                return
            if step == 0:
                raise ValueError(f"the job's data ({job.data}) yielded no batch")
            if eval_set is not None:
                last_eval = self.evaluate(runner, eval_set, metric_fns)
                if last is None and samples:  # data ran out before a step count: a line of its own
                    last = {"step": step, "epoch": pos[0]}
            if last is not None:
                last.update(last_eval)
                metrics.write(json.dumps(last) + "\n")
                if "loss" in last:
                    self._report(bar, last, total)
        if bar is not None:
            bar.close()
        elapsed = time.perf_counter() - started
        self._write_final(runner, step, pos, samples)
        self._summary(runner, step, first_loss, last_loss, last_eval, samples, elapsed)

    def _stopped(self, runner: Any, step: int, pos: tuple[int, int], start_step: int) -> None:
        """A signal stopped training after ``step`` (every step sent is done, the state is
        consistent): checkpoint it, so that --resume continues with the next step."""
        how = f"stopped by {self.signals.name()} after step {step}"
        if step == start_step:
            self.log(f"{how}, before training any step; nothing new to save")
            return
        directory = checkpoint.checkpoint_dir(self.ckpt_root, step)
        every = self.job.checkpoint_every
        if not (every and step % every == 0):  # else just saved
            self._save(runner, directory, step, *pos)
        self.log(f"{how}; checkpoint {directory} written: pass --resume to continue from step {step + 1}")

    def _resume_point(self, runner: Any) -> tuple[int, int, int]:
        """(step, epoch, batch index in it) to start from: 0s, or the newest complete checkpoint's
        (--resume): of checkpoints/, or final/ (a finished run given more steps)."""
        if not self.resume:
            return 0, 0, 0
        found = checkpoint.latest(self.ckpt_root)
        final = os.path.join(self.out, "final")
        if _checkpoint_step(final) is not None and (found is None or _checkpoint_step(final) > _checkpoint_step(found)):
            found = final
        if found is None:
            self.log(f"--resume: no complete checkpoint under {self.ckpt_root}; starting fresh")
            return 0, 0, 0
        meta = runner.load(found)
        step, epoch, skip = int(meta["step"]), int(meta["epoch"]), int(meta["batch"])
        self.log(f"resumed from {found} (step {step}, epoch {epoch})")
        return step, epoch, skip

    def _stream(self, runner: Any, source: Batches, step: int, total: int | None, eval_every: int,
                by_epoch: bool) -> Iterator[StepDone | EpochEnd]:
        """Train on ``source`` from step ``step`` on with ``runner.stream``: the pipeline stays
        full across batches, and is drained only at the end of each segment, which ends exactly
        at the next evaluation, checkpoint or last step, and (``by_epoch``) at the end of each
        epoch that another follows. A segment's last step is yielded once that stream is done,
        so what the caller does then (evaluate, save, step the schedulers) sees the state of that
        step; with ``by_epoch`` it says which epoch follows (:attr:`StepDone.next_epoch`)."""
        while total is None or step < total:
            following = source.next_epoch() if by_epoch and not self.signals.stopping else None
            if following is not None:  # resumed where an epoch ended
                yield EpochEnd(source.epoch, following)
                source.enter(following)
            end = self._segment_end(step, total, eval_every)
            taken: collections.deque[tuple[int, int, int]] = collections.deque()
            last: StepDone | None = None
            t = time.perf_counter()
            for loss in runner.stream(self._take(source, None if end is None else end - step, taken, by_epoch)):
                now = time.perf_counter()
                epoch, index, size = taken.popleft()  # losses come back in the order batches went
                step += 1
                # The stages work on several batches at once, so a batch has no time of its own:
                # its time is the wall time since the previous loss (a segment's first also covers
                # filling the pipeline), hence samples_per_s = its samples / that time.
                done = StepDone(step, epoch, index, size, loss, now - t, runner.last_step_lr)
                t = now
                if last is not None:
                    yield last
                last = done
            if last is None:  # no batch: the data ran out, or a signal stopped the run
                return
            if by_epoch and step != total and not self.signals.stopping:
                last.next_epoch = source.next_epoch()
            yield last
            if last.next_epoch is not None:
                source.enter(last.next_epoch)
            elif step != end:  # the data ran out, or a signal stopped the run
                return

    def _segment_end(self, step: int, total: int | None, eval_every: int) -> int | None:
        """The first step after ``step`` that needs a consistent state (an evaluation, a
        checkpoint, the last step); None: none before the data runs out."""
        ends = [total] if total is not None else []
        ends += [(step // every + 1) * every for every in (eval_every, self.job.checkpoint_every) if every]
        return min(ends, default=None)

    def _take(self, source: Batches, count: int | None, taken: "collections.deque[tuple[int, int, int]]",
              by_epoch: bool = False) -> Iterator[Any]:
        """The next ``count`` batches of ``source`` (None: all), each noted in ``taken`` as it goes;
        none after a stop signal (the stream then finishes the ones sent, and ends), and
        (``by_epoch``) none of the next epoch."""
        sent = 0
        while not self.signals.stopping and (count is None or sent < count):
            if by_epoch and source.next_epoch() is not None:
                return
            item = source.take()
            if item is None:
                return
            epoch, index, (x, y) = item
            taken.append((epoch, index, _samples(x)))
            sent += 1
            yield x, y

    def _write_final(self, runner: Any, step: int, pos: tuple[int, int], samples: int) -> None:
        """final/ (plus the last checkpoint), and model.pt: final/'s model state."""
        final = os.path.join(self.out, "final")
        self._save(runner, final, step, *pos)
        every = self.job.checkpoint_every
        if every and samples and step % every:  # else just saved
            self._save(runner, checkpoint.checkpoint_dir(self.ckpt_root, step), step, *pos)
        tmp = os.path.join(self.out, "model.pt.tmp")
        torch.save(checkpoint.load(final).model, tmp)
        os.replace(tmp, os.path.join(self.out, "model.pt"))

    # -- pieces ----------------------------------------------------------------------------
    def _total_steps(self) -> int | None:
        job = self.job
        if job.steps is not None:
            return job.steps
        try:
            per_epoch = len(job.batches(0))  # type: ignore[arg-type]
        except TypeError:
            return None  # a generator: the epochs end it
        return per_epoch * (job.epochs or 1)

    def _batches(self, epoch: int, skip: int) -> Iterator[tuple[int, int, Any]]:
        """(epoch, index in epoch, batch), from ``epoch`` with its first ``skip`` batches skipped."""
        job = self.job
        for e in itertools.count(epoch):
            if job.epochs is not None and e >= job.epochs:
                return
            empty = True
            for i, item in enumerate(job.batches(e)):
                empty = False
                if e == epoch and i < skip:
                    continue
                if not (isinstance(item, (tuple, list)) and len(item) == 2):
                    raise ValueError(f"data ({job.data}) must yield (x, target) pairs, got {type(item).__name__}")
                yield e, i, item
            if empty:
                return

    @staticmethod
    def evaluate(runner: Any, batches: list, metric_fns: dict[str, Any]) -> dict[str, float]:
        """``runner.evaluate`` over the eval set, as metrics.jsonl names the values: eval_loss (the
        job's loss; with Associated Learning the cross-entropy of predict's class scores),
        eval_accuracy (classification) and eval_NAME for each of the job's metrics."""
        return {f"eval_{name}": value for name, value in runner.evaluate(batches, metric_fns).items()}

    def _epoch_metric(self, runner: Any, epoch: int, eval_set: list | None, metric_fns: dict[str, Any],
                      evaluated: dict[str, float] | None, losses: EpochLosses) -> tuple[float | None, dict | None]:
        """At the end of ``epoch``: what the schedulers are stepped with (None unless they take a
        metric: a ReduceLROnPlateau gets the job's monitor), and the evaluation this took (the
        one ``evaluated`` at this step already, or a new one; None without)."""
        if not runner.lr_schedule.takes_metric:
            return None, evaluated
        monitor = self.job.monitor()
        if monitor == "train_loss":
            return losses.mean(epoch), evaluated
        if evaluated is None and eval_set is not None:
            evaluated = self.evaluate(runner, eval_set, metric_fns)
        if evaluated is None or monitor not in evaluated:
            measured = sorted(evaluated or {}) + ["train_loss"]
            raise ValueError(f"lr_scheduler_monitor = {monitor!r}, but the run measures {measured}")
        return evaluated[monitor], evaluated

    @staticmethod
    def _logged_losses(path: str, epoch: int) -> list[float]:
        """The step losses of ``epoch`` in metrics.jsonl (a resumed run's, trimmed to its step)."""
        if not os.path.exists(path):
            return []
        with open(path) as f:
            lines = [json.loads(ln) for ln in f if ln.strip()]
        return [float(ln["loss"]) for ln in lines if ln.get("epoch") == epoch and "loss" in ln]

    def _save(self, runner: Any, directory: str, step: int, epoch: int, batch: int) -> None:
        schedule = self.job.schedule
        runner.save(directory, {"step": step, "epoch": epoch, "batch": batch, "job": self.job.path,
                                "schedule": schedules.schedule_name(schedule),
                                "schedule_options": schedules.options_of(schedule),
                                "microbatches": self.job.microbatches})
        if os.path.dirname(directory) == self.ckpt_root:
            checkpoint.prune(self.ckpt_root, self.job.keep_checkpoints)

    @staticmethod
    def _trim_metrics(path: str, step: int) -> None:
        """Keep the metrics of steps up to ``step`` (a resumed run rewrites the later ones)."""
        if not os.path.exists(path):
            return
        if step == 0:
            os.remove(path)
            return
        with open(path) as f:
            lines = [ln for ln in f if ln.strip() and json.loads(ln).get("step", 0) <= step]
        with open(path + ".tmp", "w") as f:
            f.writelines(lines)
        os.replace(path + ".tmp", path)

    def _progress(self, total: int | None, initial: int) -> Any:
        if self.quiet:
            return None
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, unit="step", file=self.stream, dynamic_ncols=True)

    def _report(self, bar: Any, line: dict[str, Any], total: int | None) -> None:
        sps = line["samples_per_s"]
        # the job's own metrics beside the accuracy (eval_loss stays in metrics.jsonl)
        extra = {k: v for k, v in line.items() if k.startswith("eval_") and k not in ("eval_loss", "eval_accuracy")}
        if bar is not None:
            post = {"loss": f"{line['loss']:.4f}", "samples/s": f"{sps:.0f}" if sps else "-"}
            if "lr" in line:
                post["lr"] = f"{line['lr']:.3g}"
            if "eval_accuracy" in line:
                post["eval acc"] = f"{line['eval_accuracy']:.3f}"
            post.update({k[len("eval_"):]: f"{v:.4g}" for k, v in extra.items()})
            bar.set_postfix(post, refresh=False)
            bar.update(1)
            return
        step = line["step"]
        if step % max(1, self.job.log_every) == 0 or step == total or "eval_loss" in line:
            of = f"/{total}" if total else ""
            lr = f" lr {line['lr']:.4g}" if "lr" in line else ""
            ev = f" eval_accuracy {line['eval_accuracy']:.4f}" if "eval_accuracy" in line else ""
            ev += "".join(f" {k} {v:.4f}" for k, v in extra.items())
            self.log(f"step {step}{of} loss {line['loss']:.4f} {sps or 0:.0f} samples/s{lr}{ev}")

    def _summary(self, runner: Any, steps: int, first: float, last: float, ev: dict[str, float],
                 samples: int, elapsed: float) -> None:
        job = self.job
        nodes = f", {self.rz.nnodes} nodes" if self.rz is not None else ""
        lines = [
            f"pipeq launch: trained {steps} steps ({runner.n_stages} stages{nodes}, {job.schedule}, "
            f"{job.microbatches} microbatches) in {elapsed:.1f} s, {samples / max(elapsed, 1e-9):.0f} samples/s",
            (f"  loss {first:.4f} -> {last:.4f}" if samples else "  no new step (the run had trained them all)")
            + (f"; eval accuracy {ev['eval_accuracy']:.4f}" if "eval_accuracy" in ev else "")
            + (f"; eval loss {ev['eval_loss']:.4f}" if "eval_loss" in ev else "")
            + "".join(f"; {k.replace('_', ' ')} {v:.4f}" for k, v in ev.items()
                      if k not in ("eval_loss", "eval_accuracy")),
            f"  state: {os.path.join(self.out, 'model.pt')} and {os.path.join(self.out, 'final')}",
            f"  metrics: {os.path.join(self.out, METRICS)}",
        ] + ([f"  trace: {self.job.trace} (pipeq report {self.job.trace})"] if self.job.trace else [])
        print("\n".join(lines), flush=True)
