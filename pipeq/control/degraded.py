"""``fault_tolerance="replicas"``: which training steps a lost replica degraded, and at which stages.

A replica lost during step d (gradient round d) is left out of step d and of every step sent
while it was down, at every stage, except at a stage that had already summed such a step with it
when the loss came (its LOST's ACK says so). The step before, d - 1, may still be summing at the
first stages then: it is degraded at each stage whose copy in the lost replica had not delivered
its gradients of it (that copy died, or gave the step up because a dead stage of its replica was
downstream of it), and only there (:mod:`pipeq.control.replica_loss`).
"""

from __future__ import annotations

from typing import Mapping

__all__ = ["DegradedSteps"]

_KEEP = 64  # gradient rounds remembered by their step: a loss's marks name the last two


class DegradedSteps:
    """The driver's record: each round's training step (:meth:`sent`), the replicas whose loss
    came for a step when fewer than all (:meth:`finished`), and the lost replica's marks per
    round and stage (``marks``, the ``rounds`` of :class:`pipeq.control.replica_loss.ReplicaLoss`: round ->
    stage -> replica -> left out (True) or summed after all (False))."""

    def __init__(self, replicas: int, n_stages: int, marks: Mapping[int, Mapping[int, Mapping[int, bool]]]) -> None:
        self.replicas, self.n_stages, self.marks = replicas, n_stages, marks
        self._step_of: dict[int, int] = {}  # gradient round -> its training step (the last _KEEP)
        self._rows: dict[int, list[int]] = {}  # step -> the replicas whose loss came, when fewer than all
        self._marked: dict[int, int] = {}  # round -> its step, once marks name it

    def sent(self, rnd: int, step: int) -> None:
        """Gradient round ``rnd`` is training step ``step``'s."""
        self._step_of[rnd] = step
        self._step_of.pop(rnd - _KEEP, None)

    def finished(self, step: int, done: list[int]) -> None:
        """Step ``step``'s loss came from the replicas ``done`` only."""
        self._rows[step] = list(done)

    def stages(self) -> dict[int, dict[int, list[int]]]:
        """Step -> stage -> the replicas that stage summed, for each stage that summed fewer than
        all, for every degraded step."""
        every = set(range(self.replicas))
        rows = {step: [set(done) for _ in range(self.n_stages)] for step, done in self._rows.items()}
        for rnd, per_stage in self.marks.items():
            step = self._marked.get(rnd, self._step_of.get(rnd))
            if step is None:
                continue
            self._marked[rnd] = step
            row = rows.setdefault(step, [set(every) for _ in range(self.n_stages)])
            for k, marks in per_stage.items():
                for r, left in marks.items():
                    (row[k].discard if left else row[k].add)(r)
        return {step: {k: sorted(s) for k, s in enumerate(row) if s != every}
                for step, row in sorted(rows.items()) if any(s != every for s in row)}

    def counts(self) -> dict[int, int]:
        """Step -> how many replicas completed it (the fewest any stage summed), for every degraded step."""
        return {step: min(len(s) for s in row.values()) for step, row in self.stages().items()}
