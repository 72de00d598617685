"""The vocabulary of schedules: actions, and how compute actions lower into communication.

A stage's plan is a list of :class:`Action`: compute (``F j`` forward, ``B j`` backward,
``STEP`` optimizer step) and, once lowered, communication (``recvF``/``sendF`` on the forward
channel, ``recvB``/``sendB`` on the backward one). :func:`lower` inserts the communication
that plain backprop implies; schedules that route gradients their own way (interlocking,
Associated Learning) call :func:`lower_stage` with their own choices. Pure: no I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable


class Op(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    STEP = "STEP"
    RECV_ACT = "recvF"  # activation from stage k-1
    SEND_ACT = "sendF"  # activation to stage k+1
    RECV_GRAD = "recvB"  # gradient from stage k+1
    SEND_GRAD = "sendB"  # gradient to stage k-1


COMPUTE_OPS = (Op.FORWARD, Op.BACKWARD, Op.STEP)


@dataclass(frozen=True, slots=True)
class Action:
    op: Op
    microbatch: int = -1

    def __str__(self) -> str:
        return self.op.value if self.microbatch < 0 else f"{self.op.value}{self.microbatch}"


def F(j: int) -> Action:
    return Action(Op.FORWARD, j)


def B(j: int) -> Action:
    return Action(Op.BACKWARD, j)


STEP = Action(Op.STEP)

Schedule = list[list[Action]]
ScheduleFn = Callable[[int, int], Schedule]


def lower_stage(
    acts: list[Action], *, recv_act: bool, send_act: bool, recv_grad: bool, send_grad: bool,
    grad_after_forward: bool = False,
) -> list[Action]:
    """One stage's compute actions with the communication they imply: an ``F`` receives its
    activation first (``recv_act``) and sends its output after (``send_act``); a ``B`` receives
    its gradient first (``recv_grad``) and sends its input gradient after (``send_grad``), or,
    with ``grad_after_forward`` (interlocking: a stage's own head), right after the ``F``."""
    low: list[Action] = []
    for a in acts:
        j = a.microbatch
        if a.op is Op.FORWARD:
            if recv_act:
                low.append(Action(Op.RECV_ACT, j))
            low.append(a)
            if send_act:
                low.append(Action(Op.SEND_ACT, j))
            if grad_after_forward:
                low.append(Action(Op.SEND_GRAD, j))
        elif a.op is Op.BACKWARD:
            if recv_grad:
                low.append(Action(Op.RECV_GRAD, j))
            low.append(a)
            if send_grad and not grad_after_forward:
                low.append(Action(Op.SEND_GRAD, j))
        else:
            low.append(a)
    return low


def lower(schedule: Schedule) -> Schedule:
    """Insert the receives and sends that plain backprop's compute actions imply."""
    n = len(schedule)
    return [lower_stage(acts, recv_act=k > 0, send_act=k < n - 1, recv_grad=k < n - 1, send_grad=k > 0)
            for k, acts in enumerate(schedule)]
