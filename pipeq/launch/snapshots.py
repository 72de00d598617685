"""A launch's in-memory snapshots: the newest one whose step the loop has finished, kept across restarts."""

from __future__ import annotations

from typing import Any

from pipeq.control.snapshots import MemorySnapshot

__all__ = ["Snapshots"]

_POSITIONS_KEPT = 64  # steps whose data position is remembered until their snapshot completes


class Snapshots:
    """The trainer's keeper of in-memory snapshots (job key ``snapshot_every``): after each
    step the loop has finished (its line, evaluation and checkpoint done), :meth:`adopt` takes
    the runner's newest complete snapshot of a finished step, with the data position a resumed
    run starts at; a restart loads it (:meth:`newest`) when it is newer than the newest checkpoint."""

    def __init__(self, every: int) -> None:
        self.every = every
        self._positions: dict[int, tuple[int, int]] = {}  # step -> (epoch, batch index) after it
        self._newest: tuple[MemorySnapshot, tuple[int, int]] | None = None

    def attach(self, runner: Any, step: int) -> None:
        """A runner starts at ``step``: have it take a snapshot every ``every`` steps."""
        if self.every:
            runner.keep_snapshots(self.every, first_step=step)

    def finished(self, runner: Any, step: int, pos: tuple[int, int]) -> None:
        """The loop has finished ``step`` (the next batch: ``pos``): adopt the newest snapshot
        taken at or before it."""
        if not self.every:
            return
        if step % self.every == 0:
            self._positions[step] = pos
            for old in [s for s in self._positions if s <= step - _POSITIONS_KEPT * self.every]:
                del self._positions[old]
        self.adopt(runner, step)

    def adopt(self, runner: Any, finished: int) -> None:
        """Take ``runner``'s newest complete snapshot if the loop has finished its step (also
        after a failure: what had arrived is kept)."""
        if not self.every:
            return
        snap = runner.snapshot
        if snap is None or snap.step > finished or snap.step not in self._positions:
            return
        if self._newest is None or snap.step > self._newest[0].step:
            self._newest = (snap, self._positions[snap.step])

    def newest(self) -> tuple[MemorySnapshot, tuple[int, int]] | None:
        """The newest adopted snapshot and the data position after its step (None: none)."""
        return self._newest
