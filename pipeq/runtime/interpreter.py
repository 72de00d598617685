"""Runs one stage process's lowered action list against the executors of the stages it holds.

A process holds ``v >= 1`` stages, its chunks (v > 1 with virtual stages:
:mod:`pipeq.schedules.placement`), and the schedule gives it one list of actions, each naming
its ``chunk``. :func:`execute` is a generator: compute actions run inline on the chunk's
:class:`~pipeq.stage.executor.StageExecutor`, and everything that needs another process is
*yielded* as a typed request (:mod:`pipeq.runtime.requests`) for the caller to carry out. The
worker's event loop answers requests with its transport; the simulated engine answers them from
in-memory queues and switches to another process when a message is not there yet. One
interpreter, so both modes, and one stage or several per process, run the very same actions in
the very same order.

- A message between two stages of this process (V placement's turn, stage N-1 to stage N) is
  handed over here, in memory: no request, no copy (the receiving stage detaches it, as always).
- A split backward's ``I j`` and ``W j`` (zero-bubble schedules) run inline like a ``B``: ``I``
  yields nothing itself (its gradient goes out with the ``SEND_GRAD`` that follows it), ``W``
  never communicates.
- A ``SEND_GRAD`` right after a forward (interlocking backpropagation) sends the stage's early
  input gradients; a backward in evaluation (Associated Learning's decode path) ends on stage 0
  with an :class:`~pipeq.runtime.requests.Emit`.
- A run of consecutive ``STEP`` actions (one per chunk: a process's last actions) runs as one
  optimizer step of those chunks (with one stage per process, every ``STEP`` is one step; a
  schedule may step after every microbatch, as Associated Learning does):

  1. with data parallelism the replicas' gradients are summed first (each executor's);
  2. tied weights (:mod:`pipeq.stage.ties`): the stages holding a copy swap their gradients and
     each adds all of them in stage order; between chunks of this process in memory, with
     other processes through one :class:`~pipeq.runtime.requests.SwapTies` that sends
     everything before it waits for anything;
  3. when the stages must agree before an optimizer step (clipping by the global norm, fp16's
     found-inf, ``check_finite``: see :mod:`pipeq.stage.numerics`), their statistics go up
     the pipeline chain in stage order as microbatch ``STATS`` on the data channels (received
     from stage k-1 as an activation, combined, sent on) and the total comes back down as a
     gradient (:func:`combined`).

  Every process reaches its ``STEP`` only after its last send of the step, so neither exchange
  can deadlock a validated schedule.

A failure of an action in a process of several stages is raised as a :class:`ChunkError` naming
the stage and chunk; with one stage, as it is.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Generator, Mapping, NamedTuple, Sequence

from pipeq import schedules
from pipeq.errors import StageComputeError, error_line
from pipeq.runtime.requests import STATS, Emit, Recv, Request, Send, SwapTies
from pipeq.schedules import Action, Op, lower_stage
from pipeq.stage.executor import StageExecutor, Tensors
from pipeq.stage.numerics import StepStats, combine
from pipeq.trace.format import CODE_OF_OP
from pipeq.trace.format import I as TRACE_I
from pipeq.trace.format import OPT_STEP as TRACE_OPT_STEP
from pipeq.trace.format import W as TRACE_W
from pipeq.wire.errors import Stopped

__all__ = ["ChunkBatch", "ProcessPlan", "execute", "on_chunk", "chunk_error", "combined", "ChunkError", "Note"]

#: ``note(code, microbatch, chunk)``: a compute action starts on a chunk (the event loop's record
#: for ``step_timeout``)
Note = Callable[[int, int, int], None]
Keys = Mapping[int, tuple[int, int]]


class ChunkError(StageComputeError):
    """An action of stage ``stage`` (chunk ``chunk`` of its process) failed; the cause is chained."""

    def __init__(self, stage: int, chunk: int, exc: BaseException) -> None:
        super().__init__(f"stage {stage} (chunk {chunk} of its process): {error_line(exc)}")
        self.stage, self.chunk = stage, chunk


class ChunkBatch(NamedTuple):
    """A chunk's part of a batch: ``x`` (stage 0), the ``target`` (a stage that computes a loss),
    the microbatches' loss ``weights`` and ``aux_weights``, and its stage ``inputs`` (keyword
    arguments of its forward); each None when the stage has none."""

    x: Any = None
    target: Any = None
    weights: Any = None
    aux_weights: Any = None
    inputs: Any = None


class ProcessPlan:
    """Which actions process ``process`` (of a run of ``n_stages`` model stages) runs for each
    batch it is given: the schedule's validated plan of one batch, or, for a schedule that
    streams across batches (asynchronous 1F1B), the next stretch of the process's stream (the
    schedule's :meth:`~pipeq.schedules.SchedulePolicy.cursor`: microbatches numbered across
    batches, no drain between them unless asked). Shared by the event loop and the simulated
    engine, so both run the same actions."""

    def __init__(self, schedule: Any, process: int, n_stages: int) -> None:
        self.schedule = schedule = schedules.resolve(schedule)
        self.process = process
        self.n_stages = n_stages
        self._plans: dict[tuple[int, bool], list[Action]] = {}
        self._split: dict[tuple[int, bool], set[int]] = {}  # the chunks whose backward the plan splits
        self.cursor = schedule.cursor(process, n_stages) if schedule.streams_across_batches else None
        self.keys: dict[int, tuple[int, int]] = {}  # stream microbatch -> (step, microbatch) on the wire

    def actions(self, m: int, training: bool) -> list[Action]:
        key = (m, training)
        acts = self._plans.get(key)
        if acts is None:
            acts = self._plans[key] = schedules.build(self.schedule, self.n_stages, m, training=training)[self.process]
            self._split[key] = {a.chunk for a in acts if a.op is Op.INPUT_GRAD}
        return acts

    def begin(self, exs: Sequence[StageExecutor], step: int, sizes: list[int], training: bool,
              parts: Sequence[ChunkBatch], stream: bool = False) -> tuple[list[Action], Keys | None]:
        """Start batch ``step`` on every chunk's executor (``parts[c]``: chunk c's part of it):
        the actions, and (a stream) the wire key of each microbatch number they use (None:
        microbatch j of this step is ``(step, j)``). An executor that predates ``inputs`` is
        never handed the argument when there are none."""
        if not (training and self.cursor is not None):
            for c, (ex, part) in enumerate(zip(exs, parts)):
                more = {"inputs": part.inputs} if part.inputs is not None else {}
                on_chunk(exs, c, ex.begin, step, sizes, training, part.x, part.target, part.weights,
                         aux_weights=part.aux_weights, **more)
            acts = self.actions(len(sizes), training)
            split = self._split[(len(sizes), training)]
            for c, ex in enumerate(exs):  # what an I frees (pipeq.stage.memory; a compiled stage's I is its B)
                ex.memory.split(training and c in split and ex.compile_watch is None)
            return acts, None
        (ex,), (part,) = exs, parts  # a schedule that streams holds one stage per process
        done = [g for g in self.keys if g < self.cursor.next_b]
        for g in done:
            del self.keys[g]
        first = self.cursor.add(len(sizes))
        self.keys.update({first + j: (step, j) for j in range(len(sizes))})
        more = {"inputs": part.inputs} if part.inputs is not None else {}
        ex.extend(step, first, sizes, part.x, part.target, **more)  # type: ignore[attr-defined]
        return self._lower(self.cursor.take(drain=not stream)), self.keys

    def drain(self) -> list[Action]:
        """A stream's leftover work (asynchronous 1F1B's last backwards); nothing otherwise."""
        return self._lower(self.cursor.take(drain=True)) if self.cursor is not None else []

    def _lower(self, acts: list[Action]) -> list[Action]:
        k, n = self.process, self.n_stages
        return lower_stage(acts, recv_act=k > 0, send_act=k < n - 1, recv_grad=k < n - 1, send_grad=k > 0)


def chunk_error(exc: BaseException, n_chunks: int, stage: int, c: int) -> ChunkError | None:
    """What ``exc``, raised by stage ``stage`` (chunk ``c``) of a process of ``n_chunks`` stages,
    is raised as: a :class:`ChunkError` naming the stage, or None when it goes as it is (one stage
    per process, a ChunkError already, the driver's EXIT: :class:`~pipeq.wire.errors.Stopped`)."""
    if n_chunks == 1 or isinstance(exc, (ChunkError, Stopped)) or not isinstance(exc, Exception):
        return None
    return ChunkError(stage, c, exc)


def on_chunk(exs: Sequence[StageExecutor], c: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` for chunk ``c`` of a process holding the stages ``exs``, a failure
    raised as :func:`chunk_error` says."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        err = chunk_error(exc, len(exs), exs[c].index, c)
        if err is None:
            raise
        raise err from exc


def execute(exs: Sequence[StageExecutor], actions: Sequence[Action], traces: Sequence[Any] | None = None,
            keys: Keys | None = None, note: Note | None = None) -> Generator[Request, Any, None]:
    """Run a process's ``actions`` on its chunks' executors ``exs`` (by chunk; see the module).
    ``traces``: per chunk, a list or deque to append ``(code, step, microbatch, start_ns, end_ns,
    0)`` to for each compute action (see :mod:`pipeq.trace`), or None; ``keys`` maps a stream's
    microbatch numbers to their (step, microbatch); ``note(code, microbatch, chunk)`` is called
    as each compute action starts."""
    run = _Process(exs, traces, keys, note)
    i, n = 0, len(actions)
    compute, split = run.compute, run.split_backward  # (the hot path: one call per action)
    while i < n:
        a = actions[i]
        op = a.op
        end = i + 1
        try:
            if op is Op.STEP:  # the run of STEPs this one starts: taken together
                while end < n and actions[end].op is Op.STEP:
                    end += 1
                yield from run.step([b.chunk for b in actions[i:end]])
            elif op is Op.INPUT_GRAD or op is Op.WEIGHT_GRAD:  # a split backward: after F and B, which stay lean
                split(op, a.microbatch, a.chunk)
            else:
                req = compute(op, a.microbatch, a.chunk) if op is Op.FORWARD or op is Op.BACKWARD else run.act(a)
                if req is not None:
                    got = yield req
                    if type(req) is Recv:
                        run.file(req, got)
        except Exception as exc:
            err = chunk_error(exc, len(exs), exs[a.chunk].index, a.chunk)
            if err is None:
                raise
            raise err from exc
        i = end


class _Process:
    """The messages a process's chunks have in hand (by chunk) while its actions run."""

    def __init__(self, exs: Sequence[StageExecutor], traces: Sequence[Any] | None, keys: Keys | None,
                 note: Note | None) -> None:
        self.exs, self.keys, self.note = exs, keys, note
        at = {ex.index: c for c, ex in enumerate(exs)}
        #: per chunk, the chunk of this process holding the next stage and the previous one
        self.nxt = [at.get(ex.index + 1) for ex in exs]
        self.prv = [at.get(ex.index - 1) for ex in exs]
        n = len(exs)
        self.received: list[dict[int, Any]] = [{} for _ in range(n)]
        self.grads: list[dict[int, Tensors]] = [{} for _ in range(n)]
        self.acts_out: list[dict[int, Any]] = [{} for _ in range(n)]
        self.grads_out: list[dict[int, Tensors]] = [{} for _ in range(n)]
        self.recs = ([t.append if t is not None else None for t in traces] if traces is not None else [None] * n)

    def _key(self, ex: StageExecutor, j: int) -> tuple[int, int]:
        return self.keys[j] if self.keys is not None else (ex.step_index, j)

    def act(self, a: Action) -> Request | None:
        """Run one communication action (a receive, a send); the request it needs carried out,
        if any (a receive's answer is handed to :meth:`file`)."""
        op, j, c = a.op, a.microbatch, a.chunk
        ex = self.exs[c]
        if op is Op.RECV_ACT or op is Op.RECV_GRAD:
            local, box = (self.prv, self.received) if op is Op.RECV_ACT else (self.nxt, self.grads)
            if local[c] is None:
                return Recv(op, c, j)
            if j not in box[c]:  # cannot happen in a dry-run plan
                raise RuntimeError(f"microbatch {j}'s message from stage {self.exs[local[c]].index} "  # type: ignore[index]
                                   "was not handed over yet")
            return None
        if op is Op.SEND_ACT or op is Op.SEND_GRAD:
            if op is Op.SEND_ACT:
                out, to, box = self.acts_out[c].pop(j), self.nxt[c], self.received
            else:  # after its backward; or (interlocking) right after its forward: the head's gradient
                out, to, box = self.grads_out[c].pop(j, None), self.prv[c], self.grads
                if out is None:
                    out = ex.early_input_grads(j)
            if to is None:
                return Send(op, c, j, ex.for_peer(out))
            box[to][j] = out  # in memory: the receiving stage detaches it as it would a message
            return None
        raise ValueError(f"stage {ex.index}: cannot execute action {a}")  # (schedules are validated before)

    def file(self, req: Recv, tensors: Any) -> None:
        """What the receive ``req`` got, kept for the compute action that takes it."""
        box = self.received if req.op is Op.RECV_ACT else self.grads
        box[req.chunk][req.microbatch] = tensors

    def compute(self, op: Op, j: int, c: int) -> Emit | None:
        """``F j`` or ``B j`` on chunk ``c``, traced; its output kept for the send that follows
        (or emitted: the last stage's forward-only output, the end of a decode path)."""
        ex, rec, note = self.exs[c], self.recs[c], self.note
        code = CODE_OF_OP[op]
        if note is not None:
            note(code, j, c)
        t0 = time.perf_counter_ns() if rec else 0
        if op is Op.FORWARD:
            out = ex.forward(j, self.received[c].pop(j, None))
        else:
            out = ex.backward(j, self.grads[c].pop(j, None))
        if rec:
            rec((code, *self._key(ex, j), t0, time.perf_counter_ns(), 0))
        if op is Op.BACKWARD and ex.training:
            ex.backward_done()
        if out is None:
            return None
        if op is Op.FORWARD:
            if ex.is_last:
                return Emit(c, j, ex.to_host(out))
            self.acts_out[c][j] = out
        elif ex.is_first and not ex.training:  # a decode path (AL) ends here: the output
            return Emit(c, j, ex.to_host(out))
        else:
            self.grads_out[c][j] = out
        return None

    def split_backward(self, op: Op, j: int, c: int) -> None:
        """``I j`` (the input gradient, to send back as a ``B``'s) or ``W j`` (the weight
        gradients; after the step's last one, the data-parallel all-reduce starts), traced like a ``B``."""
        ex, rec, note = self.exs[c], self.recs[c], self.note
        code = CODE_OF_OP[op]
        if note is not None:
            note(code, j, c)
        t0 = time.perf_counter_ns() if rec else 0
        if code == TRACE_I:
            gin = ex.input_grad(j, self.grads[c].pop(j, None))
            if gin is not None:
                self.grads_out[c][j] = gin
        else:
            ex.weight_grad(j)
        if rec:
            rec((code, *self._key(ex, j), t0, time.perf_counter_ns(), 0))
        if code == TRACE_W:
            ex.backward_done()

    def step(self, chunks: Sequence[int]) -> Generator[Request, Any, None]:
        """The optimizer step of ``chunks`` (every chunk of the process, in a plan of several),
        taken in stage order whatever the order of their STEP actions: the replicas' sums, tied
        weights, statistics (see the module). A chunk's failure names its stage."""
        all_exs = self.exs
        chunks = sorted(chunks, key=lambda c: all_exs[c].index)  # (the statistics go up the chain in it)
        exs = [all_exs[c] for c in chunks]
        if self.note is not None:
            self.note(TRACE_OPT_STEP, -1, chunks[0])
        t0 = time.perf_counter_ns()
        tied = [c for c in chunks if all_exs[c].tied is not None]
        if tied:
            for c in tied:  # the replicas first, then the stages holding a copy
                on_chunk(all_exs, c, all_exs[c].sync_replicas)
            yield from self._swap_ties(tied)
        if exs[0].numerics.combines:
            at = {ex.index: i for i, ex in enumerate(exs)}
            nxt, prv = [at.get(ex.index + 1) for ex in exs], [at.get(ex.index - 1) for ex in exs]
            owns = [on_chunk(all_exs, c, all_exs[c].step_stats) for c in chunks]
            total = yield from combined(exs, owns, nxt, prv, chunks)
            for c in chunks:
                on_chunk(all_exs, c, all_exs[c].apply_step, total)
        else:
            for c in chunks:
                on_chunk(all_exs, c, all_exs[c].optimizer_step)
        t1 = time.perf_counter_ns()
        for c in chunks:
            rec = self.recs[c]
            if rec:
                rec((TRACE_OPT_STEP, self.exs[c].step_index, -1, t0, t1, 0))

    def _swap_ties(self, tied: list[int]) -> Generator[Request, Any, None]:
        """Each tied chunk's gradients of its tied weights, summed with every other copy's: the
        copies held by this process's chunks handed over in memory (as copies: each stage adds
        into one of the parts it received), the others' through one :class:`SwapTies`."""
        exs = self.exs
        held = {ex.index: c for c, ex in enumerate(exs)}
        for c in tied:  # which piece of each tie the process's other chunks hold (once)
            mine = exs[c].tied
            for peer in mine.peers:  # type: ignore[union-attr]
                if peer in held and peer not in mine.theirs:  # type: ignore[union-attr]
                    mine.learn(peer, exs[held[peer]].tied.pieces())  # type: ignore[union-attr]
        outgoing = {c: on_chunk(exs, c, exs[c].tied.outgoing) for c in tied}  # type: ignore[union-attr]
        got: dict[int, dict[int, Any]] = {c: {} for c in tied}
        remote: dict[int, dict[int, Any]] = {}
        for c in tied:
            for peer, tensors in outgoing[c].items():
                d = held.get(peer)
                if d is None:
                    remote.setdefault(c, {})[peer] = tensors
                else:
                    got[d][exs[c].index] = [t.detach().clone() for t in tensors]
        if remote:
            answer = yield SwapTies(remote, exs[tied[0]].tied.rounds)  # type: ignore[union-attr]
            for c, by_peer in answer.items():
                got[c].update(by_peer)
        for c in tied:
            on_chunk(exs, c, exs[c].tied.add, got[c])  # type: ignore[union-attr]


def combined(exs: Sequence[StageExecutor], owns: Sequence[StepStats], nxt: Sequence[int | None],
             prv: Sequence[int | None], chunks: Sequence[int] | None = None) -> Generator[Request, Any, StepStats]:
    """Every stage's statistics combined: up the chain 0 -> S-1 through this process's stages
    ``exs`` in stage order (``nxt``, ``prv``: the position in ``exs`` of the next and previous
    stage, None when another process holds it; ``chunks``: each one's chunk, default its
    position), then the total back down in reverse order (hops within the process in memory)."""
    chunks = list(range(len(exs))) if chunks is None else chunks
    n, p = exs[0].n_stages, exs[0].numerics.clip_norm_type
    up: dict[int, StepStats] = {}
    total: StepStats | None = None
    for c, ex in enumerate(exs):  # a process's chunks hold increasing stages (looped and V alike)
        k, acc = ex.index, owns[c]
        if k > 0:
            got = up.pop(c) if prv[c] is not None else StepStats.from_tensors(
                (yield Recv(Op.RECV_ACT, chunks[c], STATS)), f"stage {k - 1}")
            acc = combine(got, acc, p)
        if k == n - 1:
            total = acc
        elif nxt[c] is not None:
            up[nxt[c]] = acc  # type: ignore[index]
        else:
            yield Send(Op.SEND_ACT, chunks[c], STATS, (acc.to_tensor(),))
    down: dict[int, StepStats] = {}
    for c in reversed(range(len(exs))):
        k = exs[c].index
        if k < n - 1:
            total = down.pop(c) if nxt[c] is not None else StepStats.from_tensors(
                (yield Recv(Op.RECV_GRAD, chunks[c], STATS)), f"stage {k + 1}")
        assert total is not None
        if k > 0:
            if prv[c] is not None:
                down[prv[c]] = total  # type: ignore[index]
            else:
                yield Send(Op.SEND_GRAD, chunks[c], STATS, (total.to_tensor(),))
    assert total is not None
    return total
