"""One process, several stages (virtual stages): their actions run in the process's one order.

A schedule of v stages per process (:mod:`pipeq.schedules.placement`) gives each process one
lowered list whose actions name their ``chunk``. :func:`execute_chunks` runs it against the
chunks' executors like :func:`pipeq.runtime.interpreter.execute` runs one stage's, with three
differences:

- every request ends with the chunk it is for (the caller picks that chunk's channels);
- a message between two stages of this process (V placement's turn, stage N-1 to stage N) is
  handed over here, in memory: no socket, no copy (the receiving stage detaches it, as always);
- the process's STEPs (one per chunk, last) run as one: the stages' statistics (clipping's norm,
  fp16's found-inf, check_finite) go up the pipeline chain in stage order and come back down
  (:func:`combined`), so that a process holding an early and a late stage never waits on itself.

Requests: ``(Op.RECV_ACT | Op.RECV_GRAD, j, c)``; ``(Op.SEND_ACT | Op.SEND_GRAD | EMIT, j,
tensors, c)``. Tied weights are refused with several stages per process (before any process starts).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Generator, Mapping, Sequence

from pipeq.errors import error_line
from pipeq.runtime.interpreter import EMIT, STATS, Request, _split_backward
from pipeq.schedules import Action, Op
from pipeq.stage.executor import StageExecutor, Tensors
from pipeq.stage.numerics import StepStats, combine
from pipeq.trace.format import B as TRACE_B
from pipeq.trace.format import F as TRACE_F
from pipeq.trace.format import OPT_STEP as TRACE_OPT_STEP

__all__ = ["execute_chunks", "combined", "ChunkError"]

Note = Callable[[int, int], None]


class ChunkError(RuntimeError):
    """An action of stage ``stage`` (chunk ``chunk`` of its process) failed; the cause is chained."""

    def __init__(self, stage: int, chunk: int, exc: BaseException) -> None:
        super().__init__(f"stage {stage} (chunk {chunk} of its process): {error_line(exc)}")
        self.stage, self.chunk = stage, chunk


def _neighbours(exs: Sequence[StageExecutor]) -> tuple[list[int | None], list[int | None]]:
    """For each chunk, the chunk of this process holding the next stage and the previous one."""
    at = {ex.index: c for c, ex in enumerate(exs)}
    return [at.get(ex.index + 1) for ex in exs], [at.get(ex.index - 1) for ex in exs]


def execute_chunks(
    exs: Sequence[StageExecutor], actions: Sequence[Action], traces: Sequence[Any] | None = None,
    keys: Mapping[int, tuple[int, int]] | None = None, note: Note | None = None,
) -> Generator[Request, Any, None]:
    """Run a process's ``actions`` on its chunks' executors ``exs`` (by chunk); ``traces``: one
    trace (list or deque) per chunk, or None (see the module docstring). A failure is raised as
    a :class:`ChunkError` naming the stage and chunk."""
    run = _Chunks(exs, traces, keys, note)
    for a in actions:
        try:
            yield from run.act(a)
        except ChunkError:
            raise
        except Exception as exc:
            raise ChunkError(exs[a.chunk].index, a.chunk, exc) from exc


class _Chunks:
    """The messages a process's chunks have in hand (by chunk) while its actions run."""

    def __init__(self, exs: Sequence[StageExecutor], traces: Sequence[Any] | None,
                 keys: Mapping[int, tuple[int, int]] | None, note: Note | None) -> None:
        self.exs, self.keys, self.note = exs, keys, note
        self.nxt, self.prv = _neighbours(exs)
        n = len(exs)
        self.received: list[dict[int, Any]] = [{} for _ in range(n)]
        self.grads: list[dict[int, Tensors]] = [{} for _ in range(n)]
        self.acts_out: list[dict[int, Any]] = [{} for _ in range(n)]
        self.grads_out: list[dict[int, Tensors]] = [{} for _ in range(n)]
        self.recs = [t.append if t is not None else None for t in traces] if traces is not None else [None] * n
        self.stepped = False

    def _key(self, ex: StageExecutor, j: int) -> tuple[int, int]:
        return self.keys[j] if self.keys is not None else (ex.step_index, j)

    def act(self, a: Action) -> Generator[Request, Any, None]:
        """Run one action (the requests it needs yielded)."""
        op, j, c = a.op, a.microbatch, a.chunk
        ex, rec, note = self.exs[c], self.recs[c], self.note
        if op is Op.FORWARD or op is Op.BACKWARD:
            code = TRACE_F if op is Op.FORWARD else TRACE_B
            if note is not None:
                note(code, j)
            t0 = time.perf_counter_ns() if rec else 0
            if op is Op.FORWARD:
                out = ex.forward(j, self.received[c].pop(j, None))
            else:
                out = ex.backward(j, self.grads[c].pop(j, None))
                ex.backward_done()
            if rec:
                rec((code, *self._key(ex, j), t0, time.perf_counter_ns(), 0))
            if out is not None:
                if op is Op.BACKWARD:
                    self.grads_out[c][j] = out
                elif ex.is_last:
                    yield (EMIT, j, ex.to_host(out), c)
                else:
                    self.acts_out[c][j] = out
        elif op is Op.RECV_ACT or op is Op.RECV_GRAD:
            local, box = (self.prv, self.received) if op is Op.RECV_ACT else (self.nxt, self.grads)
            if local[c] is None:
                box[c][j] = yield (op, j, c)
            elif j not in box[c]:  # cannot happen in a dry-run plan
                raise RuntimeError(f"microbatch {j}'s message from stage {self.exs[local[c]].index} "  # type: ignore[index]
                                   "was not handed over yet")
        elif op is Op.SEND_ACT or op is Op.SEND_GRAD:
            out, to, box = ((self.acts_out[c].pop(j), self.nxt[c], self.received) if op is Op.SEND_ACT
                            else (self.grads_out[c].pop(j), self.prv[c], self.grads))
            if to is None:
                yield (op, j, ex.for_peer(out), c)
            else:  # in memory: the receiving stage detaches it as it would a message
                box[to][j] = out
        elif op is Op.STEP:
            if not self.stepped:  # the process's STEPs (one per chunk, last) are taken together
                self.stepped = True
                yield from _step_all(self.exs, self.recs, note, self.nxt, self.prv)
        elif op is Op.INPUT_GRAD or op is Op.WEIGHT_GRAD:
            _split_backward(ex, op, j, self.grads[c], self.grads_out[c], rec, self.keys, note)
        else:  # pragma: no cover - schedules are validated before they reach here
            raise ValueError(f"stage {ex.index}: cannot execute action {a}")


def _step_all(exs: Sequence[StageExecutor], recs: list[Any], note: Note | None,
              nxt: list[int | None], prv: list[int | None]) -> Generator[Request, Any, None]:
    """Every chunk's optimizer step, their statistics combined with the other stages' first."""
    if note is not None:
        note(TRACE_OPT_STEP, -1)
    t0 = time.perf_counter_ns()
    if exs[0].numerics.combines:
        total = yield from combined(exs, [ex.step_stats() for ex in exs], nxt, prv)
        for ex in exs:
            ex.apply_step(total)
    else:
        for ex in exs:
            ex.optimizer_step()
    t1 = time.perf_counter_ns()
    for ex, rec in zip(exs, recs):
        if rec:
            rec((TRACE_OPT_STEP, ex.step_index, -1, t0, t1, 0))


def combined(exs: Sequence[StageExecutor], owns: Sequence[StepStats], nxt: list[int | None],
             prv: list[int | None]) -> Generator[Request, Any, StepStats]:
    """Every stage's statistics combined: up the chain 0 -> S-1 through this process's chunks in
    stage order, then the total back down in reverse order (hops within the process in memory)."""
    n, p = exs[0].n_stages, exs[0].numerics.clip_norm_type
    up: dict[int, StepStats] = {}
    total: StepStats | None = None
    for c, ex in enumerate(exs):  # a process's chunks hold increasing stages (looped and V alike)
        k, acc = ex.index, owns[c]
        if k > 0:
            got = up.pop(c) if prv[c] is not None else StepStats.from_tensors(
                (yield (Op.RECV_ACT, STATS, c)), f"stage {k - 1}")
            acc = combine(got, acc, p)
        if k == n - 1:
            total = acc
        elif nxt[c] is not None:
            up[nxt[c]] = acc  # type: ignore[index]
        else:
            yield (Op.SEND_ACT, STATS, (acc.to_tensor(),), c)
    down: dict[int, StepStats] = {}
    for c in reversed(range(len(exs))):
        k = exs[c].index
        if k < n - 1:
            total = down.pop(c) if nxt[c] is not None else StepStats.from_tensors(
                (yield (Op.RECV_GRAD, STATS, c)), f"stage {k + 1}")
        assert total is not None
        if k > 0:
            if prv[c] is not None:
                down[prv[c]] = total  # type: ignore[index]
            else:
                yield (Op.SEND_GRAD, STATS, (total.to_tensor(),), c)
    assert total is not None
    return total
