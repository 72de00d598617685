"""TensorBoard event files of ``pipeq launch``: its metrics as scalars in ``OUT/tb/`` (torch.utils.tensorboard)."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable

__all__ = ["Board", "INSTALL", "writer_class", "stage_times"]

#: What to install for the event files (the package torch.utils.tensorboard writes them with).
INSTALL = "pip install pipeq[tensorboard]"
#: Pending scalars are handed to the writer at an evaluation, a restart, the end, and at the
#: latest this many seconds after the oldest of them (a step's own cost: a list append).
WRITE_EVERY_S = 10.0


def writer_class(setting: bool | None, log: Callable[[str], None]) -> Any:
    """torch.utils.tensorboard's ``SummaryWriter`` for the job key ``tensorboard``: None when it
    is false, or when it is not set and the tensorboard package is missing (said in one log
    line); a ``ValueError`` saying what to install when it is set true and the package is missing."""
    if setting is False:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        if setting:
            raise ValueError(f"tensorboard = true, but the tensorboard package cannot be imported ({exc}): "
                             f"{INSTALL} (or pip install 'tensorboard>=2.14'), or set tensorboard = false "
                             "(--no-tensorboard)") from None
        log(f"no TensorBoard event files: the tensorboard package is not installed ({INSTALL})")
        return None
    return SummaryWriter


def _scalars(line: dict[str, Any]) -> list[tuple[str, float]]:
    """The scalars of one metrics.jsonl record: a step's line or a restart's."""
    if "restart" in line:  # pipeq.launch.restarts: written at the step the restarted run resumed from
        return [("run/restarts", line["restart"]), ("run/seconds_lost", line.get("seconds_lost"))]
    out = [("train/loss", line.get("loss")), ("train/lr", line.get("lr")),
           # what the progress bar and log lines show: the moving average, when there is one
           ("train/samples_per_s", line.get("samples_per_s_avg", line.get("samples_per_s")))]
    out += [(f"eval/{k[len('eval_'):]}", v) for k, v in line.items() if k.startswith("eval_")]
    return out


class Board:
    """One attempt's event files in ``directory`` (``writer``: a SummaryWriter class; None: this
    board writes nothing). :meth:`start` opens them at the attempt's first step, :meth:`record`
    takes metrics.jsonl's records, :meth:`close` (on every exit path) writes the rest and ends
    the writer's thread."""

    def __init__(self, directory: str, writer: Any = None, log: Callable[[str], None] | None = None) -> None:
        self.directory = directory
        self.log = log
        self._writer_class = writer
        self._writer: Any = None
        self._pending: list[tuple[float, dict[str, Any]]] = []  # (wall time, record), not written yet

    @property
    def active(self) -> bool:
        """Whether it is open (started, not closed, with a writer)."""
        return self._writer is not None

    def start(self, step: int) -> None:
        """Open the event files of a run at ``step`` (a resumed run's; 0: a new run). TensorBoard
        hides what an earlier attempt wrote after ``step`` (``purge_step``): those steps are trained again."""
        if self._writer_class is None or self._writer is not None:
            return
        _quiet_writer_threads()
        # max_queue: handing a write-out to the writer's thread does not wait for each event to be written
        self._guarded(lambda: setattr(self, "_writer", self._writer_class(
            log_dir=self.directory, purge_step=step + 1, max_queue=1024)))

    def record(self, line: dict[str, Any]) -> None:
        """One metrics.jsonl record (not changed afterwards); written out at an evaluation or a
        restart, or once the oldest pending one is :data:`WRITE_EVERY_S` old."""
        if self._writer is None:
            return
        now = time.time()
        self._pending.append((now, line))
        if "restart" in line or any(k.startswith("eval_") for k in line) or now - self._pending[0][0] > WRITE_EVERY_S:
            self._guarded(self.write_out)

    def scalars(self, rows: Iterable[tuple[int, str, float]]) -> None:
        """Scalars of their own, (step, tag, value) (a trace's stage times: after the run), written at once."""
        if self._writer is None:
            return

        def write() -> None:
            self.write_out()
            for step, tag, value in rows:
                self._writer.add_scalar(tag, float(value), step)
            self._writer.flush()
        self._guarded(write)

    def _guarded(self, write: Callable[[], None]) -> None:
        """``write()``; if it fails (a full disk), say so once and write no more event files: the
        run goes on (metrics.jsonl has every step), and a full disk is said plainly where it
        matters, at the next checkpoint or metrics line."""
        try:
            write()
        except Exception as exc:
            writer, self._writer, self._pending = self._writer, None, []
            if self.log is not None:
                self.log(f"TensorBoard: writing {self.directory} failed ({type(exc).__name__}: {exc}); "
                         "no more event files in this attempt (metrics.jsonl has every step)")
            try:
                if writer is not None:
                    writer.close()
            except Exception:
                pass

    def write_out(self) -> None:
        """Hand the pending scalars to the writer and flush the event file."""
        if self._writer is None:
            return
        pending, self._pending = self._pending, []
        for wall, line in pending:
            for tag, value in _scalars(line):
                if value is not None:
                    self._writer.add_scalar(tag, float(value), line["step"], walltime=wall)
        self._writer.flush()

    def close(self) -> None:
        """Write the rest and close the event file (its thread ends); again: nothing. Raises
        nothing: it also runs on the way out of a failure, whose error is the one to see."""
        writer = self._writer
        if writer is None:
            return
        self._guarded(self.write_out)
        if self._writer is not None:  # (a failed write-out closed it already)
            self._guarded(writer.close)
        self._writer = None


def stage_times(trace_path: str, last_step: int) -> list[tuple[int, str, float]]:
    """Each stage's compute time (``busy_ms/stage<k>``) and bubble (``bubble/stage<k>``, the
    share of the step it did not compute; ``bubble/mean`` over the stages) in each training step
    of a launch's trace, replica 0's, as ``pipeq report`` measures them
    (:func:`pipeq.trace.analyze`): (step, tag, value). The runner numbers its steps from
    its start, its evaluations' too: the trace's last training step is the run's ``last_step``."""
    from pipeq.trace import load_trace
    from pipeq.trace.report import analyze

    steps = [s for s in analyze(load_trace(trace_path)).steps if s.replica == 0 and s.training]
    first = last_step - len(steps) + 1
    rows = []
    for step, s in enumerate(steps, first):
        for st in s.stages:
            rows += [(step, f"busy_ms/stage{st.stage}", st.compute_us / 1e3), (step, f"bubble/stage{st.stage}", st.bubble)]
        rows.append((step, "bubble/mean", s.bubble))
    return rows


_WRITER_THREAD = "_AsyncWriterThread"  # tensorboard's event writer thread (tensorboard.summary.writer)


def _quiet_writer_threads() -> None:
    """An event writer thread that fails (a full disk) re-raises, which prints its traceback; the
    :class:`Board` says it in one line instead (the writer's next call raises the same error). Every
    other thread's exception is printed as before. Installed once per process."""
    previous = threading.excepthook
    if getattr(previous, "_pipeq_quiet", False):
        return

    def hook(args: Any) -> None:
        if type(args.thread).__name__ != _WRITER_THREAD:
            previous(args)

    hook._pipeq_quiet = True  # type: ignore[attr-defined]
    threading.excepthook = hook
