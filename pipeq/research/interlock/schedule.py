"""Interlocking backpropagation's schedules: ``global``, ``local``, ``pairwise`` and ``nwise`` (distance d).

Stages 0..N-2 own an auxiliary head; L_k is head k's loss, L_{N-1} the real loss. With distance d,
main_k is trained by L_{t(k)}, t(k) = min(k + d, N - 1), and stage k sends down the gradients (with
respect to its input) of the losses the stages below it are trained by. d = 0 is "local" (no
backward messages at all), d = 1 "pairwise", d = N - 1 "global" (plain backprop). Gomez, Key,
Perlin, Gou, Frosst, Dean and Gal, "Interlocking Backpropagation: Improving depthwise
model-parallelism", arXiv 2010.04116 (JMLR 2022).

Pairwise, 4 stages x 4 microbatches: stage k sends its own head's gradient down right after its
forward (sendB after F), so stage k-1's backward waits for stage k's forward only, not for the
stack above; every stage steps as soon as its own backwards are done::

    stage 0 | F0 F1 .  B0 F2 B1 F3 B2 B3 ST
    stage 1 | .  F0 F1 B0 F2 B1 F3 B2 B3 ST
    stage 2 | .  .  F0 F1 B0 F2 B1 F3 B2 B3 ST
    stage 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 ST

Pure: the executor (:mod:`pipeq.research.interlock.executor`) is imported when a stage asks.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from pipeq.schedules.actions import STEP, Schedule, lower_stage
from pipeq.schedules.basic import check_counts, warmup_order
from pipeq.research.interlock.routing import receives, sends_down, sends_early
from pipeq.schedules.protocol import SchedulePolicy

__all__ = ["Interlock", "INTERLOCK"]


class Interlock(SchedulePolicy):
    """An interlocking-backprop schedule: ``global``, ``local``, ``pairwise`` or ``nwise`` (d).

    Its plan is *lowered* (sends and receives included), because where a gradient goes depends
    on the scheme. Stage k warms up with as many forwards as the stages above it its backward
    waits on, plus one (1F1B's N-k when d = N-1), then alternates one backward and one forward;
    STEP ends each stage's list.

        pipeq.research.Interlock("pairwise")
        pipeq.research.Interlock("nwise", distance=2)   # "global", "local", "pairwise" as strings too
    """

    KINDS = ("global", "local", "pairwise", "nwise")
    plain_backprop = False
    takes_aux_heads = True

    def __init__(self, kind: str, distance: int | None = None) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"interlocking scheme {kind!r} is not one of {self.KINDS}")
        if kind == "nwise":
            if type(distance) is not int or distance < 1:
                raise ValueError(
                    f"Interlock('nwise') needs distance=d, an integer >= 1, got {distance!r}: "
                    "e.g. pipeq.research.Interlock('nwise', distance=2)"
                )
        elif distance is not None:
            raise ValueError(f"distance applies to Interlock('nwise') only, not {kind!r}")
        self.kind = kind
        self._distance = distance
        self.option_names = ("distance",) if kind == "nwise" else ()  # type: ignore[misc]

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"nwise(d={self._distance})" if self.kind == "nwise" else self.kind

    @classmethod
    def from_label(cls, label: str) -> "Interlock | None":
        m = re.fullmatch(r"nwise\(d=(\d+)\)", label)
        if m:
            return cls("nwise", distance=int(m.group(1)))
        return cls(label) if label in cls.KINDS[:3] else None

    def distance(self, n_stages: int) -> int:
        if self.kind == "global":
            return n_stages - 1
        if self.kind == "local":
            return 0
        if self.kind == "pairwise":
            return 1
        return min(int(self._distance or 1), n_stages - 1)

    @property
    def options(self) -> dict[str, int | None]:
        """The options given besides the scheme (plain data: two runs compare them)."""
        return {"distance": self._distance} if self.kind == "nwise" else {}

    def with_options(self, **options: Any) -> "Interlock":
        return Interlock(self.kind, **options) if options else self

    def __repr__(self) -> str:
        return f"Interlock({self.name!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Interlock) and (self.kind, self._distance) == (other.kind, other._distance)

    def __hash__(self) -> int:
        return hash((self.kind, self._distance))

    def plan(self, n_stages: int, n_microbatches: int) -> Schedule:
        check_counts(n_stages, n_microbatches)
        n, m, d = n_stages, n_microbatches, self.distance(n_stages)
        # how many stages above stage k its backward waits on (its gradients come in one message
        # per microbatch, sent after the backward of the stage above unless that one sends early)
        depth = [0] * n
        for k in range(n - 2, -1, -1):
            if receives(k, n, d):
                depth[k] = 1 if sends_early(k + 1, n, d) else 1 + depth[k + 1]
        out = []
        for k in range(n):
            early = sends_early(k, n, d)
            order = warmup_order(m, depth[k] + 1) + [STEP]
            out.append(lower_stage(order, recv_act=k > 0, send_act=k < n - 1,
                                   recv_grad=bool(receives(k, n, d)), send_grad=bool(sends_down(k, n, d)),
                                   grad_after_forward=early))
        return out

    def loss_stages(self, n_stages: int) -> list[int]:
        """Every stage: each computes its auxiliary head's loss (the last, the real one)."""
        return list(range(n_stages))

    def executor(self, index: int, n_stages: int, spec: Any, device: Any) -> Any:
        from pipeq.research.interlock.executor import InterlockExecutor

        return InterlockExecutor(index, n_stages, spec, device, self)

    def check_heads(self, n_stages: int, heads: Sequence[Any] | None, aux_loss: Any, hint: str) -> None:
        if heads is None and self.distance(n_stages) < n_stages - 1:
            raise ValueError(f"schedule {self.name!r} trains with auxiliary heads: {hint}")


#: The interlocking schemes by name.
INTERLOCK = Interlock.KINDS
