"""In-memory snapshots of a running pipeline: every stage's state every K steps, kept by the driver, with no drain.

``runner.keep_snapshots(every=K)`` asks each stage for its snapshot (parameters, buffers,
optimizer, lr-scheduler and loss-scaler state, RNG: what a checkpoint holds) right after every
K-th step: the request follows that step's TRAIN on each stage's command channel, and a stage
carries out its commands in order, so it answers once its own work and update for that step are
done and before it starts the next step. The pipeline is not drained: the other stages go on
with the next steps meanwhile, and the answers are picked up as they come (:attr:`snapshot`).

The driver is the keeper: it is the one process a restart keeps (``pipeq launch
--max-restarts``), so the death of any stage process loses no snapshot, and a restart restores
the newest complete one (:meth:`restore_snapshot`) without reading the disk. A schedule that
leaves work between batches in a stream (asynchronous 1F1B) is asked after the stream drains,
for the step it drained at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeq.errors import PipelineError
from pipeq.wire import control
from pipeq.wire.messages import Kind, Message

if TYPE_CHECKING:
    from pipeq.control.supervisor import Supervisor
    from pipeq.runtime.backend import Backend

__all__ = ["MemorySnapshot", "SnapshotRequests", "SnapshotSchedule"]


@dataclass(frozen=True)
class MemorySnapshot:
    """Every stage's state (``stages[k]``: what :meth:`PipelineRunner.save` writes for stage k,
    replica 0's, CPU tensors) after training step ``step`` (the runner's count, plus ``first_step``)."""

    step: int
    stages: list[dict[str, Any]]

    @property
    def nbytes(self) -> int:
        """The bytes of its tensors (what it costs in the driver's memory)."""
        return sum(_tensor_bytes(stage) for stage in self.stages)


def _tensor_bytes(value: Any) -> int:
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return int(value.element_size() * value.numel())
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


class SnapshotSchedule:
    """A runner's snapshots: which training steps its backend is asked to snapshot (every
    ``every``-th, counted from the caller's ``first_step``), and the newest complete one.

    The runner tells it of each training step it sends (:meth:`sent`) and of each stream it
    drains (:meth:`drained`); it holds no stage state but the snapshots that came back.
    """

    def __init__(self) -> None:
        #: the runner's backend, once it exists (``schedule="auto"``: once the first batch settled it)
        self.backend: Backend | None = None
        self._every = 0
        self._first = 0  # the caller's number of the runner's step 0
        self._sent = 0  # training steps sent (predict's batches do not count)
        self._after_drain = False  # a snapshot is due once the stream drains
        self._newest: MemorySnapshot | None = None

    def keep(self, every: int, first_step: int = 0) -> None:
        """Ask for a snapshot after every ``every``-th training step (0: none), the steps counted
        from ``first_step`` (see :meth:`PipelineRunner.keep_snapshots`)."""
        if type(every) is not int or every < 0:
            raise ValueError(f"snapshot_every must be a non-negative integer, got {every!r}")
        if type(first_step) is not int or first_step < 0:
            raise ValueError(f"first_step must be a non-negative integer, got {first_step!r}")
        self._every, self._first = every, first_step - self._sent

    def newest(self) -> MemorySnapshot | None:
        """The newest complete snapshot (None: none yet), with those the backend has completed
        since; never waits, and works after a failure (what had arrived is kept)."""
        if self.backend is not None:
            for step, stages in self.backend.take_snapshots():
                if self._newest is None or step > self._newest.step:
                    self._newest = MemorySnapshot(step, stages)
        return self._newest

    def sent(self, whole: bool) -> None:
        """A training step was just sent: ask for a snapshot after it if one is due. ``whole``:
        the stages' state is whole once the step is done (False: only once the stream drains,
        asynchronous 1F1B's, and the snapshot waits for :meth:`drained`)."""
        self._sent += 1
        step = self._first + self._sent
        if not self._every or step % self._every:
            return
        if not whole:
            self._after_drain = True
            return
        assert self.backend is not None  # a step was sent through it
        self.backend.request_snapshots(step)

    def drained(self) -> None:
        """A stream drained: the snapshot that waited for it (see :meth:`sent`), if any."""
        if self._after_drain:
            self._after_drain = False
            assert self.backend is not None
            self.backend.request_snapshots(self._first + self._sent)


class SnapshotRequests:
    """The snapshots a process backend has asked its ``n_stages`` stages for (replica 0's; with
    ``readers`` > n_stages, processes 0..readers-1 are asked: sharded replicas read theirs
    together): asked behind the commands already sent, taken once every one has answered. Never waits."""

    def __init__(self, n_stages: int, readers: int | None = None) -> None:
        self.n_stages = n_stages
        self.readers = n_stages if readers is None else readers
        self._asked: dict[int, int] = {}  # request id -> the step of the snapshot asked for

    def ask(self, sup: Supervisor, req: int, step: int) -> list[tuple[int, Message]]:
        """Request ``req``'s GET_SNAPSHOT for each stage, to send, labelled ``step``; the
        answers are kept by ``sup`` as they come."""
        sup.awaited.add((Kind.SNAPSHOT, req))
        self._asked[req] = step
        return [(g, Message(Kind.GET_SNAPSHOT, req)) for g in range(self.readers)]

    def take(self, sup: Supervisor | None) -> list[tuple[int, list[dict[str, Any]]]]:
        """The snapshots asked whose every stage has answered, as (step, per stage); works after
        a failure (what had arrived is kept)."""
        n, asked = self.n_stages, self._asked
        if sup is None or not asked:
            return []
        if sup.failure is None:
            try:
                sup.drain_pending()
            except PipelineError:  # the run fails: the ERROR is raised by whoever waits next
                pass
        done = []
        for req, step in list(asked.items()):
            got = sup.take_kept(Kind.SNAPSHOT, req, self.readers)
            if got is None:
                continue
            del asked[req]
            try:
                done.append((step, [control.state_of(got[k]) for k in range(n)]))
            except (ValueError, KeyError):  # a malformed snapshot is no snapshot to restart from
                continue
        return done
