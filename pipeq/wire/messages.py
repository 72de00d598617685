"""What travels between pipeq's processes: message kinds, the :class:`Message`, nested state.

This is the vocabulary of the wire, with no bytes in it: :mod:`pipeq.transport` turns messages
into frames (through :mod:`pipeq.codec`) and back. The worker, the driver and the agent build and
read :class:`Message` objects only.

Kinds by channel::

    data     ACTIVATION (stage k -> k+1)   GRADIENT (stage k+1 -> k)
             REPLICA (stage k of replica r -> stage k of replica r': gradient buckets, start-up weights)
    command  PEERS TRAIN DRAIN PREDICT GET_STATE SET_STATE GET_SNAPSHOT RESTORE CLOCK GET_TRACE
             STEP_SCHEDULER GET_LR GET_STATS STOP EXIT
    reply    READY LOSS OUTPUT STATE SNAPSHOT TIME TRACE LR STATS ACK ERROR HEARTBEAT

``TRAIN`` is the command "train on one batch" (a schedule's optimizer step is the action
``schedules.STEP``); ``OUTPUT`` is the reply that carries a forward-only microbatch's result.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from pipeq.errors import CodecError


class Kind(enum.IntEnum):
    """What a message is. The numbers are part of the wire format: never renumber, only append."""

    # data plane
    ACTIVATION = 1  # stage k -> k+1 (forward channel)
    GRADIENT = 2  # stage k+1 -> k (backward channel)
    # driver -> worker
    PEERS = 10  # the neighbours' addresses
    TRAIN = 11  # train on one batch: run the schedule's actions, the last stage replies LOSS
    PREDICT = 12  # forward only: the output stage replies OUTPUT per microbatch
    GET_STATE = 13
    SET_STATE = 14
    STOP = 15  # finish queued work, reply ACK, wait for EXIT
    EXIT = 16
    GET_SNAPSHOT = 17  # reply SNAPSHOT: parameters, optimizer and scheduler state, RNG
    RESTORE = 18  # load a snapshot, reply ACK
    CLOCK = 19  # reply TIME with the stage's clock (trace clock alignment)
    GET_TRACE = 30  # reply TRACE: the recorded action rows since the last GET_TRACE
    DRAIN = 31  # finish a stream's leftover work (asynchronous 1F1B's last backwards), reply ACK
    # data plane, data parallelism
    REPLICA = 32  # stage k of one replica -> stage k of another (gradient buckets, replica 0's weights)
    # driver -> worker, learning-rate schedule
    STEP_SCHEDULER = 33  # step the lr schedulers once (extra "metric": a float or None), reply ACK
    GET_LR = 34  # reply LR: the learning rate of every parameter group
    # worker -> driver
    LR = 35  # extra "lrs": the stage's learning rates (StageExecutor.learning_rates)
    GET_STATS = 40  # reply STATS: peak memory, skipped steps (extra "reset": start a new peak)
    STATS = 41
    # worker (or agent) -> driver
    READY = 20
    LOSS = 21
    OUTPUT = 22
    STATE = 23
    ACK = 24
    ERROR = 25
    HEARTBEAT = 26
    SNAPSHOT = 27
    TIME = 28
    TRACE = 29


#: Replies to a driver's command: one that nobody waits for any more (the caller was
#: interrupted, e.g. by Ctrl-C) is stale and dropped.
REPLIES = frozenset({Kind.LOSS, Kind.OUTPUT, Kind.STATE, Kind.SNAPSHOT, Kind.ACK, Kind.TIME, Kind.TRACE,
                     Kind.LR, Kind.STATS})


@dataclass
class Message:
    """One message. Received ``tensors`` are views over the received frames (no copy)."""

    kind: Kind
    step: int = 0
    microbatch: int = 0
    tensors: Sequence[torch.Tensor] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


class TreeError(CodecError):
    """A packed tree refers to a tensor the message does not carry."""


_TENSOR_REF = "__tensor__"


def pack_tree(obj: Any, tensors: list[torch.Tensor], where: str = "value") -> Any:
    """``obj`` (nested dicts/lists of plain values and tensors) as plain data for a header.

    Each tensor is appended to ``tensors`` (to travel as its own frame) and replaced by
    ``{"__tensor__": index}``; :func:`unpack_tree` puts it back. ``where`` names the value in
    errors (e.g. "stage 2's snapshot").
    """
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach().cpu().contiguous())
        return {_TENSOR_REF: len(tensors) - 1}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (list, tuple)):
        return [pack_tree(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str) or k == _TENSOR_REF:
                raise ValueError(f"{where} has a key {k!r}: only string keys can be sent")
            out[k] = pack_tree(v, tensors, f"{where}[{k!r}]")
        return out
    raise ValueError(
        f"{where} holds a {type(obj).__name__}, which pipeq cannot send (plain numbers, strings, "
        "lists, dicts and tensors only)"
    )


def unpack_tree(obj: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """The inverse of :func:`pack_tree` (tensor indices are checked)."""
    if isinstance(obj, dict):
        if len(obj) == 1 and _TENSOR_REF in obj:
            i = obj[_TENSOR_REF]
            if type(i) is not int or not 0 <= i < len(tensors):
                raise TreeError(f"tensor reference {i!r} outside the message's {len(tensors)} tensors")
            return tensors[i]
        return {k: unpack_tree(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unpack_tree(v, tensors) for v in obj]
    return obj


def tree_message(kind: Kind, step: int, key: str, obj: Any, where: str) -> Message:
    """A message carrying nested state ``obj`` (see :func:`pack_tree`) under ``extra[key]``."""
    tensors: list[torch.Tensor] = []
    return Message(kind, step, 0, tensors, {key: pack_tree(obj, tensors, where)})


def tree_of(msg: Message, key: str) -> Any:
    """The nested state a :func:`tree_message` carries (KeyError if it has none)."""
    return unpack_tree(msg.extra[key], msg.tensors)
