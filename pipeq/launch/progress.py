"""What ``pipeq launch`` shows while it trains (a progress bar, or log lines) and the summary at the end."""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

from pipeq.launch.job import Job
from pipeq.launch.rundir import RunDir

__all__ = ["Progress", "Tally", "MovingRate", "print_summary", "shown_epoch"]

#: The steps samples/s is averaged over, in the progress bar, the log lines and metrics.jsonl.
RATE_WINDOW = 20


def shown_epoch(epoch: int, batch: int) -> int:
    """The epoch, counted from 1 as every message counts them, of the step before position
    (``epoch``, ``batch``): a checkpoint's (counted from 0, as ``data(epoch)`` receives it, and as
    metrics.jsonl's ``epoch`` field keeps it) names the next batch, which may begin an epoch."""
    return epoch + 1 if batch > 0 or epoch == 0 else epoch


class MovingRate:
    """samples/s over the last ``window`` steps: their samples over their seconds. One step's own
    figure jumps (a step's time is the wait since the previous loss, and the pipeline fills and
    drains around evaluations and checkpoints); this one moves smoothly."""

    def __init__(self, window: int = RATE_WINDOW) -> None:
        self.steps: collections.deque[tuple[int, float]] = collections.deque(maxlen=max(1, window))

    def add(self, samples: int, seconds: float) -> float | None:
        """One more step's samples and seconds; the average so far (None: no time measured yet)."""
        self.steps.append((samples, seconds))
        return self.rate()

    def rate(self) -> float | None:
        seconds = sum(t for _, t in self.steps)
        return sum(n for n, _ in self.steps) / seconds if seconds > 0 else None


class Progress:
    """Each step as it is trained: a tqdm bar (its postfix: loss, samples/s, lr, eval values), or
    with ``quiet`` a log line every ``log_every`` steps, at the last one and at each evaluation."""

    def __init__(self, *, quiet: bool, stream: TextIO, log_every: int, log: Callable[[str], None]) -> None:
        self.quiet = quiet
        self.stream = stream
        self.log_every = log_every
        self.log = log
        self.total: int | None = None
        self._bar: Any = None
        self.restarts = 0  # the run's restarts so far (--max-restarts): shown beside each step

    def start(self, total: int | None, initial: int) -> None:
        """Steps ``initial`` (a resumed run's) of ``total`` (None: unknown) are done."""
        self.total = total
        if not self.quiet:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", file=self.stream, dynamic_ncols=True)

    def report(self, line: dict[str, Any]) -> None:
        """A step's metrics.jsonl line, shown."""
        sps = line.get("samples_per_s_avg", line["samples_per_s"])  # the moving average, when there is one
        # the job's own metrics beside the accuracy (eval_loss stays in metrics.jsonl)
        extra = {k: v for k, v in line.items() if k.startswith("eval_") and k not in ("eval_loss", "eval_accuracy")}
        if self._bar is not None:
            post = {"loss": f"{line['loss']:.4f}", "samples/s": f"{sps:.0f}" if sps else "-"}
            if "lr" in line:
                post["lr"] = f"{line['lr']:.3g}"
            if "eval_accuracy" in line:
                post["eval acc"] = f"{line['eval_accuracy']:.3f}"
            post.update({k[len("eval_"):]: f"{v:.4g}" for k, v in extra.items()})
            if self.restarts:
                post["restarts"] = str(self.restarts)
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(1)
            return
        step, total = line["step"], self.total
        if step % max(1, self.log_every) == 0 or step == total or "eval_loss" in line:
            of = f"/{total}" if total else ""
            lr = f" lr {line['lr']:.4g}" if "lr" in line else ""
            ev = f" eval_accuracy {line['eval_accuracy']:.4f}" if "eval_accuracy" in line else ""
            ev += "".join(f" {k} {v:.4f}" for k, v in extra.items())
            ev += f" ({self.restarts} restart{'s' if self.restarts > 1 else ''} so far)" if self.restarts else ""
            self.log(f"step {step}{of} loss {line['loss']:.4f} {sps or 0:.0f} samples/s{lr}{ev}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


@dataclass
class Tally:
    """What this launch trained: its samples, its first and last step loss, since it started."""

    samples: int = 0
    first_loss: float = math.nan
    last_loss: float = math.nan
    started: float = field(default_factory=time.perf_counter)

    def add(self, size: int, loss: float) -> None:
        self.samples += size
        if math.isnan(self.first_loss):
            self.first_loss = loss
        self.last_loss = loss

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


def print_summary(job: Job, run_dir: RunDir, steps: int, n_stages: int, nnodes: int | None, tally: Tally,
                  ev: dict[str, float], elapsed: float, tensorboard: bool = False, restarts: int = 0) -> None:
    """The run in a few lines on stdout: steps, processes, speed, losses, evaluation, where the
    state and metrics are (and with ``tensorboard`` its event files). ``tally`` and ``elapsed``
    are the launch's, every attempt's after ``restarts`` restarts (steps trained again count again)."""
    nodes = f", {nnodes} node{'' if nnodes == 1 else 's'}" if nnodes is not None else ""
    first, last, samples = tally.first_loss, tally.last_loss, tally.samples
    again = f" with {restarts} restart{'s' if restarts > 1 else ''}" if restarts else ""
    lines = [
        f"pipeq launch: trained {steps} steps ({n_stages} stages{nodes}, {job.schedule}, "
        f"{job.microbatches} microbatches) in {elapsed:.1f} s{again}, {samples / max(elapsed, 1e-9):.0f} samples/s",
        (f"  loss {first:.4f} -> {last:.4f}" if samples else "  no new step (the run had trained them all)")
        + (f"; eval accuracy {ev['eval_accuracy']:.4f}" if "eval_accuracy" in ev else "")
        + (f"; eval loss {ev['eval_loss']:.4f}" if "eval_loss" in ev else "")
        + "".join(f"; {k.replace('_', ' ')} {v:.4f}" for k, v in ev.items()
                  if k not in ("eval_loss", "eval_accuracy")),
        f"  state: {run_dir.model} and {run_dir.final}",
        f"  metrics: {run_dir.metrics}",
    ] + ([f"  tensorboard: {run_dir.tb} (tensorboard --logdir {run_dir.tb})"] if tensorboard else []) + (
        [f"  trace: {job.trace} (pipeq report {job.trace})"] if job.trace else [])
    print("\n".join(lines), flush=True)
