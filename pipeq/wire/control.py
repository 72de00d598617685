"""The control protocol: one typed payload per command and reply, every field checked on decode.

The driver, the stage workers and the node agents talk in :class:`~pipeq.wire.messages.Message`
objects whose ``extra`` (a msgpack map in the message's header) is the payload's fields by name:
a payload is plain data and encoding it adds nothing to the bytes. A field that may be absent is
left out while it holds its default (None or False). :func:`decode` checks every field before
anything reads it: one that is missing, of the wrong type or out of range, or one that the kind
does not have, raises :class:`ControlError` naming the kind and the field. So a peer, buggy or
hostile, meets a clear refusal, never a KeyError deep in the driver. Nothing is ever pickled.

    command (driver -> stage)               reply (stage -> driver)
    PEERS           Peers                   READY      Ready (a node agent's: AgentReady)
    TRAIN           Train                   LOSS       Loss (the last stage)
    PREDICT         Predict                 OUTPUT     Output (the output stage, per microbatch)
    GET_STATE       GetState                STATE      State
    SET_STATE       SetState                ACK        Ack
    GET_SNAPSHOT    GetSnapshot             SNAPSHOT   Snapshot
    RESTORE         Restore                 TIME       Time
    CLOCK           Clock                   TRACE      TraceRows
    GET_TRACE       GetTrace                LR         Lrs
    DRAIN           Drain                   STATS      Stats
    STEP_SCHEDULER  StepScheduler           ERROR      ErrorReply (a stage's, or a node agent's)
    GET_LR          GetLr                   HEARTBEAT  HeartbeatInfo
    GET_STATS       GetStats
    LOST            Lost                    (with from_round: reply ACK once the rounds before it are summed)
    REJOIN          Rejoin                  (reply ACK)
    STOP            Stop
    EXIT            Exit (to stages and node agents)

The data messages (ACTIVATION, GRADIENT, REPLICA, TIE) are no control payloads: an activation's tree
is read with :func:`data_tree`. Nested state (snapshots) travels as :mod:`pipeq.tree` data: see
:func:`state_message` and :func:`state_of`.
"""

from __future__ import annotations

import dataclasses
import reprlib
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence, TypeVar, cast, dataclass_transform

from pipeq.wire.fields import (COUNT, DATA, FLAG, FLOAT, INT, MAP, POSITIVE, REQUIRED, SECONDS, TEXT, Check,  # noqa: F401
                               ControlError, Field, list_of, nullable, wire)
from pipeq.wire.messages import Kind, Message, tree_message, tree_of

__all__ = [
    "ControlError", "Payload", "DATA_KINDS", "encode", "decode", "read", "message", "data_tree",
    "state_message", "state_of",
    "Peers", "Train", "Predict", "GetState", "SetState", "GetSnapshot", "Restore", "Clock", "GetTrace", "Drain",
    "StepScheduler", "GetLr", "GetStats", "Stop", "Exit", "Lost", "Rejoin",
    "Ready", "AgentReady", "Loss", "Output", "State", "Ack", "Snapshot", "Time", "TraceRows", "Lrs", "Stats",
    "ErrorReply", "HeartbeatInfo",
]

#: The kinds that carry data between stages, not control payloads.
DATA_KINDS = frozenset({Kind.ACTIVATION, Kind.GRADIENT, Kind.REPLICA, Kind.TIE})


class Payload:
    """A control message's payload: a dataclass of plain values bound to its :attr:`KIND`."""

    KIND: ClassVar[Kind]
    AGENT: ClassVar[bool] = False  # a node agent's payload for KIND (a stage's is another)
    FIELDS: ClassVar[tuple[Field, ...]] = ()
    NAMES: ClassVar[frozenset[str]] = frozenset()

    def refuse(self, n_tensors: int) -> tuple[str, str] | None:
        """``(field, what is wrong)`` when the fields do not fit each other or the message's
        ``n_tensors`` tensors; None when they do."""
        return None


P = TypeVar("P", bound=Payload)
_BY_KIND: dict[Kind, type[Payload]] = {}
_FROM_AGENT: dict[Kind, type[Payload]] = {}


@dataclass_transform(kw_only_default=True, field_specifiers=(wire,))
def _control(kind: Kind, *, agent: bool = False) -> Callable[[type[P]], type[P]]:
    """Make the class a payload dataclass (keyword-only fields) bound to ``kind`` (a node agent's
    payload of that kind with ``agent``), its fields' wire names and checks noted for decoding."""

    def bind(cls: type[P]) -> type[P]:
        cls = dataclass(kw_only=True)(cls)
        cls.KIND, cls.AGENT = kind, agent
        cls.FIELDS = tuple(Field(f.name, f.metadata["name"] or f.name, f.metadata["check"],
                                  f.default is not dataclasses.MISSING, f.default) for f in dataclasses.fields(cast(Any, cls)))
        cls.NAMES = frozenset(f.name for f in cls.FIELDS)
        (_FROM_AGENT if agent else _BY_KIND)[kind] = cls
        return cls

    return bind


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict = 3, 40, 40, 6, 4


def _show(value: Any) -> str:
    """``value`` for an error message, cut short (a hostile peer may send a megabyte, or a
    thousand nested lists)."""
    return _SHORT.repr(value)


# -- encoding and decoding ---------------------------------------------------------------------------
def encode(payload: Payload) -> dict[str, Any]:
    """The payload's fields as a message's ``extra`` (optional fields at their default left out)."""
    out: dict[str, Any] = {}
    for f in payload.FIELDS:
        value = getattr(payload, f.attr)
        if not (f.optional and value is f.default):
            out[f.name] = value
    return out


def message(payload: Payload, step: int = 0, microbatch: int = 0, tensors: Sequence[Any] | None = None) -> Message:
    """A message carrying ``payload`` (and ``tensors``, which are not copied)."""
    return Message(payload.KIND, step, microbatch, tensors if tensors is not None else [], encode(payload))


def decode(msg: Message, *, from_agent: bool = False) -> Payload:
    """``msg``'s payload, every field checked (``from_agent``: a node agent sent it); raises
    :class:`ControlError` naming the kind and the field at fault."""
    kind = msg.kind
    cls = _FROM_AGENT.get(kind) if from_agent else None
    cls = cls or _BY_KIND.get(kind)
    if cls is None:
        raise ControlError(kind, "kind", "names a data message, which carries no control payload")
    extra = msg.extra
    for key in extra:
        if key not in cls.NAMES:
            raise ControlError(kind, _show(key).strip("'"), f"is not a field of {kind.name} (its fields: "
                               f"{', '.join(f.name for f in cls.FIELDS) or 'none'})")
    values = {}
    for f in cls.FIELDS:
        if f.name in extra:
            value = extra[f.name]
            if not f.check.test(value):
                raise ControlError(kind, f.name, f"must be {f.check.what}, not {_show(value)}")
            values[f.attr] = value
        elif not f.optional:
            raise ControlError(kind, f.name, "is missing")
    payload = cls(**values)
    wrong = payload.refuse(len(msg.tensors))
    if wrong is not None:
        raise ControlError(kind, *wrong)
    return payload


def read(msg: Message, cls: type[P], *, from_agent: bool = False) -> P:
    """``msg``'s payload, which must be a ``cls`` (see :func:`decode`)."""
    got = decode(msg, from_agent=from_agent)
    if not isinstance(got, cls):
        raise ControlError(msg.kind, "kind", f"is {msg.kind.name} where {cls.KIND.name} was expected")
    return got


def data_tree(msg: Message) -> Any:
    """The tree of an ACTIVATION's tensors (pipeq.stage.microbatch checks it), None for a bare
    tuple. (The data plane's hot path: no payload object.)"""
    extra = msg.extra
    return extra.get("tree") if extra else None


# -- commands: driver -> stage -----------------------------------------------------------------------
@_control(Kind.PEERS)
class Peers(Payload):
    """The neighbours' addresses; with tied weights, ``tie_links[s]``: stage s's tie link in this
    replica (nil for a stage without), and with tensor parallelism ``tie_shards[t][s]``: shard
    t's of stage s. With replicas, the stage makes its replicas' group (its mesh's store says
    where they meet: nothing to address) and replies ACK."""

    next_forward: str | None = wire(TEXT, default=None)
    prev_backward: str | None = wire(TEXT, default=None)
    tie_links: list[str | None] | None = wire(list_of(nullable(TEXT)), default=None)
    tie_shards: list[list[str | None]] | None = wire(list_of(list_of(nullable(TEXT))), default=None)
    # a rebuilt replica (fault_tolerance="replicas"): no start-up weights from replica 0 (the
    # driver restores a healthy replica's state); its gradient rounds go on from this number
    rejoin_round: int | None = wire(COUNT, default=None)


@_control(Kind.LOST)
class Lost(Payload):
    """Replica ``replica`` is lost: every gradient sum of a round from ``from_round`` on (None:
    every sum not yet made) goes on without it. A round before ``from_round`` still waits for
    its buckets, unless this stage is among ``dead`` (the replica's stages whose process is dead
    or stopped). With ``from_round`` the stage replies ACK (the message's step) once its rounds
    before ``from_round`` are summed, naming those it summed with the lost replica
    (``Ack.with_lost``). To the lost replica's own stages: they are parting
    (:mod:`pipeq.parallel.membership`)."""

    replica: int = wire(COUNT)
    from_round: int | None = wire(COUNT, default=None)
    dead: list[int] | None = wire(list_of(COUNT), default=None)


@_control(Kind.REJOIN)
class Rejoin(Payload):
    """Replica ``replica`` is back, rebuilt after gradient round ``round``: the replicas' group
    with it again (:mod:`pipeq.parallel.membership`). Reply ACK."""

    replica: int = wire(COUNT)
    round: int = wire(COUNT)


@dataclass(kw_only=True)
class _Batch(Payload):
    """A batch of ``sizes`` microbatches, and what rides along to the stage: the message's tensors
    are x's (stage 0: ``nx`` of them, 1 when absent; its tree ``x`` when it is not one tensor),
    then the stage's inputs (``ninputs`` of them, tree ``inputs``: its forward's keyword arguments,
    ``runner.step(..., stage_inputs=...)``), then the target's (the rest). ``split``: the batch
    came as its microbatches (``pipeq.Microbatches``): x, the inputs and the target are each a
    list of them, one per size."""

    sizes: list[int] = wire(list_of(POSITIVE, nonempty=True))
    x: Any = wire(DATA, default=None)
    nx: int | None = wire(COUNT, default=None)
    inputs: Any = wire(DATA, default=None)
    ninputs: int | None = wire(COUNT, default=None)
    split: bool = wire(FLAG, default=False)

    def refuse(self, n_tensors: int) -> tuple[str, str] | None:
        if (self.inputs is None) != (self.ninputs is None):
            return ("inputs" if self.inputs is None else "ninputs"), "must come with 'inputs' and 'ninputs' both"
        if self.nx is not None and self.nx > n_tensors:
            return "nx", f"counts {self.nx} tensors of x, but the message carries {n_tensors}"
        if self.ninputs is not None and (self.nx or 0) + self.ninputs > n_tensors:
            return "ninputs", f"counts {self.ninputs} tensors after x's, but the message carries {n_tensors}"
        return None


@_control(Kind.TRAIN)
class Train(_Batch):
    """Train on one batch (see :class:`_Batch`), each microbatch's loss times its weight; the
    stages that compute a loss get the target's tensors (and its tree ``target``). ``stream``: do not drain."""

    weights: list[float] = wire(list_of(FLOAT))
    aux_weights: list[float] | None = wire(list_of(FLOAT), default=None)
    stream: bool = wire(FLAG, default=False)
    target: Any = wire(DATA, default=None)
    # fault_tolerance="replicas": each replica's share of the batch's loss weights (the sum of its
    # microbatches' weights), so that survivors can rescale a sum made without a lost replica
    shares: list[float] | None = wire(list_of(FLOAT), default=None)

    def refuse(self, n_tensors: int) -> tuple[str, str] | None:
        for name, w in (("weights", self.weights), ("aux_weights", self.aux_weights)):
            if w is not None and len(w) != len(self.sizes):
                return name, f"has {len(w)} weights for {len(self.sizes)} microbatches"
        return super().refuse(n_tensors)


@_control(Kind.PREDICT)
class Predict(_Batch):
    """Forward only, ``sizes`` microbatches; x and the stage's inputs ride along as in :class:`Train`."""


@dataclass(kw_only=True)
class _Names(Payload):
    """A stage's state_dict: ``names[i]`` names the message's tensor i."""

    names: list[str] = wire(list_of(TEXT))

    def refuse(self, n_tensors: int) -> tuple[str, str] | None:
        if len(self.names) != n_tensors:
            return "names", f"names {len(self.names)} tensors, but the message carries {n_tensors}"
        return None


@_control(Kind.SET_STATE)
class SetState(_Names):
    """Load these state_dict tensors, reply ACK."""


@dataclass(kw_only=True)
class _Tree(Payload):
    """Nested state as :mod:`pipeq.tree` data (its tensors travel as the message's tensors)."""

    snapshot: Any = wire(MAP)


@_control(Kind.RESTORE)
class Restore(_Tree):
    """Load a snapshot (parameters, optimizer and scheduler state, RNG), reply ACK."""


@_control(Kind.STEP_SCHEDULER)
class StepScheduler(Payload):
    """Step the lr schedulers once, with ``metric`` (None for a scheduler that takes none)."""

    metric: float | None = wire(nullable(FLOAT))


@_control(Kind.GET_STATS)
class GetStats(Payload):
    """Reply STATS; ``reset``: start a new memory peak; ``measure``: measure the next training
    step's activations (``runner.memory()``: pipeq.stage.memory)."""

    reset: bool = wire(FLAG)
    measure: bool = wire(FLAG, default=False)


@_control(Kind.EXIT)
class Exit(Payload):
    """Leave the event loop (a node agent: end the run); ``abort``: after a failure."""

    abort: bool = wire(FLAG, default=False)


@_control(Kind.GET_STATE)
class GetState(Payload):
    """Reply STATE: the stage module's state_dict tensors."""


@_control(Kind.GET_SNAPSHOT)
class GetSnapshot(Payload):
    """Reply SNAPSHOT: parameters, optimizer and scheduler state, RNG."""


@_control(Kind.CLOCK)
class Clock(Payload):
    """Reply TIME with the stage's clock (aligning traces)."""


@_control(Kind.GET_TRACE)
class GetTrace(Payload):
    """Reply TRACE: the actions recorded since the last GET_TRACE."""


@_control(Kind.DRAIN)
class Drain(Payload):
    """Finish a stream's leftover work (asynchronous 1F1B's last backwards), reply ACK."""


@_control(Kind.GET_LR)
class GetLr(Payload):
    """Reply LR: the learning rate of every parameter group."""


@_control(Kind.STOP)
class Stop(Payload):
    """Once every earlier command is done, reply ACK: the stage's traffic is over."""


# -- replies: stage (or node agent) -> driver --------------------------------------------------------
@_control(Kind.READY)
class Ready(Payload):
    """A stage process is up: its addresses, who and where it is, and its layout (checkpoints)."""

    forward: str = wire(TEXT)
    backward: str = wire(TEXT)
    pid: int = wire(POSITIVE)
    device: str = wire(TEXT)
    replica: int = wire(COUNT)
    stage: int = wire(COUNT)
    shard: int = wire(COUNT)
    threads: int = wire(POSITIVE)
    host: str = wire(TEXT)
    cores: list[int] = wire(list_of(COUNT))
    inputs: list[str] | None = wire(list_of(TEXT), default=None)  # its declared inputs (pipeq.stage.info)
    tie_link: str | None = wire(TEXT, default=None)  # tied weights: where the stages sharing them reach it
    layout: dict[str, Any] = wire(MAP)


@_control(Kind.READY, agent=True)
class AgentReady(Payload):
    """Node ``agent``'s agent has started its ``stages`` as processes ``pids``."""

    agent: int = wire(POSITIVE)
    stages: list[int] = wire(list_of(COUNT))
    pids: list[int] = wire(list_of(POSITIVE))


@_control(Kind.LOSS)
class Loss(Payload):
    """The batch's loss (already weighted by the replica's share) and the lr it trained with."""

    loss: float = wire(FLOAT)
    lr: float | None = wire(nullable(FLOAT))


@_control(Kind.OUTPUT)
class Output(Payload):
    """One microbatch's output (the message's tensors), and their tree when not a bare tuple."""

    tree: Any = wire(DATA, default=None)


@_control(Kind.ACK)
class Ack(Payload):
    """A command is done. A LOST's ACK names the gradient rounds, from the LOST's
    ``from_round - 1`` on, that the stage had already summed with the lost replica
    (``with_lost``: the driver's record of which stages a loss degraded)."""

    with_lost: list[int] | None = wire(list_of(COUNT), default=None)


@_control(Kind.STATE)
class State(_Names):
    """The stage module's state_dict tensors."""


@_control(Kind.SNAPSHOT)
class Snapshot(_Tree):
    """The stage's snapshot (see StageExecutor.snapshot)."""


@_control(Kind.TIME)
class Time(Payload):
    """The stage's clock (time.perf_counter_ns)."""

    ns: int = wire(COUNT)


@_control(Kind.TRACE)
class TraceRows(Payload):
    """The recorded action rows (the message's one tensor); ``truncated``: the ring buffer overflowed."""

    truncated: bool = wire(FLAG)

    def refuse(self, n_tensors: int) -> tuple[str, str] | None:
        return None if n_tensors == 1 else ("tensors", f"must be the one tensor of rows, not {n_tensors}")


@_control(Kind.LR)
class Lrs(Payload):
    """The stage's learning rates, per parameter group (StageExecutor.learning_rates)."""

    lrs: list[float] = wire(list_of(FLOAT))


@_control(Kind.STATS)
class Stats(Payload):
    """StageExecutor.stats (peak memory, skipped steps, recompute, compile figures) and the shared-memory waits."""

    peak_bytes: int | None = wire(nullable(COUNT))
    memory: str = wire(TEXT)
    skipped_steps: int = wire(COUNT)
    recompute: bool = wire(FLAG)
    shm_waits: int = wire(COUNT)
    compile_s: float = wire(FLOAT)  # torch.compile: seconds compiling (pipeq.stage.compiled)
    compiles: int = wire(COUNT)  # graphs compiled
    recompiles: int = wire(COUNT)  # compiles after a compiled function's first
    graph_breaks: int = wire(COUNT)
    compile_cache_hits: int = wire(COUNT)  # inductor's and AOTAutograd's cache hits
    backward_split: str | None = wire(nullable(TEXT), default=None)  # "I+W", "whole: <why>" (stage.split_backward)
    # what the stage holds (pipeq.stage.memory): its state now, its last measured step's activations
    param_bytes: int = wire(COUNT, default=0)
    grad_bytes: int = wire(COUNT, default=0)
    optimizer_bytes: int = wire(COUNT, default=0)
    measured_step: int | None = wire(nullable(INT), default=None)
    microbatches: int | None = wire(nullable(COUNT), default=None)
    activation_peak_bytes: int | None = wire(nullable(COUNT), default=None)
    activation_bytes_per_microbatch: int | None = wire(nullable(COUNT), default=None)
    activation_bytes_waiting_w: int | None = wire(nullable(COUNT), default=None)
    activation_bytes_in_backward: int | None = wire(nullable(COUNT), default=None)
    activation_bytes_in_input_grad: int | None = wire(nullable(COUNT), default=None)
    process_activation_peak_bytes: int | None = wire(nullable(COUNT), default=None)
    # a stage's parallel layers (pipeq.parallel.layers): its parameters gathered whole, its reductions' buckets
    gathered_param_bytes: int = wire(COUNT, default=0)
    reduce_bytes: int = wire(COUNT, default=0)


@_control(Kind.ERROR)
class ErrorReply(Payload):
    """A stage raised (its ``traceback``, the ``step`` it ran, when on its host's monotonic clock:
    ``at``); or a node agent reports one of its processes (``stage``: the process) or itself."""

    stage: int | None = wire(COUNT, default=None)
    message: str = wire(TEXT)
    traceback: str | None = wire(TEXT, default=None)
    step: int | None = wire(INT, default=None)
    at: float | None = wire(SECONDS, default=None)


@_control(Kind.HEARTBEAT)
class HeartbeatInfo(Payload):
    """A stage lives; ``doing``: the compute action it has been in for ``seconds`` (None while it
    waits for a message or a command). A node agent's heartbeats say nothing."""

    doing: str | None = wire(TEXT, default=None)
    seconds: float | None = wire(SECONDS, default=None, name="for")

    def refuse(self, n_tensors: int) -> tuple[str, str] | None:
        if (self.doing is None) != (self.seconds is None):
            return ("for" if self.seconds is None else "doing"), "must come with 'doing' and 'for' both"
        return None


# -- nested state ----------------------------------------------------------------------------------------
def state_message(cls: type[Snapshot] | type[Restore], step: int, state: Any, where: str) -> Message:
    """A SNAPSHOT or RESTORE message carrying nested ``state`` (``where`` names it in errors)."""
    return tree_message(cls.KIND, step, "snapshot", state, where)


def state_of(msg: Message) -> Any:
    """The nested state a SNAPSHOT or RESTORE message carries, checked."""
    kind = msg.kind
    read(msg, Snapshot if kind is Kind.SNAPSHOT else Restore)
    return tree_of(msg, "snapshot")
