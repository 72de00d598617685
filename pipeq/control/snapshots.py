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
from typing import Any

from pipeq.control.exclusive import exclusive
from pipeq.control.supervisor import take_kept
from pipeq.errors import PipelineError
from pipeq.wire import control
from pipeq.wire.messages import Kind, Message

__all__ = ["MemorySnapshot", "RunnerSnapshots", "request", "take"]


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


class RunnerSnapshots:
    """``keep_snapshots``, ``snapshot`` and ``restore_snapshot`` (mixed into the runner, which
    calls :meth:`_snapshot_after_submit` and :meth:`_snapshot_after_drain`)."""

    _backend: Any
    schedule: Any
    _sent_training: int  # training steps submitted (predict's batches do not count)
    n_stages: int
    _snap_every: int = 0
    _snap_first: int = 0
    _snap_after_drain: bool = False
    _snap_newest: MemorySnapshot | None = None

    def _require_running(self) -> None:
        raise NotImplementedError

    def keep_snapshots(self, every: int, first_step: int = 0) -> None:
        """Take an in-memory snapshot after every ``every``-th training step (0: none), counting
        steps from ``first_step`` (a resumed run's step: the runner's own count starts at 0;
        ``predict`` and ``evaluate`` do not count), so that a snapshot's
        :attr:`MemorySnapshot.step` is the caller's step number."""
        if type(every) is not int or every < 0:
            raise ValueError(f"snapshot_every must be a non-negative integer, got {every!r}")
        if type(first_step) is not int or first_step < 0:
            raise ValueError(f"first_step must be a non-negative integer, got {first_step!r}")
        self._snap_every, self._snap_first = every, first_step - self._sent_training

    @property
    @exclusive
    def snapshot(self) -> MemorySnapshot | None:
        """The newest complete in-memory snapshot (None: none yet); never waits. It stays
        readable after a failure has closed the runner."""
        backend = self._backend
        if backend is not None:
            for step, stages in backend.take_snapshots():
                if self._snap_newest is None or step > self._snap_newest.step:
                    self._snap_newest = MemorySnapshot(step, stages)
        return self._snap_newest

    @exclusive
    def restore_snapshot(self, snap: MemorySnapshot) -> None:
        """Load ``snap`` (of a runner with the same stages) into every stage and replica: the
        state it was taken in, without touching the disk."""
        self._require_running()
        if len(snap.stages) != self.n_stages:
            raise ValueError(f"the snapshot holds {len(snap.stages)} stages, this runner {self.n_stages}; "
                             "restore it into a runner of the same stages (or save and load a checkpoint)")
        self._backend.restore(snap.stages)

    def _snapshot_after_submit(self, stream: bool) -> None:
        """A training step was just sent (the ``_sent_training``-th): ask for a snapshot after it, if one is due."""
        every, step = self._snap_every, self._snap_first + self._sent_training
        if not every or step % every:
            return
        if stream and self.schedule.streams_across_batches:
            self._snap_after_drain = True  # its state is whole only once the stream drains
            return
        self._backend.request_snapshots(step)

    def _snapshot_after_drain(self) -> None:
        """A stream drained: the snapshot that waited for it (see :meth:`_snapshot_after_submit`)."""
        if self._snap_after_drain:
            self._snap_after_drain = False
            self._backend.request_snapshots(self._snap_first + self._sent_training)


def request(backend: Any, step: int) -> None:
    """Ask every stage of a process backend (replica 0's) for its snapshot, behind the commands
    already sent; the answers are kept as they come (:func:`take`), labelled ``step``."""
    sup = backend._usable()
    req = backend._next_request_id()
    backend._send_all(sup, [(k, Message(Kind.GET_SNAPSHOT, req)) for k in range(backend.n_stages)])
    sup.awaited.add((Kind.SNAPSHOT, req))
    backend.snapshot_requests[req] = step


def take(backend: Any) -> list[tuple[int, list[dict[str, Any]]]]:
    """The snapshots :func:`request` asked of ``backend`` whose every stage has answered, as
    (step, per stage); never waits, and works after a failure (what had arrived is kept)."""
    sup, asked, n = backend.sup, backend.snapshot_requests, backend.n_stages
    if sup is None or not asked:
        return []
    if sup.failure is None:
        try:
            sup.drain_pending()
        except PipelineError:  # the run fails: the ERROR is raised by whoever waits next
            pass
    done = []
    for req, step in list(asked.items()):
        got = take_kept(sup, Kind.SNAPSHOT, req, n)
        if got is None:
            continue
        del asked[req]
        try:
            done.append((step, [control.state_of(got[k]) for k in range(n)]))
        except (ValueError, KeyError):  # a malformed snapshot is no snapshot to restart from
            continue
    return done
