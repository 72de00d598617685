"""What travels between pipeq's processes: message kinds, the :class:`Message`, trees in messages.

This is the vocabulary of the wire, with no bytes in it: :mod:`pipeq.wire.stage_link` turns messages
into frames (through :mod:`pipeq.wire.codec`) and back. The worker, the driver and the agent build and
read :class:`Message` objects only.

Kinds by channel::

    data     ACTIVATION (stage k -> k+1)   GRADIENT (stage k+1 -> k)
             REPLICA (stage k of replica r -> stage k of replica r': gradient buckets, start-up weights)
             TIE (stage a -> stage b of one replica: the gradients of the weights both hold a copy of)
    command  PEERS TRAIN DRAIN PREDICT GET_STATE SET_STATE GET_SNAPSHOT RESTORE CLOCK GET_TRACE
             STEP_SCHEDULER GET_LR GET_STATS STOP EXIT LOST REJOIN
    reply    READY LOSS OUTPUT STATE SNAPSHOT TIME TRACE LR STATS ACK ERROR HEARTBEAT

``TRAIN`` is the command "train on one batch" (a schedule's optimizer step is the action
``schedules.STEP``); ``OUTPUT`` is the reply that carries a forward-only microbatch's result.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from pipeq.tree import STATE, flatten, unflatten

__all__ = ["Kind", "REPLIES", "Message", "tree_message", "tree_of"]


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
    # data plane, tied weights
    TIE = 42  # stage a -> stage b of the same replica: gradient buckets of their tied weights
    # driver -> worker, fault_tolerance="replicas" (pipeq.control.replica_loss)
    LOST = 43  # a replica is lost: sum the gradients without it until it is back
    REJOIN = 44  # a lost replica is back (rebuilt): reconnect to it, reply ACK
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
REPLIES = frozenset({Kind.READY, Kind.LOSS, Kind.OUTPUT, Kind.STATE, Kind.SNAPSHOT, Kind.ACK, Kind.TIME, Kind.TRACE,
                     Kind.LR, Kind.STATS})


@dataclass
class Message:
    """One message. Received ``tensors`` are views over the received frames (no copy)."""

    kind: Kind
    step: int = 0
    microbatch: int = 0
    tensors: Sequence[torch.Tensor] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def tree_message(kind: Kind, step: int, key: str, obj: Any, where: str) -> Message:
    """A message carrying the tree ``obj`` (states, snapshots; :data:`pipeq.tree.STATE` spelling)
    under ``extra[key]``, its tensors as contiguous CPU tensors; ``where`` names it in errors
    (e.g. "stage 2's snapshot")."""
    tensors, spec = flatten(obj, where, STATE)
    return Message(kind, step, 0, [t.detach().cpu().contiguous() for t in tensors], {key: spec})


def tree_of(msg: Message, key: str) -> Any:
    """The tree a :func:`tree_message` carries, checked (KeyError if it has none, TreeError if malformed)."""
    return unflatten(msg.extra[key], msg.tensors, STATE)
