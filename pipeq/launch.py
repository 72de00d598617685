"""``pipeq launch JOB.toml``: train a job file, on one host or several.

On one host (the default) this process is the driver and starts every stage. In a multi-host run
(``--nnodes``/``--node-rank``/``--master-addr``/``--master-port``, or torchrun's / srun's
environment) node 0 is the driver and every other node runs an agent that starts its stages::

    host A: pipeq launch job.toml --nnodes 2 --node-rank 0 --master-addr A   # driver + stage 0
    host B: pipeq launch job.toml --nnodes 2 --node-rank 1 --master-addr A   # stages 1, 2

The driver trains for the job's steps or epochs, shows progress (tqdm; ``--quiet`` logs plain
lines), checkpoints every ``--checkpoint-every`` steps (``--resume`` continues from the newest
complete one), and writes into the output directory::

    checkpoints/step-00000020/   manifest.json + stage-<k>.pt (global names; loads into any split)
    final/                       the same, for the final state
    model.pt                     the final parameters and buffers, a plain state_dict of the
                                 flat model nn.Sequential(*layers) (global names)
    metrics.jsonl                one JSON line per step: step, epoch, loss, samples_per_s, and
                                 eval_accuracy / eval_loss where evaluated

A failing stage ends the command with exit code 1 and that stage's traceback.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
import traceback
from typing import Any, Iterator, TextIO

import torch

from . import checkpoint
from . import rendezvous as rdzv
from .errors import PipelineError
from .job import Job, load_job

METRICS = "metrics.jsonl"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="the job file (TOML)")
    g = p.add_argument_group("training (override the job file's keys)")
    g.add_argument("--steps", type=int, help="optimizer steps to train (caps --epochs)")
    g.add_argument("--epochs", type=int, help="passes over the job's data")
    g.add_argument("--schedule", help="schedule name, e.g. 1f1b or fill-drain")
    g.add_argument("--microbatches", type=int)
    g.add_argument("--out", help="output directory")
    g.add_argument("--seed", type=int, help="seed of the stages' initial weights")
    g.add_argument("--checkpoint-every", type=int, metavar="N", help="checkpoint every N steps (0: never)")
    g.add_argument("--keep-checkpoints", type=int, metavar="K", help="keep the newest K checkpoints (0: all)")
    g.add_argument("--eval-every", type=int, metavar="N", help="evaluate every N steps (0: at the end)")
    g.add_argument("--threads-per-stage", type=int)
    g.add_argument("--data-parallel", type=int, metavar="R", help="R replicas of the pipeline, gradients all-reduced")
    g.add_argument("--heartbeat-timeout", type=float, help="seconds of silence before a stage is failed")
    g.add_argument("--trace", metavar="PATH", help="write a Chrome trace of every stage's actions "
                   "(read it with pipeq report PATH)")
    g.add_argument("--start-timeout", type=float, help="seconds to wait for every stage (and node) to start")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
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


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("steps", "epochs", "schedule", "microbatches", "out", "seed", "checkpoint_every",
            "keep_checkpoints", "eval_every", "threads_per_stage", "heartbeat_timeout", "start_timeout", "trace", "data_parallel")
    return {k: getattr(args, k) for k in keys}


def run(args: argparse.Namespace) -> int:
    try:
        job = load_job(args.job, _overrides(args))
        rz = rdzv.from_settings(args.nnodes, args.node_rank, args.master_addr, args.master_port,
                                args.bind, args.run_id)
    except ValueError as exc:
        print(f"pipeq launch: {exc}", file=sys.stderr)
        return 2
    if rz is not None and rz.node_rank != 0:
        return _run_agent(job, rz)
    return Trainer(job, rz, resume=args.resume, quiet=args.quiet).run()


def _run_agent(job: Job, rz: rdzv.Rendezvous) -> int:
    from .agent import AgentError, run_agent
    from .processes import StageSettings

    def log(line: str) -> None:
        print(f"pipeq launch: {line}", file=sys.stderr, flush=True)

    try:
        n = job.recipe.count_stages()
        settings = StageSettings(threads_per_stage=job.threads_per_stage,
                                 queue_capacity=max(64, 4 * job.microbatches))
        return run_agent(rz, job.recipe, n, job.schedule, settings, heartbeat_timeout=job.heartbeat_timeout,
                         start_timeout=job.start_timeout, log=log, data_parallel=job.data_parallel)
    except (AgentError, RuntimeError, ValueError) as exc:
        log(str(exc))
        return 1


class Trainer:
    """The driver side of ``pipeq launch``: the training loop, checkpoints, metrics, summary."""

    def __init__(self, job: Job, rz: rdzv.Rendezvous | None, *, resume: bool = False,
                 quiet: bool = False, stream: TextIO | None = None) -> None:
        self.job = job
        self.rz = rz
        self.resume = resume
        self.quiet = quiet
        self.stream = stream or sys.stderr
        self.out = os.path.abspath(job.out)
        self.ckpt_root = os.path.join(self.out, "checkpoints")

    def log(self, line: str) -> None:
        print(f"pipeq launch: {line}", file=self.stream, flush=True)

    # -- the command ---------------------------------------------------------------------
    def run(self) -> int:
        from .runner import PipelineRunner

        job = self.job
        try:
            runner = PipelineRunner(
                job.recipe, None, None, job.schedule, job.microbatches,
                threads_per_stage=job.threads_per_stage, heartbeat_timeout=job.heartbeat_timeout,
                start_timeout=job.start_timeout, rendezvous=self.rz, placement=job.placement,
                trace=job.trace, data_parallel=job.data_parallel,
            )
        except ValueError as exc:
            self.log(str(exc))
            return 2
        try:
            with runner:
                self.train(runner)
        except PipelineError as exc:
            where = f"stage {exc.stage}" if exc.stage is not None else "the pipeline"
            self.log(f"{where} failed: {exc.message}")
            if exc.remote_traceback:
                print(f"--- traceback of {where} ---\n{exc.remote_traceback.rstrip()}",
                      file=self.stream, flush=True)
            return 1
        except KeyboardInterrupt:
            self.log("interrupted; every stage is stopped")
            return 130
        except (ValueError, TypeError, OSError, checkpoint.CheckpointError) as exc:
            self.log(f"{type(exc).__name__}: {exc}")
            traceback.print_exc(file=self.stream)
            return 1
        return 0

    def train(self, runner: Any) -> None:
        job = self.job
        os.makedirs(self.out, exist_ok=True)
        step, epoch, skip = 0, 0, 0
        if self.resume:
            found = checkpoint.latest(self.ckpt_root)
            if found is None:
                self.log(f"--resume: no complete checkpoint under {self.ckpt_root}; starting fresh")
            else:
                meta = runner.load(found)
                step, epoch, skip = int(meta["step"]), int(meta["epoch"]), int(meta["batch"])
                self.log(f"resumed from {found} (step {step}, epoch {epoch})")
        metrics_path = os.path.join(self.out, METRICS)
        self._trim_metrics(metrics_path, step)
        eval_set = job.eval_batches()
        loss_fn = job.recipe.loss_fn()
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
            for epoch, batch, (x, y) in self._batches(epoch, skip):
                if total is not None and step >= total:
                    break
                t0 = time.perf_counter()
                loss = runner.step(x, y)
                dt = time.perf_counter() - t0
                step += 1
                pos = (epoch, batch + 1)
                samples += int(x.shape[0])
                if math.isnan(first_loss):
                    first_loss = loss
                last_loss = loss
                line: dict[str, Any] = {"step": step, "epoch": epoch, "loss": loss,
                                        "samples_per_s": x.shape[0] / dt if dt > 0 else None}
                done = total is not None and step >= total
                if eval_set is not None and job.eval_every and step % job.eval_every == 0 and not done:
                    last_eval = self.evaluate(runner, eval_set, loss_fn)
                    line.update(last_eval)
                if job.checkpoint_every and step % job.checkpoint_every == 0:
                    self._save(runner, checkpoint.checkpoint_dir(self.ckpt_root, step), step, *pos)
                if done:  # its line is written below, with the final evaluation
                    last = line
                    break
                metrics.write(json.dumps(line) + "\n")
                metrics.flush()
                self._report(bar, line, total)
            if step == 0:
                raise ValueError(f"the job's data ({job.data}) yielded no batch")
            if eval_set is not None:
                last_eval = self.evaluate(runner, eval_set, loss_fn)
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
        final = os.path.join(self.out, "final")
        self._save(runner, final, step, *pos)
        if job.checkpoint_every and samples and step % job.checkpoint_every:  # else just saved
            self._save(runner, checkpoint.checkpoint_dir(self.ckpt_root, step), step, *pos)
        model = checkpoint.load(final).model
        tmp = os.path.join(self.out, "model.pt.tmp")
        torch.save(model, tmp)
        os.replace(tmp, os.path.join(self.out, "model.pt"))
        self._summary(runner, step, first_loss, last_loss, last_eval, samples, elapsed)

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

    def evaluate(self, runner: Any, batches: list, loss_fn: Any) -> dict[str, float]:
        correct = count = 0
        loss_sum = 0.0
        classify = True
        for x, y in batches:
            out = runner.predict(x)
            out = out[0] if isinstance(out, tuple) else out
            loss_sum += float(loss_fn(out, y)) * len(y)
            if classify and out.dim() == 2 and not (y.is_floating_point() or y.is_complex()):
                correct += int((out.argmax(1) == y).sum())
            else:
                classify = False
            count += len(y)
        res = {"eval_loss": loss_sum / max(count, 1)}
        if classify:
            res["eval_accuracy"] = correct / max(count, 1)
        return res

    def _save(self, runner: Any, directory: str, step: int, epoch: int, batch: int) -> None:
        runner.save(directory, {"step": step, "epoch": epoch, "batch": batch, "job": self.job.path,
                                "schedule": self.job.schedule, "microbatches": self.job.microbatches})
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
        if bar is not None:
            post = {"loss": f"{line['loss']:.4f}", "samples/s": f"{sps:.0f}" if sps else "-"}
            if "eval_accuracy" in line:
                post["eval acc"] = f"{line['eval_accuracy']:.3f}"
            bar.set_postfix(post, refresh=False)
            bar.update(1)
            return
        step = line["step"]
        if step % max(1, self.job.log_every) == 0 or step == total or "eval_loss" in line:
            of = f"/{total}" if total else ""
            ev = f" eval_accuracy {line['eval_accuracy']:.4f}" if "eval_accuracy" in line else ""
            self.log(f"step {step}{of} loss {line['loss']:.4f} {sps or 0:.0f} samples/s{ev}")

    def _summary(self, runner: Any, steps: int, first: float, last: float, ev: dict[str, float],
                 samples: int, elapsed: float) -> None:
        job = self.job
        nodes = f", {self.rz.nnodes} nodes" if self.rz is not None else ""
        lines = [
            f"pipeq launch: trained {steps} steps ({runner.n_stages} stages{nodes}, {job.schedule}, "
            f"{job.microbatches} microbatches) in {elapsed:.1f} s, {samples / max(elapsed, 1e-9):.0f} samples/s",
            f"  loss {first:.4f} -> {last:.4f}"
            + (f"; eval accuracy {ev['eval_accuracy']:.4f}" if "eval_accuracy" in ev else "")
            + (f"; eval loss {ev['eval_loss']:.4f}" if "eval_loss" in ev else ""),
            f"  state: {os.path.join(self.out, 'model.pt')} and {os.path.join(self.out, 'final')}",
            f"  metrics: {os.path.join(self.out, METRICS)}",
        ] + ([f"  trace: {self.job.trace} (pipeq report {self.job.trace})"] if self.job.trace else [])
        print("\n".join(lines), flush=True)
