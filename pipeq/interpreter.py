"""Runs one stage's lowered action list against its :class:`~pipeq.stage.StageExecutor`.

:func:`execute` is a generator: compute actions run inline, and each communication action is
*yielded* as a request for the caller to carry out. The worker event loop answers requests with
blocking socket operations; the simulated engine answers them from in-memory queues and switches
to another stage when a message is not there yet. One interpreter, so both modes run the very same
actions in the very same order.

Requests (first element an :class:`~pipeq.schedules.Op`, or ``EMIT``)::

    (Op.RECV_ACT, j)            -> caller sends back the received activation tensors
    (Op.RECV_GRAD, j)           -> caller sends back the received gradient tensors
    (Op.SEND_ACT, j, tensors)   -> caller sends them to the next stage
    (Op.SEND_GRAD, j, tensors)  -> caller sends them to the previous stage
    (EMIT, j, tensors)          -> a forward-only result (the last stage's output, or the end
                                   of a decode path on stage 0): the caller returns it
"""

from __future__ import annotations

import time
from typing import Any, Generator, Sequence

from .schedules import Action, Op
from .stage import StageExecutor, Tensors
from .trace import B as TRACE_B
from .trace import F as TRACE_F
from .trace import OPT_STEP as TRACE_OPT_STEP

EMIT = "emit"

Request = tuple[Any, ...]


def execute(
    ex: StageExecutor, actions: Sequence[Action], trace: Any = None
) -> Generator[Request, Any, None]:
    """Run ``actions``; with ``trace`` (a list or deque), append ``(code, step, microbatch, start_ns,
    end_ns, 0)`` for each compute action (see :mod:`pipeq.trace`)."""
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
            t0 = clock() if rec else 0
            out = ex.forward(j, received.pop(j, None))
            if rec:
                rec((TRACE_F, step, j, t0, clock(), 0))
            if out is not None:
                if ex.is_last:
                    yield (EMIT, j, ex.to_host(out))
                else:
                    acts_out[j] = out
        elif op is Op.BACKWARD:
            t0 = clock() if rec else 0
            gin = ex.backward(j, grads.pop(j, None))
            if rec:
                rec((TRACE_B, step, j, t0, clock(), 0))
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
            yield (op, j, ex.to_host(acts_out.pop(j)))
        elif op is Op.SEND_GRAD:
            # after its backward; or (interlocking) right after its forward: the head's gradient
            out = grads_out.pop(j, None)
            yield (op, j, ex.to_host(out if out is not None else ex.early_input_grads(j)))
        elif op is Op.STEP:
            t0 = clock() if rec else 0
            ex.optimizer_step()
            if rec:
                rec((TRACE_OPT_STEP, step, -1, t0, clock(), 0))
        else:  # pragma: no cover - schedules are validated before they reach here
            raise ValueError(f"stage {ex.index}: cannot execute action {a}")
