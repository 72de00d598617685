"""The driver's side of a traced run: its own step spans, the stages' clocks, the merged file.

Stages record their actions themselves (:mod:`pipeq.runtime.worker`); this collects them when the run
stops: each stage's clock offset is measured over the control channel when the run starts and
again at the end (:func:`pipeq.trace.format.best_offset`), every stage's rows are fetched, and
:func:`pipeq.trace.format.build` merges them with the driver's "step S" spans into one file.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable

from pipeq.trace import format as trace
from pipeq.wire import control
from pipeq.wire.control import Clock, GetTrace, Time, TraceRows
from pipeq.wire.errors import PeerUnreachable
from pipeq.wire.messages import Kind
from pipeq.control.supervisor import Supervisor

__all__ = ["TraceRecorder"]


class TraceRecorder:
    """The driver's step spans and the stages' clock offsets; merges the stages' rows into one trace."""

    def __init__(self, path: str, schedule: Any, n_stages: int, microbatches: int, replicas: int) -> None:
        self.path = path
        self.meta = trace.TraceMeta(trace.schedule_label(schedule), n_stages, microbatches, replicas=replicas)
        self.n_stages = n_stages
        self.replicas = replicas
        # the driver's step spans, as many as the stages' ring buffers can hold rows for
        self.spans: collections.deque[tuple[int, bool, int, int, int]] = collections.deque(maxlen=trace.MAX_ROWS)
        self.clocks: list[list[trace.ClockSample]] = []

    def span(self, step: int, training: bool, start_ns: int, microbatches: int) -> None:
        """A driver span: the command for ``step`` was sent at ``start_ns``, its result is back."""
        self.spans.append((step, training, start_ns, time.perf_counter_ns(), microbatches))

    def measure_clocks(self, sup: Supervisor, request_id: Callable[[], int], rounds: int = 8) -> None:
        """Each stage's clock offset from ours: the least-delayed of ``rounds`` round trips."""
        first = not self.clocks
        for g in range(sup.n_processes):
            samples = []
            for _ in range(rounds):
                req = request_id()
                t0 = time.perf_counter_ns()
                try:  # sent straight: the round trip is measured
                    sup.server.send(g, control.message(Clock(), req))
                except PeerUnreachable as exc:
                    raise sup.unreachable(exc)
                reply = sup.collect(Kind.TIME, {g: 1}, step=req, what="clock")[g][0]
                t1 = time.perf_counter_ns()
                samples.append((t0, control.read(reply, Time).ns, t1))  # checked as it came (Supervisor)
            sample = trace.best_offset(samples)
            if first:
                self.clocks.append([sample])
            else:
                self.clocks[g].append(sample)

    def fetch(self, sup: Supervisor, request_id: Callable[[], int], hosts: list[str]) -> dict[str, Any]:
        """The merged trace of the run so far (stages' rows on our clock, plus our step spans)."""
        self.measure_clocks(sup, request_id)
        req = request_id()
        n, procs = self.n_stages, sup.n_processes
        sup.send_all([(g, control.message(GetTrace(), req)) for g in range(procs)])
        got = sup.collect(Kind.TRACE, dict.fromkeys(range(procs), 1), step=req, what="trace")
        rows = []
        for g in range(procs):
            try:
                rows.append(trace.check_rows(got[g][0].tensors[0], g % n))
            except (IndexError, ValueError) as exc:
                raise sup.fail(sup.error(f"malformed trace: {exc}", g))
        rows = trace.drop_partial_steps(rows, [control.read(got[g][0], TraceRows).truncated for g in range(procs)])
        first = min((int(t[:, 1].min()) for t in rows if t.numel()), default=0)
        spans = [s for s in self.spans if s[0] >= first]
        merged: dict[str, Any] | None = None
        origin = min((float(sp[2]) for sp in spans), default=None)  # one time axis for all replicas
        for r in range(self.replicas):  # one process (pid) per replica in the trace
            part = slice(r * n, (r + 1) * n)
            one = trace.build(self.meta, rows[part], self.clocks[part], spans if r == 0 else [], replica=r,
                              hosts=hosts[part] if len(set(hosts)) > 1 else None, origin_ns=origin)
            if merged is None:
                merged = one
            else:
                merged["traceEvents"] += one["traceEvents"]
        assert merged is not None
        return merged

    def write(self, merged: dict[str, Any]) -> None:
        trace.write(self.path, merged)
