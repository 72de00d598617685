"""Runs one stage's lowered action list against its :class:`~pipeq.stage.StageExecutor`.

:func:`execute` is a generator: compute actions run inline, and each communication action is
*yielded* as a request for the caller to carry out. The worker event loop answers requests with
blocking socket operations; the simulated engine answers them from in-memory queues and switches
to another stage when a message is not there yet. One interpreter, so both modes run the very same
actions in the very same order.

Requests (first element an :class:`~pipeq.schedules.Op`, or ``OUTPUT``)::

    (Op.RECV_ACT, j)            -> caller sends back the received activation tensors
    (Op.RECV_GRAD, j)           -> caller sends back the received gradient tensors
    (Op.SEND_ACT, j, tensors)   -> caller sends them to the next stage
    (Op.SEND_GRAD, j, tensors)  -> caller sends them to the previous stage
    (OUTPUT, j, tensors)        -> last stage, forward-only step: the caller returns them
"""

from __future__ import annotations

from typing import Any, Generator, Sequence

from .schedules import Action, Op
from .stage import StageExecutor, Tensors

OUTPUT = "output"

Request = tuple[Any, ...]


def execute(ex: StageExecutor, actions: Sequence[Action]) -> Generator[Request, Any, None]:
    received: dict[int, Tensors] = {}
    grads: dict[int, Tensors] = {}
    to_send: dict[int, Tensors] = {}
    for a in actions:
        op = a.op
        j = a.microbatch
        if op is Op.FORWARD:
            out = ex.forward(j, received.pop(j, None))
            if out is not None:
                if ex.is_last:
                    yield (OUTPUT, j, ex.to_host(out))
                else:
                    to_send[j] = out
        elif op is Op.BACKWARD:
            gin = ex.backward(j, grads.pop(j, None))
            if gin is not None:
                to_send[j] = gin
        elif op is Op.RECV_ACT:
            received[j] = yield (op, j)
        elif op is Op.RECV_GRAD:
            grads[j] = yield (op, j)
        elif op is Op.SEND_ACT or op is Op.SEND_GRAD:
            yield (op, j, ex.to_host(to_send.pop(j)))
        elif op is Op.STEP:
            ex.optimizer_step()
        else:  # pragma: no cover - schedules are validated before they reach here
            raise ValueError(f"stage {ex.index}: cannot execute action {a}")
