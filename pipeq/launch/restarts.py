"""``--max-restarts``: after a stage fails, the run goes on from its newest checkpoint, by itself.

The failed runner is already stopped (every stage process gone, nothing half-sent); the trainer
builds a new one and resumes from the newest complete checkpoint, as ``--resume`` does: the same
data order, RNG streams, lr schedulers and loss scaler, so the final weights equal an
uninterrupted run's; or from the newest in-memory snapshot (``snapshot_every``) when it is newer,
with no disk read. Each restart is written to metrics.jsonl (``restart``: the error, the stage,
the first step that did not finish, the step resumed from, the seconds lost; a restart whose
stages failed again as they started: ``"resumed_from": null`` and ``start_failed``, that error),
and kept there when a later restart trims the file. :class:`Restarts` decides: it gives up after
K restarts, or when the same step fails twice in a row with the same error (a bug, not a fault),
unless the failure came from outside: a process killed by a signal from outside (its pid tells
the two kills apart), or, on several hosts, a start in which a node was lost (the restart
record's ``lost_nodes``: its agent gone or its host cut off, as node 0's regroup found). An injected
fault (``PIPEQ_FAULT``) fires in the first start only, so that a restart can show it recovers.
"""

from __future__ import annotations

import json
import re
import os
import time
from typing import Callable, Sequence

from pipeq.errors import PipelineError
from pipeq.runtime.faults import ENV as FAULT_ENV

__all__ = ["Restarts", "identity"]


#: signals a process gets from outside (an operator, the OOM killer, a chaos script): a process
#: killed by one twice at the same step is two faults, never "the same error" (its pid tells them apart)
OUTSIDE = ("SIGKILL", "SIGTERM", "SIGHUP", "SIGINT", "SIGQUIT")


def identity(message: str) -> str:
    """A failure's message without what differs from one start to the next: the runner numbers its
    steps from each start ("(step 1)" after a restart is step 3 before it), and a process's pid
    ("stage process (pid 4242) was killed by SIGSEGV") is new each time. A kill from outside
    (:data:`OUTSIDE`) keeps its pid: the same step killed twice is not a bug of the stage's."""
    message = re.sub(r"\bstep \d+", "step N", message)
    if any(re.search(rf"\b{sig}\b", message) for sig in OUTSIDE):
        return message
    return re.sub(r"\bpids? [\d, ]*\d", "pid N", message)


class Restarts:
    """Up to ``limit`` restarts of a run whose metrics go to ``metrics_path``."""

    def __init__(self, limit: int, metrics_path: str, log: Callable[[str], None]) -> None:
        self.limit = limit
        self.metrics_path = metrics_path
        self.log = log
        self.count = 0
        self._last: tuple[int, int | None, str] | None = None  # (step, stage, message) of the last failure
        self._pending: dict | None = None  # the restart record, written once the resume point is known
        self._failed_at = 0.0

    def again(self, exc: PipelineError, failed_step: int, lost_nodes: Sequence[int] = (), start: bool = True,
              failed_at: float | None = None) -> bool:
        """Whether to restart after ``exc``, ``failed_step`` the first training step that did not
        finish (steps after it may have been in flight too); saying why not. ``lost_nodes``: the
        nodes node 0's regroup found lost in that start (a failure from outside: never "a bug",
        and not the first of two either). ``start``: False when the restart is on record but
        will not start (the nodes left are too few, as the regroup said). ``failed_at``: when
        the failure was seen (``time.monotonic()``; default now), the start of the seconds lost."""
        key = (failed_step, exc.stage, identity(exc.message))
        self._unresumed(exc.message, failed_step)
        if self.count >= self.limit:
            if self.limit:
                self.log(f"gave up after {self.count} restart(s) (--max-restarts {self.limit})")
            return False
        if key == self._last and not lost_nodes:
            self.log(f"step {failed_step} failed twice in a row with the same error: a bug, not a fault; not "
                     "restarting")
            return False
        self._last = None if lost_nodes else key
        self.count += 1
        self._failed_at = time.monotonic() if failed_at is None else failed_at
        self._pending = {"restart": self.count, "error": exc.message, "stage": exc.stage,
                         "unfinished_step": failed_step}
        os.environ.pop(FAULT_ENV, None)  # an injected fault fires once
        if start:
            self.log(f"restart {self.count} of {self.limit}: starting the stages again from the newest checkpoint "
                     "or snapshot")
        else:
            self.log(f"restart {self.count} of {self.limit} not started (too few nodes left)")
        return True

    @property
    def left(self) -> bool:
        """Whether a restart is left (a multi-host run regroups its nodes only then)."""
        return self.count < self.limit

    def ended(self, code: int) -> None:
        """The launch ends (exit code ``code``) without another stage failure: a restart that never
        resumed (interrupted, or refused as its stages were made) is on record too."""
        if self._pending is not None:
            self._unresumed(f"the launch ended (exit code {code}) before it resumed",
                            int(self._pending["unfinished_step"]))

    def _unresumed(self, message: str, failed_step: int) -> None:
        """The pending restart failed again before it resumed (as its stages started): its record
        too, with ``start_failed`` (the error) and no step resumed from."""
        if self._pending is None:
            return
        self._write({**self._pending, "step": failed_step - 1, "resumed_from": None, "state_from": None,
                     "seconds_lost": round(time.monotonic() - self._failed_at, 3), "start_failed": message})

    def _write(self, record: dict) -> None:
        self._pending = None
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def note(self, **fields: object) -> None:
        """Add ``fields`` to the pending restart's record (e.g. the nodes it runs on after a node was lost)."""
        if self._pending is not None:
            self._pending.update(fields)

    def resumed(self, step: int, source: str = "disk") -> dict | None:
        """The restarted run resumed from ``step``, its state from ``source`` ("disk": a
        checkpoint, "memory": an in-memory snapshot, "start": none, the initial weights): write
        the restart's record to metrics.jsonl; the record (None: no restart is pending)."""
        if self._pending is None:
            return None
        record = {**self._pending, "step": step, "resumed_from": step, "state_from": source,
                  "seconds_lost": round(time.monotonic() - self._failed_at, 3)}
        self._write(record)
        self.log(f"restart {record['restart']}: resumed from step {step} ({source}), {record['seconds_lost']:.1f} s after "
                 f"stage {record['stage']} failed (step {record['unfinished_step']} unfinished)")
        return record
