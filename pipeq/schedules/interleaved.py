"""Interleaved 1F1B and looped BFS: v model stages per process, placed in a loop (p, p+N, ...).

Interleaved 1F1B: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (SC 2021, arXiv 2104.04473), in the order of torch's
``ScheduleInterleaved1F1B``, including its relaxation of m being a multiple of N: the microbatches
go in rounds of ``r = m // max(1, m // N)`` (m must be a multiple of the number of rounds, e.g.
N = 4 takes m = 1..8, 10, 12, 15, 16, ... but not 9 or 11). A process walks its chunks in blocks of
r microbatches, forwards through chunks 0, 1, ..., v-1, backwards through v-1, ..., 0; process p
warms up with min(m·v, (v-1)·r + 2(N-1-p)) forwards, then runs one forward and one backward in
turn, then its last backwards. 2 processes x 2 chunks (model stages 0..3) x 4 microbatches::

    process 0 | F0 F1 F0.c1 F1.c1 F2 B0.c1 F3 B1.c1 F2.c1 B0 F3.c1 B1 B2.c1 B3.c1 B2 B3 STEP STEP.c1
    process 1 | F0 F1 F0.c1 B0.c1 F1.c1 B1.c1 F2 B0 F3 B1 F2.c1 B2.c1 F3.c1 B3.c1 B2 B3 STEP STEP.c1

Looped BFS: Lamy-Poirier, "Breadth-First Pipeline Parallelism" (MLSys 2023, arXiv 2211.05953),
in the order of torch's ``ScheduleLoopedBFS``: every forward of chunk 0, then of chunk 1, ...,
then the backwards from the last chunk down, each chunk's microbatches in reverse::

    process 0 | F0 F1 F0.c1 F1.c1 B1.c1 B0.c1 B1 B0 STEP STEP.c1

A process's list ends with one STEP per chunk, in chunk order. Pure: no I/O.
"""

from __future__ import annotations

import re
from typing import Any

from pipeq.errors import ScheduleError
from pipeq.schedules.actions import Action, Op, Schedule
from pipeq.schedules.basic import check_counts
from pipeq.schedules.protocol import SchedulePolicy

__all__ = ["Interleaved1F1B", "LoopedBFS", "interleaved_1f1b", "interleaved_process", "looped_bfs",
           "interleaved_rounds", "chunk_steps"]


def chunk_steps(chunks: int) -> list[Action]:
    """The STEPs that end a process's list: one per chunk, in chunk order."""
    return [Action(Op.STEP, -1, c) for c in range(chunks)]


def interleaved_rounds(n_processes: int, n_microbatches: int) -> int:
    """The microbatches per round (torch's relaxation: m need not be a multiple of N, only of the
    number of rounds max(1, m // N)); ScheduleError when m is not."""
    def fits(k: int) -> bool:
        return k % max(1, k // n_processes) == 0

    rounds = max(1, n_microbatches // n_processes)
    if not fits(n_microbatches):
        below = next(k for k in range(n_microbatches - 1, 0, -1) if fits(k))
        above = next(k for k in range(n_microbatches + 1, 2 * n_microbatches + 1) if fits(k))
        raise ScheduleError(
            f"interleaved 1F1B with {n_processes} processes goes in {rounds} rounds of microbatches, and "
            f"{n_microbatches} microbatches do not divide into them: give e.g. {below} or {above}")
    return n_microbatches // rounds


def _check_chunks(chunks: int, name: str) -> None:
    if type(chunks) is not int or chunks < 2:
        raise ScheduleError(f"{name} needs stages_per_process >= 2 (an integer), got {chunks!r}; with one stage "
                            "per process use '1f1b' or 'fill-drain'")


def _walk(op: Op, step: int, per_round: int, chunks: int) -> Action:
    """The ``step``-th forward (or backward) of a process: chunk by blocks of ``per_round``
    microbatches, up through the chunks for forwards, down for backwards."""
    block, within = divmod(step, per_round)
    chunk = block % chunks
    j = (block // chunks) * per_round + within
    return Action(op, j, chunk if op is Op.FORWARD else chunks - 1 - chunk)


def interleaved_process(p: int, n_processes: int, n_microbatches: int, chunks: int) -> list[Action]:
    """Process ``p``'s interleaved 1F1B actions (see the module docstring), its STEPs last."""
    per_round = interleaved_rounds(n_processes, n_microbatches)
    total = n_microbatches * chunks
    warm = min(total, (chunks - 1) * per_round + 2 * (n_processes - 1 - p))
    fwd = [_walk(Op.FORWARD, t, per_round, chunks) for t in range(total)]
    bwd = [_walk(Op.BACKWARD, t, per_round, chunks) for t in range(total)]
    acts = fwd[:warm]
    for s in range(total - warm):
        acts += [fwd[warm + s], bwd[s]]
    return acts + bwd[total - warm:] + chunk_steps(chunks)


def interleaved_1f1b(n_processes: int, n_microbatches: int, chunks: int = 2) -> Schedule:
    """Interleaved 1F1B: one list per process, ``chunks`` model stages each (looped placement)."""
    check_counts(n_processes, n_microbatches)
    _check_chunks(chunks, "interleaved-1f1b")
    return [interleaved_process(p, n_processes, n_microbatches, chunks) for p in range(n_processes)]


def looped_bfs(n_processes: int, n_microbatches: int, chunks: int = 2) -> Schedule:
    """Looped BFS: each process runs every forward chunk by chunk, then every backward from the
    last chunk down, microbatches in reverse (torch's order)."""
    check_counts(n_processes, n_microbatches)
    _check_chunks(chunks, "looped-bfs")
    m = n_microbatches
    fwd = [Action(Op.FORWARD, j, c) for c in range(chunks) for j in range(m)]
    bwd = [Action(Op.BACKWARD, j, c) for c in reversed(range(chunks)) for j in reversed(range(m))]
    return [fwd + bwd + chunk_steps(chunks) for _ in range(n_processes)]


class _LoopedPolicy(SchedulePolicy):
    """A schedule of ``stages_per_process`` chunks per process in looped placement; its label
    names the option unless it is the default, 2: ``"interleaved-1f1b"``, ``"interleaved-1f1b(v=4)"``."""

    option_names = ("stages_per_process",)
    placement = "loop"

    def __init__(self, stages_per_process: int = 2) -> None:
        _check_chunks(stages_per_process, self.name)
        self.stages_per_process = stages_per_process

    def _plan(self, n: int, m: int, chunks: int) -> Schedule:
        raise NotImplementedError

    def plan(self, n_stages: int, n_microbatches: int) -> Schedule:
        """One list per process (``n_stages`` is the number of processes N; S = v·N model stages)."""
        return self._plan(n_stages, n_microbatches, self.stages_per_process)

    @property
    def options(self) -> dict[str, Any]:
        return {"stages_per_process": self.stages_per_process}

    def with_options(self, **options: Any) -> "_LoopedPolicy":
        unknown = sorted(set(options) - set(self.option_names))
        if unknown:
            raise ValueError(f"schedule {self.name!r} takes the option stages_per_process, got {unknown}")
        return type(self)(**options) if options else self

    @property
    def label(self) -> str:
        return self.name if self.stages_per_process == 2 else f"{self.name}(v={self.stages_per_process})"

    @classmethod
    def from_label(cls, label: str) -> "_LoopedPolicy | None":
        found = re.fullmatch(rf"{re.escape(cls.name)}(?:\(v=(\d+)\))?", label)
        if found is None:
            return None
        return cls(int(found.group(1))) if found.group(1) else cls()


class Interleaved1F1B(_LoopedPolicy):
    """Interleaved 1F1B (Megatron-LM's virtual pipeline, torch's ``ScheduleInterleaved1F1B``)."""

    name = "interleaved-1f1b"

    def _plan(self, n: int, m: int, chunks: int) -> Schedule:
        return interleaved_1f1b(n, m, chunks)


class LoopedBFS(_LoopedPolicy):
    """Looped BFS (breadth-first pipeline parallelism, torch's ``ScheduleLoopedBFS``)."""

    name = "looped-bfs"

    def _plan(self, n: int, m: int, chunks: int) -> Schedule:
        return looped_bfs(n, m, chunks)
