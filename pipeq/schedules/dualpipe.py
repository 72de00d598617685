"""DualPipeV: DeepSeek's bidirectional schedule folded into a V, two model stages per process.

DeepSeek-AI, "DeepSeek-V3 Technical Report" (arXiv 2412.19437, DualPipe), in its V variant
(DualPipeV, github.com/deepseek-ai/DualPipe), in the order of torch's ``ScheduleDualPipeV``.
Process p of N holds stage p (chunk 0) and stage 2N-1-p (chunk 1). torch pairs a forward of one
chunk with a full backward of the other into one overlapped action (``OVERLAP_F_B``, so that one's
communication hides behind the other's compute); pipeq lists the pair as its two actions, the
forward first. ``B`` is a full backward, ``I``/``W`` a split one whose W is deferred (the oldest
first). Process p runs, with m >= 2N microbatches:

1. 2(N-p-1) forwards of chunk 0;  2. p+1 times: a forward of chunk 0, one of chunk 1;
3. N-p-1 times: I of chunk 1, a deferred W, a forward of chunk 1;
4. m-2N+p+1 times: F chunk 0 + B chunk 1, then F chunk 1 + B chunk 0 (the overlapped pairs);
5. N-p-1 times: B chunk 1, then F chunk 1 + B chunk 0;
6. p+1 times: a backward of chunk 1, one of chunk 0; from the middle one on they are split
   (I, the W deferred);  7. N-p-1 times: a deferred W, a backward of chunk 0;
8. the deferred Ws left.

2 processes (stages 0..3) x 4 microbatches::

    process 0 | F0 F1 F2 F0.c1 I0.c1 W0.c1 F1.c1 F3 B1.c1 F2.c1 B0 B2.c1 F3.c1 B1 B3.c1 I2 W2 I3 W3 STEP STEP.c1
    process 1 | F0 F0.c1 F1 F1.c1 F2 B0.c1 F2.c1 B0 F3 B1.c1 F3.c1 B1 B2.c1 B2 I3.c1 I3 W3.c1 W3 STEP STEP.c1

Pure: no I/O.
"""

from __future__ import annotations

from pipeq.errors import ScheduleError
from pipeq.schedules.actions import Action, Op, Schedule
from pipeq.schedules.basic import check_counts
from pipeq.schedules.interleaved import chunk_steps
from pipeq.schedules.protocol import SchedulePolicy

__all__ = ["DualPipeV", "dualpipev", "dualpipev_process"]


class _Run:
    """A process's list as it grows: the next microbatch per (forward or backward, chunk), and
    the split backwards whose W is still to come (oldest first)."""

    def __init__(self) -> None:
        self.acts: list[Action] = []
        self.next: dict[tuple[str, int], int] = {}
        self.deferred: list[tuple[int, int]] = []  # (microbatch, chunk) of an I whose W is due

    def forward(self, chunk: int) -> None:
        j = self.next.get(("F", chunk), 0)
        self.next["F", chunk] = j + 1
        self.acts.append(Action(Op.FORWARD, j, chunk))

    def backward(self, chunk: int, split: bool = False) -> None:
        """A full backward, or (``split``) its I with the W deferred."""
        j = self.next.get(("B", chunk), 0)
        self.next["B", chunk] = j + 1
        self.acts.append(Action(Op.INPUT_GRAD if split else Op.BACKWARD, j, chunk))
        if split:
            self.deferred.append((j, chunk))

    def weight(self) -> None:
        """The oldest deferred W, if any."""
        if self.deferred:
            j, chunk = self.deferred.pop(0)
            self.acts.append(Action(Op.WEIGHT_GRAD, j, chunk))


def dualpipev_process(p: int, n_processes: int, n_microbatches: int) -> list[Action]:
    """Process ``p``'s DualPipeV actions (the steps of the module docstring), its two STEPs last."""
    n, m = n_processes, n_microbatches
    run = _Run()
    for _ in range(2 * (n - p - 1)):
        run.forward(0)
    for _ in range(p + 1):
        run.forward(0)
        run.forward(1)
    for _ in range(n - p - 1):
        run.backward(1, split=True)
        run.weight()
        run.forward(1)
    for _ in range(m - 2 * n + p + 1):
        run.forward(0)
        run.backward(1)
        run.forward(1)
        run.backward(0)
    for _ in range(n - p - 1):
        run.backward(1)
        run.forward(1)
        run.backward(0)
    split = False
    middle = (p + 1) // 2
    for i in range(p + 1):  # the split starts at the middle pair: with chunk 1 on odd p, chunk 0 on even
        split = split or (i == middle and p % 2 == 1)
        run.backward(1, split)
        split = split or (i == middle and p % 2 == 0)
        run.backward(0, split)
    for _ in range(n - p - 1):
        run.weight()
        run.backward(0, split)
    while run.deferred:
        run.weight()
    return run.acts + chunk_steps(2)


def check_dualpipev(n_processes: int, n_microbatches: int) -> None:
    """DualPipeV needs at least as many microbatches as model stages (2N), as torch does."""
    check_counts(n_processes, n_microbatches)
    if n_microbatches < 2 * n_processes:
        raise ScheduleError(f"dualpipev needs at least as many microbatches as model stages: {n_processes} processes "
                            f"hold {2 * n_processes} stages, got {n_microbatches} microbatches")


def dualpipev(n_processes: int, n_microbatches: int) -> Schedule:
    """DualPipeV: one list per process, two model stages each (V placement)."""
    check_dualpipev(n_processes, n_microbatches)
    return [dualpipev_process(p, n_processes, n_microbatches) for p in range(n_processes)]


class DualPipeV(SchedulePolicy):
    """DualPipeV (torch's ``ScheduleDualPipeV``): two stages per process in a V, overlapped F/B pairs."""

    name = "dualpipev"
    stages_per_process = 2
    placement = "v"

    def plan(self, n_stages: int, n_microbatches: int) -> Schedule:
        """One list per process (``n_stages`` is the number of processes N; 2N model stages)."""
        return dualpipev(n_stages, n_microbatches)
