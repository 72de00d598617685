"""The vocabulary of schedules: actions, and how compute actions lower into communication.

A stage's plan is a list of :class:`Action`: compute (``F j`` forward, ``B j`` backward,
``STEP`` optimizer step; or the backward split in two, ``I j`` the gradient with respect to the
stage's input only, which is what the previous stage waits for, and ``W j`` the deferred weight
gradients, ``B j`` = ``I j`` + ``W j``) and, once lowered, communication (``recvF``/``sendF`` on
the forward channel, ``recvB``/``sendB`` on the backward one; an ``I`` receives and sends like a
``B``, a ``W`` communicates nothing). An action's ``chunk`` is the virtual stage within its
process (0 while a process holds one stage; printed only when nonzero). :func:`lower` inserts the communication
that plain backprop implies; schedules that route gradients their own way (interlocking,
Associated Learning) call :func:`lower_stage` with their own choices. Pure: no I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

__all__ = ["Op", "Action", "COMPUTE_OPS", "GRAD_OPS", "WEIGHT_DONE_OPS", "F", "B", "I", "W", "STEP", "Schedule",
           "ScheduleFn", "lower_stage", "lower", "lower_process"]

class Op(enum.Enum):
    """What an action does: compute (``F``, ``B``, ``I``, ``W``, ``STEP``) or, once lowered,
    communication (``recvF``/``sendF``, ``recvB``/``sendB``)."""

    FORWARD = "F"
    BACKWARD = "B"
    INPUT_GRAD = "I"  # the input gradient only (B's part the previous stage waits for)
    WEIGHT_GRAD = "W"  # the weight gradients, deferred (B's other part)
    STEP = "STEP"
    RECV_ACT = "recvF"  # activation from stage k-1
    SEND_ACT = "sendF"  # activation to stage k+1
    RECV_GRAD = "recvB"  # gradient from stage k+1
    SEND_GRAD = "sendB"  # gradient to stage k-1


COMPUTE_OPS = (Op.FORWARD, Op.BACKWARD, Op.STEP, Op.INPUT_GRAD, Op.WEIGHT_GRAD)
"""The compute ops (the rest are communication)."""
GRAD_OPS = (Op.BACKWARD, Op.INPUT_GRAD)
"""The compute ops that take the gradient from the next stage and send one to the previous."""
WEIGHT_DONE_OPS = (Op.BACKWARD, Op.WEIGHT_GRAD)
"""The compute ops after which a microbatch's weight gradients are complete."""


@dataclass(frozen=True, slots=True)
class Action:
    """One action of a stage's plan: ``op`` on ``microbatch`` (-1: none, STEP) of virtual stage
    ``chunk`` of the process (0 unless the process holds several stages)."""

    op: Op
    microbatch: int = -1
    chunk: int = 0

    def __str__(self) -> str:
        text = self.op.value if self.microbatch < 0 else f"{self.op.value}{self.microbatch}"
        return text if self.chunk == 0 else f"{text}.c{self.chunk}"


def F(j: int) -> Action:
    """The forward of microbatch ``j``."""
    return Action(Op.FORWARD, j)


def B(j: int) -> Action:
    """The backward of microbatch ``j`` (input and weight gradients at once)."""
    return Action(Op.BACKWARD, j)


def I(j: int) -> Action:  # noqa: E743  (the paper's and torch's name for it)
    """The input gradient of microbatch ``j`` (the first part of a split backward)."""
    return Action(Op.INPUT_GRAD, j)


def W(j: int) -> Action:
    """The weight gradients of microbatch ``j`` (the second part of a split backward)."""
    return Action(Op.WEIGHT_GRAD, j)


STEP = Action(Op.STEP)
"""The optimizer step, a stage's last action of a training step."""

Schedule = list[list[Action]]
"""A schedule's plan: one list of actions per stage (or per process)."""
ScheduleFn = Callable[[int, int], Schedule]
"""A schedule function: ``(n_stages, n_microbatches) -> Schedule``."""


def lower_stage(
    acts: list[Action], *, recv_act: bool, send_act: bool, recv_grad: bool, send_grad: bool,
    grad_after_forward: bool = False,
) -> list[Action]:
    """One stage's compute actions with the communication they imply: an ``F`` receives its
    activation first (``recv_act``) and sends its output after (``send_act``); a ``B`` or an ``I``
    receives its gradient first (``recv_grad``) and sends its input gradient after (``send_grad``),
    or, with ``grad_after_forward`` (interlocking: a stage's own head), right after the ``F``; a
    ``W`` communicates nothing. Messages keep their action's chunk."""
    low: list[Action] = []
    for a in acts:
        j, c = a.microbatch, a.chunk
        if a.op is Op.FORWARD:
            if recv_act:
                low.append(Action(Op.RECV_ACT, j, c))
            low.append(a)
            if send_act:
                low.append(Action(Op.SEND_ACT, j, c))
            if grad_after_forward:
                low.append(Action(Op.SEND_GRAD, j, c))
        elif a.op in GRAD_OPS:
            if recv_grad:
                low.append(Action(Op.RECV_GRAD, j, c))
            low.append(a)
            if send_grad and not grad_after_forward:
                low.append(Action(Op.SEND_GRAD, j, c))
        else:
            low.append(a)
    return low


def lower(schedule: Schedule) -> Schedule:
    """Insert the receives and sends that plain backprop's compute actions imply."""
    n = len(schedule)
    return [lower_stage(acts, recv_act=k > 0, send_act=k < n - 1, recv_grad=k < n - 1, send_grad=k > 0)
            for k, acts in enumerate(schedule)]


def lower_process(acts: list[Action], stages: list[int], n_stages: int) -> list[Action]:
    """A process's compute actions (chunk c runs model stage ``stages[c]`` of ``n_stages``) with
    the communication plain backprop implies for each action's own stage."""
    flags = [dict(recv_act=s > 0, send_act=s < n_stages - 1, recv_grad=s < n_stages - 1, send_grad=s > 0)
             for s in stages]
    low: list[Action] = []
    for a in acts:
        if not 0 <= a.chunk < len(stages):
            raise ValueError(f"action {a}: chunk {a.chunk} out of range 0..{len(stages) - 1}")
        low += lower_stage([a], **flags[a.chunk])
    return low
