"""The control protocol's typed payloads, and the supervisor's handling of them, without a process.

Every payload goes through the real codec (encode -> bytes -> decode) and comes back equal, its
``extra`` the same plain map the driver and workers always sent; every malformed payload (a field
missing, of the wrong type, out of range, or unknown) is refused with a ControlError naming the
message kind and the field. The supervisor, fed fake messages by a fake control server, turns a
stage's ERROR into a PipelineError naming the stage, fails a run whose stage sends a malformed
reply (naming it), and keeps track of what each stage's heartbeats say it computes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeq.control.supervisor import Supervisor
from pipeq.errors import CodecError, PipelineError
from pipeq.wire import codec, control
from pipeq.wire.control import (
    DATA_KINDS, Ack, AgentReady, Clock, ControlError, Drain, ErrorReply, Exit, GetLr, GetSnapshot, GetState,
    GetStats, GetTrace, HeartbeatInfo, Loss, Lost, Lrs, Output, Payload, Peers, Predict, Ready, Rejoin, Restore,
    SetState,
    Snapshot, State, Stats, StepScheduler, Stop, Time, TraceRows, Train,
)
from pipeq.wire.messages import Kind, Message
from pipeq.wire.control_link import AGENT, HEARTBEAT, STAGE, Peer

pytestmark = pytest.mark.timeout(30)

LAYOUT = {"names": ["0.weight", "0.bias"], "shapes": [[4, 2], [4]]}

#: One example of every payload, with the tensors its message carries.
EXAMPLES: list[tuple[Payload, int]] = [
    (Peers(next_forward="ipc:///tmp/x/s1-fwd", prev_backward=None), 0),
    (Peers(next_forward="tcp://10.0.0.2:5001", prev_backward="tcp://10.0.0.1:5000",
           tie_links=["tcp://10.0.0.1:6000", "tcp://10.0.0.3:6000"]), 0),
    (Peers(tie_links=["tcp://a:1", None], tie_shards=[["tcp://a:1", None], ["tcp://a:2", None]]), 0),
    (Peers(next_forward="ipc:///tmp/x/s4-fwd", rejoin_round=7), 0),
    (Train(sizes=[3, 3, 2], weights=[0.375, 0.375, 0.25]), 0),
    (Train(sizes=[2, 2], weights=[0.25, 0.25], shares=[0.5, 0.5]), 0),
    (Lost(replica=1), 0), (Rejoin(replica=1, round=12), 0),
    (Train(sizes=[2, 2], weights=[0.5, 0.5], aux_weights=[0.5, 0.5], stream=True,
           x=["t", [["T", 0], ["T", 1]]], nx=2, target=["T", 2]), 3),
    (Predict(sizes=[4]), 1),
    (Predict(sizes=[2, 2], x=["d", [["a", ["T", 0]]]], nx=1), 1),
    (GetState(), 0), (GetSnapshot(), 0), (Clock(), 0), (GetTrace(), 0), (Drain(), 0), (GetLr(), 0),
    (Stop(), 0), (Ack(), 0), (Exit(), 0), (Exit(abort=True), 0),
    (SetState(names=["0.weight", "0.bias"]), 2), (State(names=["w"]), 1),
    (Restore(snapshot={"model": {"__tensor__": 0}, "sched": [], "scaler": None}), 1),
    (Snapshot(snapshot={"model": {}, "rng": {"__tensor__": 0}}), 1),
    (StepScheduler(metric=0.5), 0), (StepScheduler(metric=None), 0),
    (GetStats(reset=True), 0),
    (Ready(forward="tcp://h:1", backward="tcp://h:2", pid=4242, device="cpu", replica=0, stage=1, shard=0,
           threads=1, host="node-a", cores=[2, 3], layout=LAYOUT), 0),
    (Ready(forward="f", backward="b", pid=7, device="cuda:1", replica=1, stage=0, shard=1, threads=4, host="h",
           cores=[], tie_link="tcp://h:9", layout={}), 0),
    (AgentReady(agent=1, stages=[2, 3], pids=[100, 101]), 0),
    (Loss(loss=1.25, lr=0.1), 0), (Loss(loss=float("inf"), lr=None), 0),
    (Output(), 2), (Output(tree=["t", [["T", 0], ["c", "kept"]]]), 1),
    (Time(ns=123456789), 0),
    (TraceRows(truncated=False), 1),
    (Lrs(lrs=[0.1, 0.01]), 0), (Lrs(lrs=[]), 0),
    (Stats(peak_bytes=1 << 30, memory="process peak RSS", skipped_steps=0, recompute=False, shm_waits=3, compile_s=0.0,
           compiles=0, recompiles=0, graph_breaks=0, compile_cache_hits=0), 0),
    (Stats(peak_bytes=None, memory="unavailable", skipped_steps=2, recompute=True, shm_waits=0, compile_s=12.5,
           compiles=2, recompiles=1, graph_breaks=0, compile_cache_hits=3), 0),
    (ErrorReply(message="ValueError: boom", traceback="Traceback ...", step=3, at=12.5), 0),
    (ErrorReply(stage=2, message="stage process (pid 9) was killed by SIGKILL"), 0),
    (ErrorReply(message="node 1 was started with another job"), 0),
    (HeartbeatInfo(), 0), (HeartbeatInfo(doing="F(step 1, microbatch 0)", seconds=0.25), 0),
]


def _over_the_wire(msg: Message) -> Message:
    """``msg`` as the receiving end of a socket gets it: encoded to bytes, decoded."""
    frames = codec.encode(msg.kind, msg.step, msg.microbatch, msg.tensors, msg.extra or None)
    return codec.decode([bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f for f in frames])


def _raw(kind: Kind, extra: dict[str, Any] | None = None, n_tensors: int = 0, step: int = 0) -> Message:
    """A message with a hand-made payload (what a buggy or hostile peer might send), over the wire."""
    return _over_the_wire(Message(kind, step, 0, [torch.zeros(2)] * n_tensors, extra or {}))


# -- round trips -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("payload", "n_tensors"), EXAMPLES, ids=lambda v: type(v).__name__ if isinstance(v, Payload)
                         else str(v))
def test_every_payload_round_trips_through_the_codec(payload: Payload, n_tensors: int) -> None:
    tensors = [torch.arange(4.0) + i for i in range(n_tensors)]
    got = _over_the_wire(control.message(payload, 5, 1, tensors))
    assert (got.kind, got.step, got.microbatch) == (payload.KIND, 5, 1)
    back = control.decode(got, from_agent=isinstance(payload, AgentReady))
    assert type(back) is type(payload) and back == payload
    assert control.read(got, type(payload), from_agent=isinstance(payload, AgentReady)) == payload
    assert all(torch.equal(a, b) for a, b in zip(got.tensors, tensors))


def test_every_control_kind_has_a_payload_and_an_example() -> None:
    covered = {p.KIND for p, _ in EXAMPLES}
    assert covered == set(Kind) - DATA_KINDS
    for kind in DATA_KINDS:  # data messages carry no control payload
        with pytest.raises(ControlError, match=f"malformed {kind.name} message: field 'kind'"):
            control.decode(Message(kind))


def test_the_payload_is_the_map_that_always_travelled() -> None:
    """``extra`` is the payload's fields by name: optional ones at their default are left out."""
    assert control.encode(Train(sizes=[2, 2], weights=[0.5, 0.5])) == {"sizes": [2, 2], "weights": [0.5, 0.5]}
    assert control.encode(Train(sizes=[1], weights=[1.0], stream=True, x=["T", 0], nx=1)) == {
        "sizes": [1], "weights": [1.0], "stream": True, "x": ["T", 0], "nx": 1}
    assert control.encode(HeartbeatInfo()) == {}
    assert control.encode(HeartbeatInfo(doing="B(step 2, microbatch 1)", seconds=1.5)) == {
        "doing": "B(step 2, microbatch 1)", "for": 1.5}
    assert control.encode(StepScheduler(metric=None)) == {"metric": None}  # a required field, even nil
    assert control.encode(Loss(loss=0.5, lr=None)) == {"loss": 0.5, "lr": None}
    assert control.encode(Peers(prev_backward="b")) == {"prev_backward": "b"}
    assert control.encode(ErrorReply(stage=1, message="m")) == {"stage": 1, "message": "m"}
    ready = control.encode(EXAMPLES[[type(p) for p, _ in EXAMPLES].index(Ready)][0])
    assert list(ready) == ["forward", "backward", "pid", "device", "replica", "stage", "shard", "threads", "host",
                           "cores", "layout"]
    assert control.message(Stop(), -3) == Message(Kind.STOP, -3)


def test_nested_state_travels_as_tree_data() -> None:
    state = {"model": {"w": torch.ones(2, 2)}, "sched": [{"last_epoch": 3, "best": float("inf")}], "scaler": None}
    got = _over_the_wire(control.state_message(Restore, -1, state, "stage 0's snapshot"))
    assert got.kind is Kind.RESTORE and len(got.tensors) == 1
    back = control.state_of(got)
    assert torch.equal(back["model"]["w"], torch.ones(2, 2)) and back["sched"] == state["sched"]
    bad = _raw(Kind.SNAPSHOT, {"snapshot": {"w": {"__tensor__": 3}}}, n_tensors=1)
    with pytest.raises(CodecError, match="refers to tensor 3 of 1"):
        control.state_of(bad)


# -- refusals ---------------------------------------------------------------------------------------
TRAIN = {"sizes": [2, 2], "weights": [0.5, 0.5]}


@pytest.mark.parametrize(("kind", "extra", "n_tensors", "field", "problem"), [
    (Kind.TRAIN, {"weights": [1.0]}, 0, "sizes", "is missing"),
    (Kind.TRAIN, {**TRAIN, "sizes": [2, -1]}, 0, "sizes", "non-empty list of integers >= 1"),
    (Kind.TRAIN, {**TRAIN, "sizes": [2, 0]}, 0, "sizes", "integers >= 1"),
    (Kind.TRAIN, {**TRAIN, "sizes": []}, 0, "sizes", "non-empty"),
    (Kind.TRAIN, {**TRAIN, "sizes": "2,2"}, 0, "sizes", "not '2,2'"),
    (Kind.TRAIN, {**TRAIN, "sizes": [2.0, 2.0]}, 0, "sizes", "integers"),
    (Kind.TRAIN, {**TRAIN, "sizes": [True, 2]}, 0, "sizes", "integers"),  # a bool is no size
    (Kind.TRAIN, {**TRAIN, "weights": [1, 1]}, 0, "weights", "list of floats"),
    (Kind.TRAIN, {**TRAIN, "weights": [0.5]}, 0, "weights", "1 weights for 2 microbatches"),
    (Kind.TRAIN, {**TRAIN, "aux_weights": [0.5, 0.5, 0.5]}, 0, "aux_weights", "3 weights for 2"),
    (Kind.TRAIN, {**TRAIN, "stream": 1}, 0, "stream", "true or false"),
    (Kind.TRAIN, {**TRAIN, "nx": -1}, 0, "nx", ">= 0"),
    (Kind.TRAIN, {**TRAIN, "nx": 3}, 2, "nx", "counts 3 tensors of x, but the message carries 2"),
    (Kind.TRAIN, {**TRAIN, "evil": "rm -rf"}, 0, "evil", "is not a field of TRAIN"),
    (Kind.PREDICT, {"sizes": None}, 0, "sizes", "not None"),
    (Kind.PREDICT, {"sizes": [1], "weights": [1.0]}, 0, "weights", "is not a field of PREDICT"),
    (Kind.PEERS, {"next_forward": 5}, 0, "next_forward", "a string"),
    (Kind.PEERS, {"replicas": ["a", "b"]}, 0, "replicas", "is not a field of PEERS"),
    (Kind.PEERS, {"tie_shards": ["a", "b"]}, 0, "tie_shards", "list of lists"),
    (Kind.SET_STATE, {"names": ["a", "b"]}, 1, "names", "names 2 tensors, but the message carries 1"),
    (Kind.SET_STATE, {"names": [1]}, 1, "names", "list of strings"),
    (Kind.RESTORE, {"snapshot": [1, 2]}, 0, "snapshot", "a map"),
    (Kind.STEP_SCHEDULER, {}, 0, "metric", "is missing"),
    (Kind.STEP_SCHEDULER, {"metric": 1}, 0, "metric", "a float or nil"),
    (Kind.GET_STATS, {"reset": "yes"}, 0, "reset", "true or false"),
    (Kind.GET_STATE, {"names": []}, 0, "names", "its fields: none"),
    (Kind.EXIT, {"abort": 1}, 0, "abort", "true or false"),
    (Kind.READY, {"forward": "f"}, 0, "backward", "is missing"),
    (Kind.LOSS, {"loss": "0.5", "lr": None}, 0, "loss", "a float"),
    (Kind.LOSS, {"loss": 0.5}, 0, "lr", "is missing"),
    (Kind.TIME, {"ns": -5}, 0, "ns", ">= 0"),
    (Kind.TRACE, {"truncated": False}, 0, "tensors", "the one tensor of rows, not 0"),
    (Kind.LR, {"lrs": [0.1, "0.2"]}, 0, "lrs", "list of floats"),
    (Kind.LR, {"lrs": {"lr": 0.1}}, 0, "lrs", "list of floats"),
    (Kind.STATS, {"peak_bytes": -1, "memory": "x", "skipped_steps": 0, "recompute": False, "shm_waits": 0}, 0,
     "peak_bytes", ">= 0 or nil"),
    (Kind.ERROR, {"traceback": "t"}, 0, "message", "is missing"),
    (Kind.ERROR, {"message": ["m"]}, 0, "message", "a string"),
    (Kind.ERROR, {"message": "m", "step": "3"}, 0, "step", "an integer"),
    (Kind.ERROR, {"message": "m", "at": float("nan")}, 0, "at", "finite number"),
    (Kind.ERROR, {"message": "m", "stage": -1}, 0, "stage", ">= 0"),
    (Kind.HEARTBEAT, {"doing": "F(step 1, microbatch 0)"}, 0, "for", "'doing' and 'for' both"),
    (Kind.HEARTBEAT, {"for": -1.0, "doing": "x"}, 0, "for", ">= 0"),
    (Kind.HEARTBEAT, {"doing": b"F", "for": 1.0}, 0, "doing", "a string"),
    (Kind.OUTPUT, {"tree": None, "x": 1}, 0, "x", "is not a field of OUTPUT"),
])
def test_a_malformed_payload_is_refused_naming_kind_and_field(kind, extra, n_tensors, field, problem) -> None:
    msg = _raw(kind, extra, n_tensors)
    with pytest.raises(ControlError, match=f"malformed {kind.name} message: field '{field}'") as info:
        control.decode(msg)
    assert info.value.kind is kind and info.value.field == field
    assert problem in str(info.value), str(info.value)
    assert isinstance(info.value, CodecError)  # what every wire refusal is


def test_an_agents_ready_is_not_a_stages() -> None:
    agent = control.message(AgentReady(agent=1, stages=[1], pids=[5]))
    with pytest.raises(ControlError, match="field 'agent' is not a field of READY"):
        control.decode(agent)  # from a stage: the stage's READY fields are expected
    assert control.decode(agent, from_agent=True) == AgentReady(agent=1, stages=[1], pids=[5])
    with pytest.raises(ControlError, match="field 'agent' must be an integer >= 1, not 0"):
        control.decode(_raw(Kind.READY, {"agent": 0, "stages": [], "pids": []}), from_agent=True)


def test_read_refuses_another_kind() -> None:
    with pytest.raises(ControlError, match="field 'kind' is ACK where LOSS was expected"):
        control.read(control.message(Ack(), 1), Loss)


def test_a_hostile_value_is_cut_short_in_the_error() -> None:
    deep: Any = 1
    for _ in range(500):
        deep = [deep]
    for value in ("x" * 100_000, deep, {"k" * 1000: ["v"] * 1000}):
        with pytest.raises(ControlError) as info:
            control.decode(_raw(Kind.LOSS, {"loss": value, "lr": None}))
        assert len(str(info.value)) < 200
    with pytest.raises(ControlError) as info:
        control.decode(_raw(Kind.ACK, {"k" * 100_000: 1}))
    assert len(str(info.value)) < 200 and "is not a field of ACK" in str(info.value)


def test_data_tree_reads_an_activations_tree() -> None:
    assert control.data_tree(_raw(Kind.ACTIVATION, None, 1)) is None
    assert control.data_tree(_raw(Kind.ACTIVATION, {"tree": ["T", 0]}, 1)) == ["T", 0]


# -- the supervisor, fed fake messages ----------------------------------------------------------------
class FakeServer:
    """A control server whose "received" messages are queued by the test (each over the wire)."""

    address = "ipc:///nowhere/control"

    def __init__(self) -> None:
        self.inbox: list[tuple[Peer | None, Message]] = []
        self.sent: list[tuple[int, Message]] = []

    def push(self, peer: Peer | None, msg: Message) -> None:
        self.inbox.append((peer, _over_the_wire(msg)))

    def recv(self, timeout_ms: int) -> tuple[Peer | None, Message] | None:
        return self.inbox.pop(0) if self.inbox else None

    def send_many(self, messages: list[tuple[int, Message]]) -> None:
        self.sent += messages


class Run:
    """A supervisor of ``n`` stage processes (two nodes) over a fake server; records teardowns."""

    def __init__(self, n: int = 3, **kw: Any) -> None:
        self.server = FakeServer()
        self.teardowns = 0
        self.sup = Supervisor(self.server, {}, n_stages=n, n_processes=n, n_nodes=2,  # type: ignore[arg-type]
                              heartbeat_timeout=60.0, teardown=self.teardown, **{"step_timeout": None, **kw})
        self.sup.expect_heartbeats()

    def teardown(self) -> None:
        self.teardowns += 1


def test_a_stages_error_fails_the_run_naming_the_stage() -> None:
    run = Run()
    run.server.push(Peer(STAGE, 2), control.message(Loss(loss=1.0, lr=None), 9))  # stale: dropped
    run.server.push(Peer(STAGE, 1), control.message(ErrorReply(message="RuntimeError: boom",
                                                               traceback="Traceback: line 1", step=1, at=3.0)))
    with pytest.raises(PipelineError, match="stage 1: RuntimeError: boom") as info:
        run.sup.collect(Kind.LOSS, {2: 1}, step=1, timeout=5.0)
    err = info.value
    assert err.stage == 1 and err.remote_traceback == "Traceback: line 1" and err.replica is None
    assert run.sup.failure is err and run.teardowns == 1
    with pytest.raises(PipelineError, match="has failed and is closed"):
        run.sup.check_usable()


def test_an_agents_error_names_its_stage_and_node() -> None:
    run = Run()
    run.server.push(Peer(AGENT, 1), control.message(ErrorReply(stage=2, message="stage process (pid 7) was killed")))
    with pytest.raises(PipelineError, match=r"stage 2: stage process \(pid 7\) was killed \(on node 1\)") as info:
        run.sup.collect(Kind.ACK, {0: 1}, step=-1, timeout=5.0)
    assert info.value.stage == 2
    run = Run()  # an agent reporting itself, or a process that is not one of the run's
    run.server.push(Peer(AGENT, 1), control.message(ErrorReply(stage=99, message="interrupted")))
    with pytest.raises(PipelineError, match=r"^interrupted \(on node 1\)$") as info:
        run.sup.collect(Kind.ACK, {0: 1}, step=-1, timeout=5.0)
    assert info.value.stage is None


def test_an_error_of_a_later_step_is_deferred_until_its_step() -> None:
    run = Run()
    run.sup.awaited |= {(Kind.LOSS, 1), (Kind.LOSS, 2)}
    run.server.push(Peer(STAGE, 0), control.message(ErrorReply(message="ValueError: late", step=2)))
    run.server.push(Peer(STAGE, 2), control.message(Loss(loss=0.5, lr=0.1), 1))
    got = run.sup.collect(Kind.LOSS, {2: 1}, step=1, timeout=5.0)
    assert control.read(got[2][0], Loss) == Loss(loss=0.5, lr=0.1) and run.sup.deferred is not None
    assert run.teardowns == 0
    with pytest.raises(PipelineError, match="stage 0: ValueError: late"):
        run.sup.collect(Kind.LOSS, {2: 1}, step=2, timeout=5.0)
    assert run.teardowns == 1


@pytest.mark.parametrize(("peer", "msg", "match"), [
    (Peer(STAGE, 2), _raw(Kind.LOSS, {"loss": "high", "lr": None}, step=1),
     r"stage 2: malformed LOSS message: field 'loss' must be a float, not 'high'"),
    (Peer(STAGE, 1), _raw(Kind.ERROR, {"msg": "no message field"}),
     r"stage 1: malformed ERROR message: field 'msg' is not a field of ERROR"),
    (Peer(HEARTBEAT, 0), _raw(Kind.HEARTBEAT, {"doing": "F", "for": "long"}),
     r"stage 0: malformed HEARTBEAT message: field 'for' must be a finite number >= 0"),
    (Peer(STAGE, 0), _raw(Kind.READY, {"pid": 1}),
     r"stage 0: malformed READY message: field 'forward' is missing"),
    (Peer(AGENT, 1), _raw(Kind.ERROR, {"stage": "two", "message": "m"}),
     r"^malformed ERROR message: field 'stage' must be an integer >= 0, not 'two' \(from node 1's agent\)$"),
])
def test_a_malformed_message_from_a_stage_fails_the_run_naming_it(peer, msg, match) -> None:
    run = Run()
    run.server.inbox.append((peer, msg))
    with pytest.raises(PipelineError, match=match):
        run.sup.collect(Kind.LOSS, {2: 1}, step=1, timeout=5.0)
    assert run.teardowns == 1 and run.sup.failure is not None


def test_messages_from_strangers_are_ignored_however_malformed() -> None:
    run = Run()
    run.server.inbox += [(None, _raw(Kind.ERROR, {"message": "forged"})),
                         (None, _raw(Kind.LOSS, {"loss": "x"})),
                         (Peer(STAGE, 7), _raw(Kind.ERROR, {"bogus": 1})),  # no such process in this run
                         (Peer(AGENT, 5), _raw(Kind.ERROR, {"message": "no such node"}))]
    run.server.push(Peer(STAGE, 2), control.message(Loss(loss=2.0, lr=None), 1))
    got = run.sup.collect(Kind.LOSS, {2: 1}, step=1, timeout=5.0)
    assert control.read(got[2][0], Loss).loss == 2.0 and run.teardowns == 0


def test_heartbeats_say_what_each_stage_computes() -> None:
    run = Run(step_timeout=2.0)
    beat = HeartbeatInfo(doing="F(step 1, microbatch 0)", seconds=0.5)
    run.server.push(Peer(HEARTBEAT, 1), control.message(beat, 1))
    run.server.push(Peer(HEARTBEAT, 2), control.message(HeartbeatInfo(doing="STEP(step 1)", seconds=1), 1))
    run.server.push(Peer(STAGE, 0), control.message(Ack(), -1))
    run.sup.collect(Kind.ACK, {0: 1}, step=-1, timeout=5.0)
    assert run.sup.doing == {1: ("F(step 1, microbatch 0)", 0.5), 2: ("STEP(step 1)", 1.0)}
    run.server.push(Peer(HEARTBEAT, 1), control.message(HeartbeatInfo(), 2))  # waiting again: nothing
    run.server.push(Peer(STAGE, 0), control.message(Ack(), -2))
    run.sup.collect(Kind.ACK, {0: 1}, step=-2, timeout=5.0)
    assert run.sup.doing == {2: ("STEP(step 1)", 1.0)}
    # a stage whose heartbeats say it has been in one action past step_timeout is the one named
    run.server.push(Peer(HEARTBEAT, 2), control.message(HeartbeatInfo(doing="B(step 3, microbatch 1)",
                                                                      seconds=2.5), 3))
    with pytest.raises(PipelineError, match=r"stage 2: stuck: has been in B\(step 3, microbatch 1\) for 2.5 s"):
        run.sup.collect(Kind.ACK, {0: 1}, step=-3, timeout=5.0)
    assert run.teardowns == 1


def test_a_silent_stage_is_named() -> None:
    run = Run(n=2)
    run.sup.heartbeat_timeout = 0.3
    beat = _over_the_wire(control.message(HeartbeatInfo(), 1))
    run.server.recv = lambda timeout_ms: (Peer(HEARTBEAT, 0), beat)  # type: ignore[method-assign]  # stage 1 is silent
    with pytest.raises(PipelineError, match=r"stage 1: no heartbeat for 0\.\d s \(heartbeat_timeout=0.3\)"):
        run.sup.collect(Kind.ACK, {0: 1}, step=-1, timeout=5.0)
    assert run.teardowns == 1
