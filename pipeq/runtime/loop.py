"""A stage process's event loop: the driver's commands, carried out for every stage the process holds.

A process holds ``v >= 1`` stages, its chunks (:class:`Chunk`). To the driver each is what a stage
always is, with a control channel of its own; the loop waits for a command on any of them and
carries it out:

    PEERS      connect the stage's forward/backward channels to the neighbours' addresses (with
               tied weights: to the stages of other processes sharing them; with replicas: make
               the replicas' group, start from replica 0's weights, reply ACK)
    TRAIN      run the schedule's actions for one batch (x rides along to stage 0, the target
               to the stages that compute a loss, its stage inputs to each stage that takes
               some: pipeq.runtime.batch_command); the last stage replies LOSS
    DRAIN      finish a stream's leftover work (asynchronous 1F1B's last backwards), reply ACK
    PREDICT    run forward-only actions; the output stage replies OUTPUT per microbatch
    GET_STATE  reply STATE (the stage module's state_dict tensors)
    SET_STATE  load them, reply ACK
    GET_SNAPSHOT  reply SNAPSHOT (parameters, optimizer and scheduler state, RNG: checkpoints)
    RESTORE    load a snapshot, reply ACK
    CLOCK      reply TIME with this process's clock (aligning traces)
    GET_TRACE  reply TRACE: the stage's actions recorded since its last GET_TRACE (pipeq.trace)
    GET_STATS  reply STATS: peak memory (``reset``: start a new peak), skipped steps, the bytes
               the stage holds (``measure``: its next training step's activations measured)
    STEP_SCHEDULER  step the lr schedulers once (with the metric it carries), reply ACK
    GET_LR     reply LR (the learning rate of every parameter group)
    LOST       a replica is lost (fault_tolerance="replicas"): gradients are summed without it from
               the round it names on (a stage waiting in a collective takes it from the queue at
               once); reply ACK once the rounds before are summed (pipeq.parallel.membership)
    REJOIN     the lost replica is rebuilt: the replicas' group with it again, reply ACK
    STOP       (after every earlier command is done) reply ACK: all this stage's traffic is over
    EXIT       leave the loop (once every stage of the process is told, or 5 s after the first)

A stage's commands run in the order they came. A batch (TRAIN, PREDICT, DRAIN) runs once every
stage of the process has it, as the process's one action list (:func:`pipeq.runtime.interpreter.execute`,
which asks the loop for every message that crosses a process); a stage given a batch waits, its
later commands too, until then.

While a compute action (forward, backward, optimizer step) runs, the loop notes which one and
since when (the interpreter calls :meth:`EventLoop.note` as it starts one; cleared when the
process turns to its messages or its next command): the heartbeat threads report it
(:meth:`EventLoop.doing`), so that the driver can name a stage stuck in its own computation
(``step_timeout``) rather than its waiting neighbours. Every command is decoded with its
payload's checks (:mod:`pipeq.wire.control`) before it is carried out.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Sequence

from pipeq import schedules
from pipeq.runtime.batch_command import batch_parts
from pipeq.runtime.config import ChunkConfig, WorkerConfig
from pipeq.runtime.faults import inject
from pipeq.runtime.interpreter import ChunkBatch, Keys, ProcessPlan, chunk_error, execute, on_chunk
from pipeq.runtime.links import PeerLinks, swap_ties
from pipeq.runtime.requests import STATS, Emit, Recv, Request, Send, SwapTies
from pipeq.schedules import Op
from pipeq.stage import microbatch
from pipeq.stage.executor import StageExecutor
from pipeq.stage.memory import MemoryMeter
from pipeq.trace import format as trace
from pipeq.wire import control
from pipeq.wire.control import (Ack, Clock, Drain, Exit, GetLr, GetSnapshot, GetState, GetStats, GetTrace,
                                HeartbeatInfo, Loss, Lost, Lrs, Output, Payload, Peers, Predict, Rejoin, Restore,
                                SetState, Snapshot, State, Stats, StepScheduler, Stop, Time, Train, TraceRows)
from pipeq.wire.messages import Message
from pipeq.wire.transport import Transport

__all__ = ["Chunk", "EventLoop"]

_BATCH = (Train, Predict, Drain)
#: commands that make collectives: reading a state held in pieces (a sharded or tensor-parallel
#: stage's, pipeq.stage.state), and making the replicas' groups (PEERS, REJOIN). A process of
#: several stages answers them once every stage has its command, in chunk order, as every other
#: process of the mesh does
_READS = (GetState, GetSnapshot)
_GROUPS = (Peers, Rejoin)
EXIT_GRACE_S = 5.0  # how long a process told EXIT for one stage waits for its other stages' EXIT


class Chunk:
    """One stage of the process: its place (``cfg``), executor, links to its replicas and tie
    peers (None without), and with ``traced`` the record of its actions (:mod:`pipeq.trace`)."""

    def __init__(self, c: int, cfg: ChunkConfig, executor: StageExecutor, links: PeerLinks | None,
                 traced: bool) -> None:
        self.c, self.cfg, self.stage = c, cfg, cfg.stage
        self.executor = executor
        self.links = links
        self.trace: collections.deque[tuple[int, ...]] | None = (
            collections.deque(maxlen=trace.MAX_ROWS) if traced else None)
        self.rec = self.trace.append if self.trace is not None else None

    def take_trace(self) -> tuple[list[tuple[int, ...]], bool]:
        """The rows recorded since the last call, and whether the record overflowed."""
        rows = list(self.trace or ())
        if self.trace is not None:
            self.trace.clear()
        return rows, len(rows) == trace.MAX_ROWS


class EventLoop:
    """Serves the driver's commands for the stages ``chunks`` of one process until EXIT, over
    ``transport`` (a :class:`~pipeq.wire.transport.ProcessTransport`, or a shard's view of one)."""

    def __init__(self, cfg: WorkerConfig, transport: Transport, chunks: Sequence[Chunk]) -> None:
        self.cfg = cfg
        self.transport = transport
        self.chunks = list(chunks)
        self.executors = [ch.executor for ch in self.chunks]
        MemoryMeter.share([ex.memory for ex in self.executors])  # the process's activation peak
        self.plan = ProcessPlan(cfg.schedule, cfg.index, cfg.n_stages)
        self.step: int | None = None  # the TRAIN/PREDICT step being run (named in an ERROR)
        self.trained = 0  # TRAINs begun in this process (an evaluation's PREDICTs are steps too, not these)
        # the compute action under way: (trace code, microbatch, monotonic start, chunk), None
        # between actions (waiting for a message or a command); read by the heartbeat threads
        self.current: tuple[int, int, float, int] | None = None
        self._paused: tuple[int, int, float, int] | None = None
        self._keys: Any = None  # the running batch's microbatch -> (step, microbatch), see run

    # -- what the process computes (for the heartbeats) ---------------------------------------
    def waiting(self, waits: bool) -> None:
        """A collective waits for the stage's other processes (True: not computing), or is over (False)."""
        if waits:
            self._paused, self.current = self.current, None
        elif self._paused is not None:
            code, j, _, c = self._paused
            self._paused, self.current = None, (code, j, time.monotonic(), c)

    def note(self, code: int, j: int, c: int = 0) -> None:
        """The interpreter starts compute action ``code`` on microbatch ``j`` of chunk ``c``."""
        self.current = (code, j, time.monotonic(), c)

    def doing(self, c: int = 0) -> HeartbeatInfo:
        """The compute action chunk ``c``'s stage has under way and for how long (its heartbeat's
        report); an empty report while it is not computing (waiting for input, or for a command,
        or another stage of the process computes)."""
        cur = self.current
        if cur is None or cur[3] != c:
            return HeartbeatInfo()
        code, j, since, _ = cur
        step = self.step or 0
        if code == trace.OPT_STEP:
            name = f"STEP(step {step})"
        else:
            keys = self._keys
            s, mb = keys.get(j, (step, j)) if keys is not None else (step, j)
            name = f"{trace.OPS[code][0]}(step {s}, microbatch {mb})"
        return HeartbeatInfo(doing=name, seconds=round(time.monotonic() - since, 3))

    # -- commands ------------------------------------------------------------------------------
    def serve(self) -> None:
        """Carry out the commands until EXIT (see the module)."""
        v = len(self.chunks)
        mesh = self.cfg.mesh
        together = _BATCH
        if v > 1 and mesh is not None:
            together += _GROUPS + (_READS if mesh.slice_size > 1 else ())
        batch: dict[int, tuple[Any, Message]] = {}
        exits: set[int] = set()  # the stages told EXIT: the process leaves once all are (the
        deadline = 0.0           # driver's sends to the others must still find them), or 5 s on
        while len(exits) < v and not (exits and time.monotonic() > deadline):
            ready = [c for c in range(v) if c not in batch and c not in exits]
            got = self.transport.next_command(ready, 100 if exits else 1000)
            if got is None:
                continue
            c, msg = got
            # a malformed command raises: the driver gets it as ERROR, from the stage it was for
            cmd = on_chunk(self.executors, c, control.decode, msg)
            if isinstance(cmd, Exit):
                exits.add(c)
                deadline = deadline or time.monotonic() + EXIT_GRACE_S
            elif isinstance(cmd, together):
                batch[c] = (cmd, msg)
                if len(batch) == v:
                    if isinstance(cmd, _READS + _GROUPS):
                        self.answer_each([batch[k] for k in range(v)])
                    else:
                        self.run_batch([batch[k] for k in range(v)])
                    batch.clear()
            else:
                answer = on_chunk(self.executors, c, self.answer, self.chunks[c], cmd, msg)
                if answer is not None:
                    self.transport.send_control(c, answer)

    def answer_each(self, given: list[tuple[Any, Message]]) -> None:
        """Every stage's command (``given[c]``: chunk c's), answered in chunk order."""
        for c, (cmd, msg) in enumerate(given):
            answer = on_chunk(self.executors, c, self.answer, self.chunks[c], cmd, msg)
            if answer is not None:
                self.transport.send_control(c, answer)

    def answer(self, ch: Chunk, cmd: Payload, msg: Message) -> Message | None:
        """Carry out command ``cmd`` (which ``msg`` carries) for stage ``ch``; the reply to send, if any."""
        ex, step = ch.executor, msg.step
        if isinstance(cmd, GetState):
            names, tensors = ex.state_tensors()
            return control.message(State(names=names), step, 0, tensors)
        if isinstance(cmd, SetState):
            ex.load_state(cmd.names, msg.tensors)
        elif isinstance(cmd, GetSnapshot):
            return control.state_message(Snapshot, step, ex.snapshot(), f"stage {ch.stage}'s snapshot")
        elif isinstance(cmd, Restore):
            ex.restore(control.state_of(msg))
        elif isinstance(cmd, GetStats):
            if cmd.measure:
                ex.memory.ask()
            return control.message(Stats(**ex.stats(reset=cmd.reset), **ex.memory.figures(),
                                         shm_waits=self.transport.shm_waits(ch.c)), step)
        elif isinstance(cmd, StepScheduler):
            ex.scheduler_step(cmd.metric)
        elif isinstance(cmd, GetLr):
            return control.message(Lrs(lrs=ex.learning_rates()), step)
        elif isinstance(cmd, Clock):
            return control.message(Time(ns=time.perf_counter_ns()), step)
        elif isinstance(cmd, GetTrace):
            rows, truncated = ch.take_trace()
            return control.message(TraceRows(truncated=truncated), step, 0, [trace.rows_to_tensor(rows)])
        elif isinstance(cmd, Peers):
            self.transport.connect(ch.c, cmd.next_forward, cmd.prev_backward)
            if ch.links is None or not ch.links.join(cmd):
                return None  # (with replicas, the driver waits for their ACK)
        elif isinstance(cmd, Lost) and ch.links is not None:
            ch.links.replica_lost(cmd, step)  # (its ACK, if any, is the link's to send)
            return None
        elif isinstance(cmd, Rejoin) and ch.links is not None:
            ch.links.replica_back(cmd.replica, cmd.round)
        elif not isinstance(cmd, Stop):
            raise RuntimeError(f"stage {ch.stage}: unexpected command {msg.kind.name}")
        return control.message(Ack(), step)

    # -- batches -------------------------------------------------------------------------------
    def run_batch(self, given: list[tuple[Any, Message]]) -> None:
        """Run one batch (or a DRAIN) on every stage of the process; ``given[c]``: chunk c's command."""
        if len({type(cmd) for cmd, _ in given}) != 1 or len({msg.step for _, msg in given}) != 1:
            raise RuntimeError(f"the stages of one process were given different batches: "
                               f"{[type(c).__name__ for c, _ in given]} for steps {sorted({m.step for _, m in given})}")
        cmd0, msg0 = given[0]
        if isinstance(cmd0, Drain):
            self.run(self.plan.drain(), self.step or 0, self.plan.keys)
            for ch, (_, msg) in zip(self.chunks, given):
                self.transport.send_control(ch.c, control.message(Ack(), msg.step))
            return
        training = isinstance(cmd0, Train)
        step = self.step = msg0.step
        if training:
            self._before_training(given)
        parts = []
        for ch, (cmd, msg) in zip(self.chunks, given):
            ex = ch.executor
            x, target, inputs = on_chunk(self.executors, ch.c, batch_parts, cmd, msg.tensors, ch.stage, ex.is_first,
                                         ex.needs_target and training)
            parts.append(ChunkBatch(x, target, getattr(cmd, "weights", None), getattr(cmd, "aux_weights", None), inputs))
        actions, keys = self.plan.begin(self.executors, step, cmd0.sizes, training, parts,
                                        stream=training and cmd0.stream)
        last = next((ch for ch in self.chunks if ch.executor.is_last), None)
        lr = last.executor.learning_rate() if last is not None and training else None  # the one this batch trains with
        self.run(actions, step, keys)
        if last is not None and training:
            self.transport.send_control(last.c, control.message(Loss(loss=last.executor.mean_loss(), lr=lr), step))

    def _before_training(self, given: list[tuple[Any, Message]]) -> None:
        """A TRAIN's replica shares to each stage's gradient rounds; a fault injected on purpose
        (at the process's ``trained``-th training step: evaluations between do not count)."""
        self.trained += 1
        for ch, (cmd, _) in zip(self.chunks, given):
            if ch.links is not None:
                ch.links.note_train(cmd.shares)
        fault = self.cfg.fault
        for ch in self.chunks if fault is not None else ():
            on_chunk(self.executors, ch.c, inject, fault, ch.stage, self.trained, self.cfg.replica,
                     lambda code, j, c=ch.c: self.note(code, j, c), named=given[0][1].step)

    def run(self, actions: list[schedules.Action], step: int, keys: Any) -> None:
        """Run ``actions``, answering the interpreter's requests with the transport. Messages are
        keyed (step, microbatch); in a stream, ``keys`` gives each microbatch number's key."""
        self._keys = keys
        gen = execute(self.executors, actions, [ch.trace for ch in self.chunks], keys, self.note)
        value: Any = None
        req: Any = None
        try:
            while True:
                req = gen.send(value)
                self.current = None  # no compute action under way: messages
                value = self.carry_out(req, step, keys)
        except StopIteration:
            pass
        except Exception as exc:  # the interpreter's are ChunkErrors already; a request's names its chunk
            if req is None:
                raise
            c = req.chunk if type(req) is not SwapTies else next(iter(req.outgoing))
            err = chunk_error(exc, len(self.chunks), self.chunks[c].stage, c)
            if err is None:
                raise
            raise err from exc
        finally:
            self.current = None

    def carry_out(self, req: Request, step: int, keys: Keys | None) -> Any:
        """One request of the interpreter (:mod:`pipeq.runtime.requests`), carried out with the
        transport; what the interpreter gets back (a receive's tensors)."""
        if type(req) is SwapTies:
            return swap_ties([ch.links for ch in self.chunks], req.round, req.outgoing)
        transport, c = self.transport, req.chunk
        rec = self.chunks[c].rec
        t0 = time.perf_counter_ns() if rec else 0
        j = req.microbatch
        s, j = keys[j] if keys is not None and j != STATS else (step, j)
        if type(req) is Recv:
            if req.op is Op.RECV_ACT:
                got = transport.wait_activation(c, s, j)
                tree = control.data_tree(got)
                value = got.tensors if tree is None else microbatch.Packed.of(got.tensors, tree)
                code = trace.WAIT_ACT
            else:
                value = transport.wait_gradient(c, s, j).tensors
                code = trace.WAIT_GRAD
            if rec:
                rec((code, s, j, t0, time.perf_counter_ns(), _nbytes(value)))
            return value
        tensors = req.tensors
        if type(req) is Send and req.op is Op.SEND_ACT:
            transport.send_activation(c, s, j, tensors, microbatch.spec_of(tensors))
            code = trace.SEND_ACT
        elif type(req) is Send:
            transport.send_gradient(c, s, j, tensors)
            code = trace.SEND_GRAD
        elif type(req) is Emit:
            transport.send_control(c, control.message(Output(tree=microbatch.spec_of(tensors)), s, j, tensors))
            code = trace.EMIT
        else:  # pragma: no cover - the interpreter makes no other request
            raise RuntimeError(f"stage {self.chunks[c].stage}: unknown request {req!r}")
        if rec:
            rec((code, s, j, t0, time.perf_counter_ns(), _nbytes(tensors)))
        return None


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
