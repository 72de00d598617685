"""What the interpreter asks of its caller: one typed request per message that crosses a process.

The interpreter (:mod:`pipeq.runtime.interpreter`) runs a process's compute actions itself and
*yields* a request for everything that needs another process: the event loop answers from its
transport (:mod:`pipeq.runtime.loop`), the simulated engine from its mailbox
(:mod:`pipeq.runtime.simulated`). ``chunk`` is the process's stage the message is for or from
(0 with one stage per process); microbatch ``STATS`` carries the stages' step statistics.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence, Union

import torch

from pipeq.schedules import Op

__all__ = ["Recv", "Send", "Emit", "SwapTies", "Request", "STATS"]

STATS = -2  # the microbatch number of the step statistics' messages (never a real microbatch)


class Recv(NamedTuple):
    """Chunk ``chunk``'s activation (``op`` is ``Op.RECV_ACT``, from the previous stage) or
    gradient (``Op.RECV_GRAD``, from the next) of microbatch ``microbatch``: the caller sends back
    its tensors (a :class:`pipeq.stage.microbatch.Packed` for a tree)."""

    op: Op
    chunk: int
    microbatch: int


class Send(NamedTuple):
    """Send ``tensors`` of microbatch ``microbatch`` from chunk ``chunk``: to the next stage
    (``op`` is ``Op.SEND_ACT``; a tree comes as a :class:`pipeq.stage.microbatch.Packed`) or the
    previous one (``Op.SEND_GRAD``)."""

    op: Op
    chunk: int
    microbatch: int
    tensors: Sequence[torch.Tensor]


class Emit(NamedTuple):
    """A forward-only result of chunk ``chunk`` (the last stage's output, or the end of a decode
    path on stage 0): the caller hands it to whoever asked for the batch."""

    chunk: int
    microbatch: int
    tensors: Sequence[torch.Tensor]


class SwapTies(NamedTuple):
    """Tied weights' exchange number ``round`` (counted from 1 alike on every stage) with the
    stages of other processes: ``outgoing[c][s]`` goes from chunk c's stage to stage s (the
    caller sends copies). The caller sends everything before it waits for anything, and sends
    back ``{c: {s: tensors}}``, what every such stage sent each chunk."""

    outgoing: Mapping[int, Mapping[int, Sequence[torch.Tensor]]]
    round: int


Request = Union[Recv, Send, Emit, SwapTies]

