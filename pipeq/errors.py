"""The exceptions pipeq raises to its users."""

from __future__ import annotations

import os
import sys
import traceback
from types import TracebackType


class PipelineError(RuntimeError):
    """A stage failed, died or could not be reached.

    ``stage`` is the index of the stage at fault (None when the failure is not one stage's),
    ``replica`` its replica with data parallelism (None without), ``shard`` the stage's
    process at fault with tensor parallelism (None without),
    ``remote_traceback`` the stage's own traceback text when it raised.
    """

    def __init__(self, message: str, stage: int | None = None, remote_traceback: str | None = None,
                 replica: int | None = None, shard: int | None = None):
        self.message = message
        self.stage = stage
        self.replica = replica  # with data parallelism: which replica's stage
        self.shard = shard  # with tensor parallelism: which of the stage's processes
        self.remote_traceback = remote_traceback
        where = "" if stage is None else ((f"replica {replica}, " if replica is not None else "") + f"stage {stage}"
                                          + (f", shard {shard}" if shard is not None else ""))
        text = f"{where}: {message}" if where else message
        if remote_traceback:
            text += f"\n\n--- traceback in {where} ---\n{remote_traceback.rstrip()}"
        super().__init__(text)


def format_remote(exc: BaseException) -> str:
    """``exc``'s traceback as a stage sends it to the driver: like ``traceback.format_exception``, but
    an error that wraps its cause to add context (``raise RuntimeError(f"forward of microbatch 0 ...:
    {exc}") from exc``, whose message already holds the cause's, and is the first line of the driver's
    PipelineError) is one traceback: the wrapper's frames, then the cause's, ending with the cause
    itself (``ValueError: ...``), not the two chained tracebacks Python prints."""
    cause = exc.__cause__
    if (cause is None or cause.__traceback__ is None or not str(cause) or str(cause) not in str(exc)
            or cause.__cause__ is not None or (cause.__context__ is not None and not cause.__suppress_context__)):
        return "".join(traceback.format_exception(exc))
    outer, inner = traceback.extract_tb(exc.__traceback__), traceback.extract_tb(cause.__traceback__)
    if outer and inner and (outer[-1].filename, outer[-1].name) == (inner[0].filename, inner[0].name):
        outer = outer[:-1]  # the frame that wrapped it: shown at the line that failed, not at the raise
    frames = list(outer) + list(inner)
    return ("Traceback (most recent call last):\n" + "".join(traceback.StackSummary.from_list(frames).format())
            + "".join(traceback.format_exception_only(cause)))


class StageComputeError(RuntimeError):
    """A stage's own work failed (its forward, its loss; any action of a process holding several
    stages, naming the stage): the message says what failed, and ends with the cause's type and
    message, so :func:`error_line` shows it as is."""


def error_line(exc: BaseException) -> str:
    """``exc`` as one line for the driver: ``ValueError: boom``, or a StageComputeError's message."""
    return str(exc) if isinstance(exc, StageComputeError) else f"{type(exc).__name__}: {exc}"


class MainScriptError(PipelineError, ValueError):
    """The main script cannot start stage processes as written: the runner is started outside
    its ``if __name__ == "__main__":`` block, or a stage uses a class or function defined under
    that block (which a stage process never runs). Raised before any process starts."""


class ScheduleError(ValueError):
    """A schedule is inconsistent or would deadlock with the given stage and microbatch counts."""


class CodecError(ValueError):
    """A message on the wire is malformed; see the subclasses in :mod:`pipeq.wire.codec`."""


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def format_stage_error(exc: PipelineError) -> str:
    """How an uncaught stage error is shown: the PipelineError's own line first (stage,
    microbatch, shapes), then the stage's traceback, then where your code called pipeq (pipeq's
    own frames left out), and the error's line again at the end, where one looks for it."""
    where = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_PACKAGE)]
    head, sep, stage_tb = str(exc).partition("\n\n--- traceback in ")
    first = f"{type(exc).__module__}.{type(exc).__qualname__}: {head}"
    text = f"{first}\n\n--- traceback in {stage_tb.rstrip()}\n" if sep else first + "\n"
    if where:
        text += "\n--- called from ---\n" + "".join(traceback.StackSummary.from_list(where).format())
    return text + first.split("\n")[0] + "\n"


def excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None,
               then=sys.__excepthook__) -> None:
    """``sys.excepthook`` once a runner has started (:func:`install_excepthook`): a stage's error
    (a PipelineError carrying the stage's traceback, not chained to another) is shown by
    :func:`format_stage_error`; anything else goes to the hook that was there before."""
    if (isinstance(exc, PipelineError) and exc.remote_traceback and exc.__cause__ is None
            and (exc.__context__ is None or exc.__suppress_context__)):
        sys.stderr.write(format_stage_error(exc))
        sys.stderr.flush()
        return
    then(kind, exc, tb)


def install_excepthook() -> bool:
    """Show uncaught stage errors with :func:`excepthook`, unless ``sys.excepthook`` is already
    somebody's own (IPython, rich...): it is left alone. True when installed. Called by a runner's
    first ``start()`` (which ``pipeq launch`` makes too), never by ``import pipeq``: importing
    changes nothing global."""
    if sys.excepthook is not sys.__excepthook__:
        return False
    sys.excepthook = excepthook
    return True
