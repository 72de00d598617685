"""The exceptions pipeq raises to its users."""

from __future__ import annotations


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


class MainScriptError(PipelineError, ValueError):
    """The main script cannot start stage processes as written: the runner is started outside
    its ``if __name__ == "__main__":`` block, or a stage uses a class or function defined under
    that block (which a stage process never runs). Raised before any process starts."""


class ScheduleError(ValueError):
    """A schedule is inconsistent or would deadlock with the given stage and microbatch counts."""


class CodecError(ValueError):
    """A message on the wire is malformed; see the subclasses in :mod:`pipeq.wire.codec`."""
