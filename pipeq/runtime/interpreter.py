"""Runs one stage's lowered action list against its :class:`~pipeq.stage.executor.StageExecutor`.

:func:`execute` is a generator: compute actions run inline, and each communication action is
*yielded* as a request for the caller to carry out. The worker event loop answers requests with
blocking socket operations; the simulated engine answers them from in-memory queues and switches
to another stage when a message is not there yet. One interpreter, so both modes run the very same
actions in the very same order.

A split backward's ``I j`` and ``W j`` (zero-bubble schedules) run inline like a ``B``: ``I``
yields nothing itself (its gradient goes out with the ``SEND_GRAD`` that follows it), ``W`` never
communicates.

Requests (first element an :class:`~pipeq.schedules.Op`, or ``EMIT``)::

    (Op.RECV_ACT, j)            -> caller sends back the received activation tensors
    (Op.RECV_GRAD, j)           -> caller sends back the received gradient tensors
    (Op.SEND_ACT, j, tensors)   -> caller sends them to the next stage
    (Op.SEND_GRAD, j, tensors)  -> caller sends them to the previous stage
    (EMIT, j, tensors)          -> a forward-only result (the last stage's output, or the end
                                   of a decode path on stage 0): the caller returns it
    (TIES, STATS, outgoing, n)  -> tied weights' exchange number n (counted from 1 alike on every
                                   stage): ``outgoing[s]`` goes to stage s (the caller sends copies);
                                   the caller sends back ``{s: tensors}``, every peer's

Tensors that belong to a tree (a stage output that is not a tensor or a tuple of tensors) come
as a :class:`pipeq.stage.microbatch.Packed`, whose ``spec`` the caller sends with them.

When the stages must agree before an optimizer step (clipping by the global norm, fp16's
found-inf, ``check_finite``: see :mod:`pipeq.stage.numerics`), ``STEP`` first combines the stages'
statistics along the pipeline, as microbatch :data:`STATS` on the same channels: received from
stage k-1 (``RECV_ACT``), combined and sent on (``SEND_ACT``); the total comes back from the last
stage (``RECV_GRAD``) and is passed down (``SEND_GRAD``). Every stage reaches its ``STEP`` only
after its last send of the step, so this cannot deadlock a validated schedule.

A stage holding tied weights (:mod:`pipeq.stage.ties`) first sums their gradients with the other
stages holding a copy (``TIES``), after the replicas' all-reduce: every stage reaches its ``STEP``
without waiting for another's, so neither can that.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Generator, Mapping, Sequence

from pipeq import schedules
from pipeq.schedules import Action, Op, lower_stage
from pipeq.stage.numerics import StepStats, combine
from pipeq.stage.executor import StageExecutor, Tensors
from pipeq.trace.format import B as TRACE_B
from pipeq.trace.format import F as TRACE_F
from pipeq.trace.format import I as TRACE_I
from pipeq.trace.format import W as TRACE_W
from pipeq.trace.format import OPT_STEP as TRACE_OPT_STEP

EMIT = "emit"
TIES = "ties"  # the request that swaps tied weights' gradients (see the module docstring)
STATS = -2  # the microbatch number of the step statistics' messages (never a real microbatch)

Request = tuple[Any, ...]


class StagePlan:
    """Which actions one stage runs for each batch it is given: the schedule's validated plan of
    one batch, or, for a schedule that streams across batches (asynchronous 1F1B), the next stretch
    of the stage's stream (the schedule's :meth:`~pipeq.schedules.SchedulePolicy.cursor`:
    microbatches numbered across batches, no drain between them unless asked). Shared by the
    worker and the simulated engine, so both run the same actions."""

    def __init__(self, schedule: Any, stage: int, n_stages: int) -> None:
        self.schedule = schedule = schedules.resolve(schedule)
        self.stage = stage
        self.n_stages = n_stages
        self._plans: dict[tuple[int, bool], list[Action]] = {}
        self.cursor = schedule.cursor(stage, n_stages) if schedule.streams_across_batches else None
        self.keys: dict[int, tuple[int, int]] = {}  # stream microbatch -> (step, microbatch) on the wire

    def actions(self, m: int, training: bool) -> list[Action]:
        key = (m, training)
        acts = self._plans.get(key)
        if acts is None:
            acts = self._plans[key] = schedules.build(self.schedule, self.n_stages, m, training=training)[self.stage]
        return acts

    def begin(self, ex: StageExecutor, step: int, sizes: list[int], training: bool, x: Any, target: Any,
              weights: Any = None, aux_weights: Any = None, stream: bool = False, inputs: Any = None,
              ) -> tuple[list[Action], Mapping[int, tuple[int, int]] | None]:
        """Start batch ``step`` on ``ex``: its actions, and (a stream) the wire key of each
        microbatch number they use (None: microbatch j of this step is ``(step, j)``). ``inputs``:
        the stage's keyword arguments for this batch (``stage_inputs``), None without (an executor
        that predates them is never handed the argument then)."""
        more = {"inputs": inputs} if inputs is not None else {}
        if not (training and self.cursor is not None):
            ex.begin(step, sizes, training, x, target, weights, aux_weights=aux_weights, **more)
            return self.actions(len(sizes), training), None
        done = [g for g in self.keys if g < self.cursor.next_b]
        for g in done:
            del self.keys[g]
        first = self.cursor.add(len(sizes))
        self.keys.update({first + j: (step, j) for j in range(len(sizes))})
        ex.extend(step, first, sizes, x, target, **more)  # type: ignore[attr-defined]  (a streaming schedule's)
        return self._lower(self.cursor.take(drain=not stream)), self.keys

    def drain(self) -> list[Action]:
        """A stream's leftover work (asynchronous 1F1B's last backwards); nothing otherwise."""
        return self._lower(self.cursor.take(drain=True)) if self.cursor is not None else []

    def _lower(self, acts: list[Action]) -> list[Action]:
        k, n = self.stage, self.n_stages
        return lower_stage(acts, recv_act=k > 0, send_act=k < n - 1, recv_grad=k < n - 1, send_grad=k > 0)


def execute(
    ex: StageExecutor, actions: Sequence[Action], trace: Any = None,
    keys: Mapping[int, tuple[int, int]] | None = None, note: Callable[[int, int], None] | None = None,
) -> Generator[Request, Any, None]:
    """Run ``actions``; with ``trace`` (a list or deque), append ``(code, step, microbatch, start_ns,
    end_ns, 0)`` for each compute action (see :mod:`pipeq.trace`; ``keys`` maps a stream's
    microbatch numbers to their (step, microbatch)). ``note(code, microbatch)`` is called as each
    compute action starts (the worker's record of what it is computing, for ``step_timeout``).
    A process holding several stages runs :func:`pipeq.runtime.chunks.execute_chunks` instead."""
    return _execute_one(ex, actions, trace, keys, note)


def _execute_one(
    ex: StageExecutor, actions: Sequence[Action], trace: Any,
    keys: Mapping[int, tuple[int, int]] | None, note: Callable[[int, int], None] | None,
) -> Generator[Request, Any, None]:
    """:func:`execute` on one stage."""
    received: dict[int, Tensors] = {}
    grads: dict[int, Tensors] = {}
    acts_out: dict[int, Tensors] = {}
    grads_out: dict[int, Tensors] = {}
    rec = trace.append if trace is not None else None
    clock = time.perf_counter_ns
    step = ex.step_index
    for a in actions:
        op = a.op
        j = a.microbatch
        if op is Op.FORWARD:
            if note is not None:
                note(TRACE_F, j)
            t0 = clock() if rec else 0
            out = ex.forward(j, received.pop(j, None))
            if rec:
                rec((TRACE_F, *(keys[j] if keys is not None else (step, j)), t0, clock(), 0))
            if out is not None:
                if ex.is_last:
                    yield (EMIT, j, ex.to_host(out))
                else:
                    acts_out[j] = out
        elif op is Op.BACKWARD:
            if note is not None:
                note(TRACE_B, j)
            t0 = clock() if rec else 0
            gin = ex.backward(j, grads.pop(j, None))
            if rec:
                rec((TRACE_B, *(keys[j] if keys is not None else (step, j)), t0, clock(), 0))
            if ex.training:
                ex.backward_done()
            if gin is not None:
                if ex.is_first and not ex.training:  # a decode path (AL) ends here: the output
                    yield (EMIT, j, ex.to_host(gin))
                else:
                    grads_out[j] = gin
        elif op is Op.RECV_ACT:
            received[j] = yield (op, j)
        elif op is Op.RECV_GRAD:
            grads[j] = yield (op, j)
        elif op is Op.SEND_ACT:
            yield (op, j, ex.for_peer(acts_out.pop(j)))
        elif op is Op.SEND_GRAD:
            # after its backward; or (interlocking) right after its forward: the head's gradient
            out = grads_out.pop(j, None)
            yield (op, j, ex.for_peer(out if out is not None else ex.early_input_grads(j)))
        elif op is Op.STEP:
            yield from _step(ex, rec, note)
        elif op is Op.INPUT_GRAD or op is Op.WEIGHT_GRAD:  # a split backward: after F and B, which stay lean
            _split_backward(ex, op, j, grads, grads_out, rec, keys, note)
        else:  # pragma: no cover - schedules are validated before they reach here
            raise ValueError(f"stage {ex.index}: cannot execute action {a}")


def _step(ex: StageExecutor, rec: Any, note: Callable[[int, int], None] | None) -> Generator[Request, Any, None]:
    """The optimizer step: tied weights' gradients summed, the stages' statistics combined."""
    if note is not None:
        note(TRACE_OPT_STEP, -1)
    t0 = time.perf_counter_ns() if rec else 0
    if ex.tied is not None:  # replicas first, then the stages holding a copy
        ex.sync_replicas()
        ex.tied.add((yield (TIES, STATS, ex.tied.outgoing(), ex.tied.rounds)))
    if ex.numerics.combines:
        ex.apply_step((yield from _combined(ex, ex.step_stats())))
    else:
        ex.optimizer_step()
    if rec:
        rec((TRACE_OPT_STEP, ex.step_index, -1, t0, time.perf_counter_ns(), 0))


def _split_backward(ex: StageExecutor, op: Op, j: int, grads: dict[int, Tensors], grads_out: dict[int, Tensors],
                    rec: Any, keys: Mapping[int, tuple[int, int]] | None, note: Callable[[int, int], None] | None,
                    ) -> None:
    """``I j`` (the input gradient, to send back as a ``B``'s) or ``W j`` (the weight gradients;
    after the step's last one, the data-parallel all-reduce starts), traced like a ``B``."""
    code = TRACE_I if op is Op.INPUT_GRAD else TRACE_W
    if note is not None:
        note(code, j)
    t0 = time.perf_counter_ns() if rec else 0
    if code == TRACE_I:
        gin = ex.input_grad(j, grads.pop(j, None))
        if gin is not None:
            grads_out[j] = gin
    else:
        ex.weight_grad(j)
    if rec:
        rec((code, *(keys[j] if keys is not None else (ex.step_index, j)), t0, time.perf_counter_ns(), 0))
    if code == TRACE_W:
        ex.backward_done()


def _combined(ex: StageExecutor, own: StepStats) -> Generator[Request, Any, StepStats]:
    """Every stage's statistics combined (see the module docstring): the chain 0 -> N-1 and back."""
    k, n, p = ex.index, ex.n_stages, ex.numerics.clip_norm_type
    acc = own
    if k > 0:
        acc = combine(StepStats.from_tensors((yield (Op.RECV_ACT, STATS)), f"stage {k - 1}"), acc, p)
    if k < n - 1:
        yield (Op.SEND_ACT, STATS, (acc.to_tensor(),))
        acc = StepStats.from_tensors((yield (Op.RECV_GRAD, STATS)), f"stage {k + 1}")
    if k > 0:
        yield (Op.SEND_GRAD, STATS, (acc.to_tensor(),))
    return acc
