"""Watching a run's processes while the driver waits on them: replies, errors, deaths, silence.

Every wait of the driver goes through :meth:`Supervisor.collect`, which files the replies it
waits for and, on the way, ends the run with a :class:`~pipeq.PipelineError` naming the
stage (and replica) at fault when

- a stage (or a node's agent, for a remote stage) reports an ERROR, with its traceback;
- a local stage process has exited (os._exit, a signal, the OOM killer), noticed within ~0.1 s;
- a stage's heartbeats stopped for ``heartbeat_timeout`` seconds (hung, or its host cut off);
- with ``step_timeout``: a stage has been in one compute action (a forward, a backward, an
  optimizer step) for longer than that, by its own heartbeats' account. Each heartbeat says
  which action the stage is computing and for how long; a stage waiting for a message from a
  peer, or for a command, reports none, so the stage named is the one stuck in its own
  computation, never its waiting neighbours, and a long step whose actions keep finishing is fine.

Every message from one of the run's processes is checked as it arrives (its payload, see
:mod:`pipeq.wire.control`): a malformed one ends the run too, naming its sender. Messages from
anyone else are ignored.

Only time spent waiting counts against the heartbeat timeout: a caller that paused between two
calls does not make its stages look dead. On a failure the ``teardown`` callback stops every
process before the error is raised.

With several training steps in flight (``runner.stream``), a stage that fails in step s has done
its part of every earlier step (a stage runs its steps in order), so those can still finish: the
failure is *deferred* until the caller waits for step s, then raised. Every message read on the
way is filed, never dropped: a reply someone will wait for is kept until then.

With ``fault_tolerance="replicas"`` a failure is first offered to ``absorb(g, error)``
(:mod:`pipeq.control.replica_loss`): when it takes it, the failed process's replica is dropped
and its processes *ignored* (their messages, deaths and silence) instead of the run ending; a
collect then waits for the others only.
"""

from __future__ import annotations

from pipeq.control.stage_handle import StageHandle
from pipeq.control.waiting import ERROR_IN_FLIGHT_S, SHARD_CAUSE_S, wait_until
import time
from typing import Callable

from pipeq.errors import CodecError, PipelineError
from pipeq.wire import control
from pipeq.wire.control import ControlError, ErrorReply, HeartbeatInfo, Payload
from pipeq.wire.messages import REPLIES, Kind, Message
from pipeq.control.processes import Numbering, exit_reason, of_stages
from pipeq.wire.control_link import AGENT, HEARTBEAT, STAGE, ControlServer, Peer
from pipeq.wire.errors import PeerUnreachable

_POLL_MS = 100


__all__ = ["Supervisor", "KeptReplies"]


def _raised_at(reply: ErrorReply) -> float:
    """When a stage's ERROR was raised (its host's monotonic clock), if it says."""
    return float(reply.at) if reply.at is not None else float("inf")


class Supervisor:
    """Files the replies the driver waits for; fails the run on an error, a death or silence."""

    def __init__(self, server: ControlServer, procs: dict[int, StageHandle], *, n_stages: int, n_processes: int,
                 n_nodes: int, heartbeat_timeout: float, step_timeout: float | None, teardown: Callable[[], None],
                 numbering: Numbering | None = None) -> None:
        """``heartbeat_timeout``, ``step_timeout``: the run's (:class:`~pipeq.FaultConfig`; None: off);
        ``numbering`` names a process's replica, stage and shard (default: one shard each)."""
        self.server = server
        self.procs = procs  # this host's stage processes, by process number g
        self.n_stages = n_stages
        self.n_processes = n_processes
        self.n_nodes = n_nodes
        self.numbering = numbering if numbering is not None else Numbering(n_stages, max(1, n_processes // n_stages))
        self.heartbeat_timeout = heartbeat_timeout
        self.step_timeout = step_timeout
        self.teardown = teardown
        # per process: (compute action under way, seconds in it) from its latest heartbeat
        self.doing: dict[int, tuple[str, float]] = {}
        self.failure: PipelineError | None = None
        # heartbeats are judged once a stage is READY (see expect_heartbeats)
        self.last_beat = [float("inf")] * n_processes
        self._last_health = 0.0
        # replies that will be collected later (a stream's later batches): kept when they come early
        self.awaited: set[tuple[Kind, int]] = set()
        #: stages' replies that came before they were waited for, until their waiter takes them
        self.kept = KeptReplies()
        # a failure in a later step than the one being waited for: (step, error), raised then
        self.deferred: tuple[int, PipelineError] | None = None
        self._excused: set[int] = set()  # processes that failed with a deferred error
        self._collecting: int | None = None  # the training step whose loss collect() waits for
        self._waiting: tuple[Kind, int] | None = None  # the (kind, step) collect() waits for
        # fault_tolerance="replicas": absorb(g, error) -> True when process g's failure is taken
        # (its replica dropped) rather than ending the run; the processes of a dropped replica
        self.absorb: Callable[[int, PipelineError], bool] | None = None
        self.ignored: set[int] = set()
        self.watch: Callable[[], None] | None = None  # called at every health check (replica_loss)

    # -- naming the culprit ------------------------------------------------------------------
    def known(self, peer: Peer | None) -> bool:
        """Whether ``peer`` is one of this run's stage processes (or their heartbeats) or agents."""
        if peer is None:
            return False
        if peer.role == AGENT:
            return 0 < peer.index < self.n_nodes
        return peer.index < self.n_processes

    def error(self, message: str, g: int | None, traceback: str | None = None) -> PipelineError:
        """A PipelineError naming process g's stage (and its replica with data parallelism, its
        shard with tensor parallelism)."""
        if g is None:
            return PipelineError(message, None, traceback)
        num = self.numbering
        return PipelineError(message, num.stage(g), traceback,
                             replica=num.replica(g) if num.replicas > 1 else None,
                             shard=num.shard(g) if num.shards > 1 else None)

    def error_of(self, peer: Peer, reply: ErrorReply) -> PipelineError:
        """The PipelineError an ERROR from ``peer`` reports."""
        if peer.role == AGENT:  # an agent reports one of its processes (or itself)
            g = reply.stage if reply.stage is not None and reply.stage < self.n_processes else None
            return self.error(f"{reply.message} (on node {peer.index})", g, reply.traceback)
        return self.error(reply.message, peer.index, reply.traceback)

    def payload_of(self, peer: Peer, msg: Message) -> Payload:
        """The payload of a message from one of ours, checked before anything reads it: a
        malformed one fails the run, naming its sender."""
        try:
            return control.decode(msg, from_agent=peer.role == AGENT)
        except ControlError as exc:
            agent = peer.role == AGENT
            raise self.fail(self.error(f"{exc}" + (f" (from node {peer.index}'s agent)" if agent else ""),
                                       None if agent else peer.index))

    def fail(self, err: PipelineError) -> PipelineError:
        """Record the run's failure, stop every process; returns ``err`` for the caller to raise."""
        self.failure = err
        self.teardown()
        return err

    def _give_up(self, err: PipelineError, g: int | None) -> None:
        """Process g has failed: absorbed (its replica dropped, fault_tolerance="replicas"), or
        the run's end (raised)."""
        if g is not None and self.absorb is not None and g not in self.ignored and self.absorb(g, err):
            return
        raise self.fail(err)

    def ignore(self, processes: list[int]) -> None:
        """A dropped replica's processes: from now on nothing of theirs counts (their replies kept
        for later are dropped too)."""
        self.ignored.update(processes)
        for g in processes:
            self.doing.pop(g, None)
        self.kept.drop(self.ignored)

    # -- health --------------------------------------------------------------------------------
    def expect_heartbeats(self) -> None:
        """Every stage is READY: from now on a silent one is failed."""
        self.last_beat = [time.monotonic()] * self.n_processes

    def begin_wait(self) -> float:
        """Heartbeats are judged from now on: silence while nobody waited is not a failure."""
        now = time.monotonic()
        self.last_beat = [max(b, now) for b in self.last_beat]
        self._last_health = now
        return now

    def check_health(self) -> None:
        now = time.monotonic()
        self._last_health = now
        for g, p in list(self.procs.items()):
            code = p.exitcode if g not in self.ignored else None
            if code is not None and g not in self._excused:
                self.error_in_flight(lambda: g in self._excused or g in self.ignored)
                if g not in self._excused and g not in self.ignored:
                    self._give_up(self.error(f"stage process (pid {p.pid}){self.held(p)} {exit_reason(code)}", g), g)
        for g in range(self.n_processes):
            if now - self.last_beat[g] > self.heartbeat_timeout and g not in self._excused | self.ignored:
                self._give_up(self.error(
                    f"no heartbeat for {now - self.last_beat[g]:.1f} s (heartbeat_timeout="
                    f"{self.heartbeat_timeout}); the stage is hung or unreachable", g), g)
        if self.step_timeout is not None:
            stuck = [(age, g, what) for g, (what, age) in self.doing.items()
                     if age > self.step_timeout and g not in self._excused | self.ignored]
            if stuck:
                age, g, what = max(stuck)  # the longest stuck: any other is waiting on it
                self._give_up(self.error(
                    f"stuck: has been in {what} for {age:.1f} s with no progress (step_timeout="
                    f"{self.step_timeout} s); its neighbours are waiting for it", g), g)
        if self.watch is not None:
            self.watch()

    def error_in_flight(self, done: Callable[[], bool]) -> None:
        """Half a second for the ERROR a stage sent just before it exited (until ``done()``): it
        names the failure better than the exit or the gone socket that revealed it."""
        def read(left: float) -> None:
            got = self.read_error(max(1, min(50, int(left * 1000))))
            if got is not None:
                self._error(*got)  # raised, or deferred behind an earlier step (excusing its process)

        wait_until(done, ERROR_IN_FLIGHT_S, read)

    def _beat(self, peer: Peer, payload: Payload, now: float) -> None:
        """Anything from a stage process shows it alive; its heartbeat also says what it computes."""
        self.last_beat[peer.index] = now
        if peer.role == HEARTBEAT and isinstance(payload, HeartbeatInfo):
            if payload.doing is not None and payload.seconds is not None:
                self.doing[peer.index] = (payload.doing, float(payload.seconds))
            else:
                self.doing.pop(peer.index, None)

    def check_usable(self) -> None:
        if self.failure is not None:
            raise PipelineError(f"the pipeline has failed and is closed: {self.failure}")

    def _recv(self, timeout_ms: int) -> tuple[Peer | None, Message] | None:
        try:
            return self.server.recv(timeout_ms)
        except CodecError as exc:
            raise self.fail(PipelineError(f"malformed message on the control channel: {exc}"))

    def read_error(self, timeout_ms: int) -> tuple[Peer, ErrorReply] | None:
        """The next ERROR from one of ours, filing everything else that arrives (heartbeats,
        replies someone will wait for); None when none came within ``timeout_ms``, however many
        other messages did (heartbeats of many stages may never leave the socket quiet)."""
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            left = deadline - time.monotonic()
            r = self._recv(max(0, int(left * 1000)))
            if r is None:
                return None
            peer, msg = r
            if not self.known(peer) or (peer is not None and peer.role != AGENT and peer.index in self.ignored):
                continue  # not one of our workers (or one of a dropped replica's): ignored
            assert peer is not None
            payload = self.payload_of(peer, msg)
            if peer.role != AGENT:
                self._beat(peer, payload, time.monotonic())
            if isinstance(payload, ErrorReply) and peer.role != HEARTBEAT:
                return peer, payload
            if peer.role == STAGE:
                self._keep(peer.index, msg)
            if left <= 0 < timeout_ms:
                return None  # (timeout 0 drains what is pending instead)

    def _keep(self, g: int, msg: Message) -> None:
        """A stage's reply that is not the one being waited for (or is, read on the way, e.g. while
        looking for the ERROR in flight of a dead process): kept for whoever awaits it."""
        if (msg.kind, msg.step) in self.awaited or (msg.kind, msg.step) == self._waiting:
            self.kept.keep(g, msg)
        elif msg.kind not in REPLIES:
            raise self.fail(self.error(f"protocol error: unexpected {msg.kind.name}", g))
        # else: a stale reply to a command whose caller was interrupted (e.g. by Ctrl-C)

    def _oldest_outstanding(self) -> int | None:
        """The earliest training step whose loss is still to come (being or to be collected)."""
        steps = [s for kind, s in self.awaited if kind is Kind.LOSS]
        if self._collecting is not None:
            steps.append(self._collecting)
        return min(steps, default=None)

    def _error(self, peer: Peer, reply: ErrorReply) -> None:
        """An ERROR: raised now, or deferred while an earlier step than its own is outstanding."""
        err = self.error_of(peer, reply)
        if peer.role == STAGE:
            err = self.origin_shard(peer.index, reply, err)
            if self.absorb is not None and peer.index not in self.ignored and self.absorb(peer.index, err):
                return
        step, oldest = reply.step, self._oldest_outstanding()
        if (peer.role == STAGE and step is not None and oldest is not None and step > oldest
                and ((Kind.LOSS, step) in self.awaited or step == self._collecting)):
            if self.deferred is None or step < self.deferred[0]:
                self.deferred = (step, err)
            self._excused.add(peer.index)
            return
        raise self.fail(err)

    # -- waiting and sending -----------------------------------------------------------------------
    def collect(
        self, kind: Kind, counts: dict[int, int], *, step: int = 0, timeout: float | None = None,
        what: str = "reply", on_timeout: Callable[[set[int]], str] | None = None,
    ) -> dict[int, list[Message]]:
        """Wait for ``counts[g]`` replies ``(kind, step)`` from each process g, watching every
        process; ``on_timeout(missing)`` may add a hint to the time-out's message. Replies for an
        ``awaited`` (kind, step) that arrive meanwhile are kept for their own collect; any other
        reply is stale (its caller was interrupted) and dropped."""
        training = kind is Kind.LOSS
        if self.deferred is not None and (not training or step >= self.deferred[0]):
            raise self.fail(self.deferred[1])
        self._collecting = step if training else None
        self._waiting = (kind, step)
        try:
            return self._collect(kind, counts, step, timeout, what, on_timeout)
        finally:
            self._collecting = self._waiting = None

    def _collect(self, kind: Kind, counts: dict[int, int], step: int, timeout: float | None, what: str,
                 on_timeout: Callable[[set[int]], str] | None) -> dict[int, list[Message]]:
        start = self.begin_wait()
        got: dict[int, list[Message]] = {g: [] for g in counts}
        missing = {g for g, c in counts.items() if c > 0 and g not in self.ignored}
        self.awaited.discard((kind, step))

        def take(g: int, msg: Message) -> None:
            got[g].append(msg)
            if len(got[g]) == counts[g]:
                missing.discard(g)

        for g, msg in self.kept.take(kind, step):
            take(g, msg)
        deadline = None if timeout is None else start + timeout
        while missing:
            r = self._recv(_POLL_MS)
            now = time.monotonic()
            if r is not None and self.known(r[0]) and not (r[0] is not None and r[0].role != AGENT  # type: ignore[union-attr]
                                                           and r[0].index in self.ignored):
                # (anything else is not one of ours, or one of a dropped replica's: ignored)
                peer, msg = r
                assert peer is not None
                payload = self.payload_of(peer, msg)
                if peer.role != AGENT:
                    self._beat(peer, payload, now)
                if isinstance(payload, ErrorReply) and peer.role != HEARTBEAT:
                    self._error(peer, payload)
                elif peer.role == STAGE:
                    if msg.kind is kind and msg.step == step and peer.index in missing:
                        take(peer.index, msg)
                    else:
                        self._keep(peer.index, msg)
            if r is None or now - self._last_health > _POLL_MS / 1000:
                self.check_health()  # (a READY, a LOSS it read looking for an ERROR in flight: kept)
                for g, msg in self.kept.take(kind, step):
                    if g in missing:
                        take(g, msg)
            missing -= self.ignored  # a replica dropped meanwhile: not waited for
            if deadline is not None and now > deadline:
                hint = on_timeout(missing) if on_timeout is not None else ""
                raise self.fail(PipelineError(
                    f"timed out after {timeout} s waiting for {kind.name} ({what}) from stage(s) "
                    f"{sorted(missing)}" + (f"; {hint}" if hint else "")))
        return got

    def drain_pending(self) -> None:
        """Handle what arrived while no call was waiting (an ERROR above all), without blocking."""
        while (got := self.read_error(0)) is not None:
            self._error(*got)

    def send_all(self, messages: list[tuple[int, Message]]) -> None:
        """Send ``(process, message)`` pairs after checking that every process is alive. All are
        encoded before any is sent: a bad input leaves no stage half-commanded."""
        if self.deferred is not None:  # a stage has failed: nothing new can run
            raise self.fail(self.deferred[1])
        self.drain_pending()
        self.begin_wait()
        self.check_health()
        if self.ignored:  # a dropped replica's processes are gone: nothing for them
            messages = [(g, m) for g, m in messages if g not in self.ignored]
        try:
            self.server.send_many(messages)
        except PeerUnreachable as exc:
            raise self.unreachable(exc)

    def held(self, p: StageHandle) -> str:
        """The words ``" of stages 1 and 2"`` when process ``p`` holds several stages (virtual stages),
        else ``""``. Its death is named by the first of them: it takes them all, and which one a kill
        was aimed at is not known."""
        return of_stages({self.numbering.stage(g) for g, q in self.procs.items() if q is p})

    def take_kept(self, kind: Kind, step: int, count: int) -> dict[int, Message] | None:
        """The kept ``(kind, step)`` replies by process, once ``count`` processes have sent
        one (then no longer awaited); None until then (they stay kept). Never waits."""
        if self.kept.count(kind, step) < count:
            return None
        self.awaited.discard((kind, step))
        return dict(self.kept.take(kind, step))

    def unreachable(self, exc: PeerUnreachable) -> PipelineError:
        """The run's failure when a send found a stage's control socket gone (raised here when an
        ERROR in flight or the stage's exit names it better); returned for the caller to raise."""
        self.error_in_flight(lambda: self.deferred is not None)
        if self.deferred is not None:
            raise self.fail(self.deferred[1])
        self.check_health()  # names the stage and how it ended if it exited
        return self.fail(self.error("its control socket is gone", exc.process))

    def origin_shard(self, g: int, reply: ErrorReply, err: PipelineError) -> PipelineError:
        """Tensor parallelism: the shards of a stage compute together, so one shard's failure
        makes the others fail too (their collective's peer is gone). Of the errors and deaths of
        process g's stage within half a second, the first is the one named: a shard killed by a
        signal (it reports nothing), else the ERROR raised first (``at``: the shards share a host,
        hence a monotonic clock)."""
        num = self.numbering
        if num.shards == 1 or g >= num.total:
            return err
        group = set(num.group(num.lead(g)))
        first = {g: (_raised_at(reply), err)}
        end = time.monotonic() + SHARD_CAUSE_S
        while time.monotonic() < end and len(first) < len(group):
            for other in sorted(group - set(first)):
                p = self.procs.get(other)
                if p is not None and p.exitcode is not None and p.exitcode < 0:
                    return self.error(f"stage process (pid {p.pid}) {exit_reason(p.exitcode)}; then "
                                      f"{num.where(g)} failed: {err.message}", other)
            got = self.read_error(20)
            if got is not None and got[0].role == STAGE and got[0].index in group:
                first.setdefault(got[0].index, (_raised_at(got[1]), self.error_of(*got)))
        return min(first.values(), key=lambda pair: pair[0])[1]


class KeptReplies:
    """Stages' replies that came while the supervisor waited for something else, kept by
    ``(kind, step)`` for whoever awaits them."""

    def __init__(self) -> None:
        self._kept: dict[tuple[Kind, int], list[tuple[int, Message]]] = {}

    def keep(self, g: int, msg: Message) -> None:
        self._kept.setdefault((msg.kind, msg.step), []).append((g, msg))

    def take(self, kind: Kind, step: int) -> list[tuple[int, Message]]:
        """The ``(kind, step)`` replies kept so far, as (process, message), taken out of keeping
        (they stay awaited). Never waits."""
        return self._kept.pop((kind, step), [])

    def count(self, kind: Kind, step: int) -> int:
        """How many processes sent a ``(kind, step)`` reply that is kept."""
        return len({g for g, _ in self._kept.get((kind, step), [])})

    def drop(self, processes: set[int]) -> None:
        """Forget what ``processes`` sent (a dropped replica's)."""
        for key, got in list(self._kept.items()):
            self._kept[key] = [(g, m) for g, m in got if g not in processes]


