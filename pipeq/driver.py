"""Process mode's control plane: starts one worker process per stage and talks to them.

The driver owns the control channel's ROUTER socket. It starts the workers (multiprocessing
``spawn``: the stage modules, loss and optimizer factory are handed over at process start, never
over a socket), waits for each to report READY with its bound addresses, tells every worker its
neighbours' addresses, and then sends commands and collects replies.

Failures are watched on every wait: an ERROR message from a stage, a stage process that exited
(os._exit, a signal, the OOM killer) and a stage whose heartbeats stopped all end in
:class:`~pipeq.errors.PipelineError` naming the stage, after every worker has been stopped and the
ipc directory removed. Workers die with the driver (PR_SET_PDEATHSIG plus a parent watch).
"""

from __future__ import annotations

import collections
import multiprocessing as mp
import os
import signal
import threading
import time
from typing import Any, Callable, Sequence

import torch

from . import codec
from . import trace as tr
from .codec import Kind, Message
from .errors import CodecError, PipelineError
from .schedules import ScheduleFn
from .stage import Tensors
from . import rendezvous as rdzv
from .rendezvous import Rendezvous
from .transport import ControlServer, PeerUnreachable, make_ipc_dir, remove_ipc_dir
from .worker import StageBuilder, WorkerConfig, worker_entry

_POLL_MS = 100
# Replies a worker sends to a command; one of these that no one waits for any more (the caller was
# interrupted, e.g. by Ctrl-C) is stale and dropped.
_REPLIES = frozenset({Kind.LOSS, Kind.OUTPUT, Kind.STATE, Kind.SNAPSHOT, Kind.ACK, Kind.TIME, Kind.TRACE})


def plan_devices(
    n_stages: int, devices: Sequence[str] | None, rendezvous: Rendezvous | None = None
) -> list[tuple[str, list[int], int]]:
    """(device, cpu cores, threads) per local stage: CUDA round-robin when present, else a CPU share.

    Under torchrun/srun several pipeq nodes may share a host: LOCAL_RANK / LOCAL_WORLD_SIZE then
    give this node its GPU (cuda:LOCAL_RANK) or its slice of the host's cores.
    """
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    local_rank = rendezvous.local_rank if rendezvous is not None else None
    local_size = rendezvous.local_world_size if rendezvous is not None else None
    if local_rank is not None and local_size and local_size > 1 and len(cores) >= local_size:
        share = len(cores) // local_size
        cores = cores[local_rank * share:(local_rank + 1) * share]
    per = max(1, len(cores) // n_stages)
    plan = []
    for k in range(n_stages):
        if devices is not None:
            dev = devices[k]
        elif torch.cuda.is_available():
            if local_rank is not None:
                dev = f"cuda:{local_rank % torch.cuda.device_count()}"
            else:
                dev = f"cuda:{k % torch.cuda.device_count()}"
        else:
            dev = "cpu"
        start = (k * per) % len(cores)
        mine = [cores[(start + i) % len(cores)] for i in range(per)]
        plan.append((dev, mine, per))
    return plan


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def job_identity(payload: "bytes | StageBuilder", schedule: "str | ScheduleFn") -> dict[str, Any]:
    """What every node of a multi-host run must agree on (compared by the agents)."""
    recipe = payload.describe() if isinstance(payload, StageBuilder) else {}
    return {"schedule": tr.schedule_label(schedule), "recipe": recipe}


def exit_reason(code: int) -> str:
    return f"was killed by {_signal_name(code)}" if code < 0 else f"exited with code {code}"


def start_worker(ctx: Any, cfg: WorkerConfig, payload: "bytes | StageBuilder") -> mp.process.BaseProcess:
    p = ctx.Process(target=worker_entry, args=(cfg, payload), name=f"pipeq-stage{cfg.stage}", daemon=True)
    p.start()
    return p


def stop_processes(procs: Sequence[mp.process.BaseProcess], grace: float = 3.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds: nothing outlives this call."""
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join(5.0)
    for p in procs:
        if p.exitcode is not None:
            p.close()


class ProcessBackend:
    """Runs the stages as processes: all on this host, or (``rendezvous``) spread over nodes.

    ``payloads[k]`` is what stage k is built from: pickled (module, loss, optimizer factory,
    scheduler factory) bytes, or a :class:`~pipeq.worker.StageBuilder` (required for stages on
    other nodes, which are started by their node's agent and never receive pickles).
    """

    def __init__(
        self,
        payloads: Sequence["bytes | StageBuilder"],
        schedule: "str | ScheduleFn",
        *,
        devices: Sequence[str] | None,
        threads_per_stage: int | None,
        transport: str,
        host: str,
        queue_capacity: int,
        heartbeat_interval: float,
        heartbeat_timeout: float,
        start_timeout: float,
        spin_s: float,
        start_method: str = "spawn",
        stop_timeout: float = 60.0,
        rendezvous: Rendezvous | None = None,
        placement: Sequence[Sequence[int]] | None = None,
        trace: str | None = None,
        microbatches: int = 0,
        target_stages: Sequence[int] | None = None,
        output_stage: int | None = None,
        replicas: int = 1,
    ) -> None:
        # payloads: replica 0's stages 0..N-1, then replica 1's...; process g = r * N + k
        self.R = replicas
        self.P = len(payloads)
        # which stages get the target (the last; all with interlocking; stage 0 with AL) and which
        # one returns predict's output (the last; stage 0 when AL decodes back down)
        n_stages = len(payloads) // replicas
        self.target_stages = set(target_stages) if target_stages is not None else {n_stages - 1}
        self.output_stage = n_stages - 1 if output_stage is None else output_stage
        self.trace_path = trace
        self.microbatches = microbatches
        # traced commands (pipeq.trace), as many as the stages' ring buffers can hold
        self.spans: collections.deque[tuple[int, bool, int, int, int]] = collections.deque(maxlen=tr.MAX_ROWS)
        self.clocks: list[list[tr.ClockSample]] = []
        self.start_method = start_method
        self.stop_timeout = stop_timeout
        self.payloads = list(payloads)
        self.n = self.P // self.R  # stages per replica
        self.dp_store: Any = None
        self.schedule = schedule
        self.devices = devices
        self.threads_per_stage = threads_per_stage
        self.transport = "tcp" if rendezvous is not None else transport
        self.host = rendezvous.bind if rendezvous is not None else host
        self.queue_capacity = queue_capacity
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.start_timeout = start_timeout
        self.spin_s = spin_s
        self.rendezvous = rendezvous
        if rendezvous is not None:
            self.placement = rdzv.placement(self.P, rendezvous.nnodes, placement)
        else:
            self.placement = [list(range(self.P))]
        self.local = self.placement[0]
        self.store: Any = None
        self.procs: dict[int, mp.process.BaseProcess] = {}
        self.server: ControlServer | None = None
        self.ipc_dir: str | None = None
        self.last_beat: list[float] = []
        self.failure: PipelineError | None = None
        self._last_health = 0.0
        self._control_id = 0
        self.worker_info: list[dict[str, Any]] = []

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self._teardown()
            raise

    def _start(self) -> None:
        rz = self.rendezvous
        if rz is not None:
            self.store = rz.store(self.start_timeout)
        self.ipc_dir = make_ipc_dir()
        where = self.ipc_dir if self.transport == "ipc" else self.host
        self.server = ControlServer(self.transport, where)
        if rz is not None:  # tell the other nodes where to find us and what each of them runs
            self.store.set("placement", rdzv.encode_json(self.placement))
            self.store.set("job", rdzv.encode_json(job_identity(self.payloads[0], self.schedule)))
            self.store.set("options", rdzv.encode_json({"trace": self.trace_path is not None,
                                                         "replicas": self.R}))
            self.store.set("control", rdzv.encode_json(self.server.address))
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            # The fork server imports torch and pipeq once; each stage is then a cheap fork of it
            # (stages start in ~50 ms instead of ~2 s; the fork server outlives the runner).
            ctx.set_forkserver_preload(["pipeq._preload"])
        dp_address = None
        if self.R > 1:  # the replicas' process groups meet at a store: the rendezvous, or ours
            if rz is not None:
                dp_address = rz.store_address()
            else:
                from torch.distributed import TCPStore

                self.dp_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
                dp_address = ("127.0.0.1", self.dp_store.port, "pipeq/")
        devices = [self.devices[g % self.n] for g in self.local] if self.devices is not None else None
        plan = plan_devices(len(self.local), devices, rz)
        main_thread = threading.current_thread() is threading.main_thread()
        # stage seeds come from the caller's RNG: torch.manual_seed before the runner repeats a run
        base_seed = int(torch.randint(0, 2**62, ()).item())
        for g, (dev, cores, threads) in zip(self.local, plan):
            k = g % self.n
            cfg = WorkerConfig(
                stage=k,
                n_stages=self.n,
                schedule=self.schedule,
                control_addr=self.server.address,
                transport=self.transport,
                where=where,
                device=dev,
                cores=cores,
                threads=self.threads_per_stage or threads,
                queue_capacity=self.queue_capacity,
                heartbeat_interval=self.heartbeat_interval,
                spin_s=self.spin_s,
                # PDEATHSIG fires when the *thread* that started us exits: only safe from main.
                die_with_parent=main_thread,
                driver_pid=os.getpid(),
                seed=(self.payloads[g].seed_for(k) if isinstance(self.payloads[g], StageBuilder)
                      else base_seed + g),
                store=rz.store_address() if rz is not None else None,
                trace=self.trace_path is not None,
                replica=g // self.n, replicas=self.R, process=g, dp_store=dp_address,
            )
            self.procs[g] = start_worker(ctx, cfg, self.payloads[g])
        self.last_beat = [float("inf")] * self.P  # heartbeats are watched once a stage is READY
        replies = self._collect(Kind.READY, dict.fromkeys(range(self.P), 1),
                                timeout=self.start_timeout, what="start")
        ready = {g: msgs[0] for g, msgs in replies.items()}
        for g in range(self.P):  # neighbours within the replica
            k = g % self.n
            extra: dict[str, Any] = {}
            if k + 1 < self.n:
                extra["next_forward"] = ready[g + 1].extra["forward"]
            if k > 0:
                extra["prev_backward"] = ready[g - 1].extra["backward"]
            self.server.send(g, codec.encode(Kind.PEERS, extra=extra))
        self.worker_info = [ready[g].extra for g in range(self.P)]
        if self.trace_path is not None:
            self.clocks = [[s] for s in self._measure_clocks()]

    def close(self) -> None:
        """Stop every worker and remove the ipc files.

        Two phases: STOP lets each stage finish what it was sent and answer ACK (so an error in
        the last step still reaches the caller, and no message is in flight any more); EXIT
        then ends the processes. Stragglers get SIGTERM, then SIGKILL.
        """
        if self.server is None or self.failure is not None:
            self._teardown()
            return
        traced = None
        try:
            req = self._next_control_id()
            self._send_all([(g, codec.encode(Kind.STOP, req)) for g in range(self.P)])
            self._collect(Kind.ACK, dict.fromkeys(range(self.P), 1), step=req,
                          timeout=self.stop_timeout, what="stop")
            if self.trace_path is not None:
                traced = self._fetch_trace()
            self._send_all([(g, codec.encode(Kind.EXIT, req)) for g in range(self.P)])
            deadline = time.monotonic() + 5.0
            for p in self.procs.values():
                p.join(max(0.0, deadline - time.monotonic()))
        finally:  # whatever happened (Ctrl-C included), no process or ipc file outlives close()
            self._teardown()
        if traced is not None and self.trace_path is not None:
            tr.write(self.trace_path, traced)

    def _teardown(self) -> None:
        if self.server is not None and self.rendezvous is not None:
            # Remote stages and agents: tell them to go (their agents also see us vanish).
            abort = codec.encode(Kind.EXIT, 0, 0, (), {"abort": self.failure is not None})
            for ident in [b"s%d" % g for g in range(self.P) if g not in self.procs] + [
                b"a%d" % r for r in range(1, len(self.placement))
            ]:
                self.server.send_to(ident, abort)
        stop_processes(list(self.procs.values()))
        self.procs = {}
        if self.server is not None:
            self.server.close(linger_ms=500 if self.rendezvous is not None else 0)
            self.server = None
        remove_ipc_dir(self.ipc_dir)
        self.ipc_dir = None
        self.dp_store = None

    # -- failure handling ------------------------------------------------------------------
    def _stage_of(self, ident: bytes) -> tuple[str, int] | None:
        """('s' or 'h', stage) for our workers, ('a', node) for our agents, None for anything else."""
        role, num = ident[:1], ident[1:]
        if not num.isdigit():
            return None
        if role in (b"s", b"h") and int(num) < self.P:
            return role.decode(), int(num)
        if role == b"a" and 0 < int(num) < len(self.placement):
            return "a", int(num)
        return None

    def _err(self, message: str, g: int | None, traceback: str | None = None) -> PipelineError:
        """A PipelineError naming process g's stage (and its replica, with data parallelism)."""
        if g is None:
            return PipelineError(message, None, traceback)
        return PipelineError(message, g % self.n, traceback, replica=g // self.n if self.R > 1 else None)

    def _error_of(self, got: tuple[bytes, Message]) -> PipelineError:
        role, num = self._stage_of(got[0])  # type: ignore[misc]
        extra = got[1].extra
        if role == "a":  # an agent reports one of its processes (or itself)
            g = extra.get("stage") if type(extra.get("stage")) is int else None
            return self._err(str(extra.get("message", "failed")) + f" (on node {num})", g, extra.get("traceback"))
        return self._err(str(extra.get("message", "failed")), num, extra.get("traceback"))

    @staticmethod
    def _is_echo(err: PipelineError) -> bool:
        """An error that only says a peer of the gradient all-reduce went away."""
        text = (err.message or "").lower()
        return "gloo" in text or "nccl" in text or "connection reset" in text or "connection closed" in text

    def _blame(self, err: PipelineError) -> PipelineError:
        """With replicas, a stage's error may only echo a peer that failed in the middle of their
        gradient all-reduce: wait briefly for the peer's own error, or name the peer that died."""
        if self.R == 1 or not self._is_echo(err) or self.server is None:
            return err
        echoes = {(err.replica or 0) * self.n + (err.stage or 0)}
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            got = self.server.recv(20)
            if got is not None and got[1].kind is Kind.ERROR and self._stage_of(got[0]) is not None:
                other = self._error_of(got)
                if not self._is_echo(other):
                    return other
                echoes.add((other.replica or 0) * self.n + (other.stage or 0))
        for g, p in self.procs.items():
            if g not in echoes and p.exitcode is not None and p.exitcode != 0:
                return self._err(f"stage process (pid {p.pid}) {exit_reason(p.exitcode)}", g)
        return err

    def _fail(self, err: PipelineError) -> PipelineError:
        self.failure = err
        self._teardown()
        return err

    def _check_health(self) -> None:
        now = time.monotonic()
        self._last_health = now
        for k, p in self.procs.items():
            code = p.exitcode
            if code is not None:
                # An ERROR may still be in flight from a stage that raised and exited: prefer it.
                end = time.monotonic() + 0.5
                while self.server is not None and time.monotonic() < end:
                    got = self.server.recv(50)
                    if got is not None and got[1].kind is Kind.ERROR:
                        raise self._fail(self._error_of(got))
                raise self._fail(self._err(f"stage process (pid {p.pid}) {exit_reason(code)}", k))
        for k in range(self.P):
            if now - self.last_beat[k] > self.heartbeat_timeout:
                raise self._fail(self._err(
                    f"no heartbeat for {now - self.last_beat[k]:.1f} s (heartbeat_timeout="
                    f"{self.heartbeat_timeout}); the stage is hung or unreachable", k))

    def _check_usable(self) -> None:
        if self.failure is not None:
            raise PipelineError(f"the pipeline has failed and is closed: {self.failure}")
        if self.server is None:
            raise PipelineError("the pipeline is not running; use 'with runner:' or runner.start()")

    def _collect(
        self, kind: Kind, counts: dict[int, int], *, step: int = 0, timeout: float | None = None,
        what: str = "reply",
    ) -> dict[int, list[Message]]:
        """Wait for ``counts[k]`` replies ``(kind, step)`` from each stage k, watching every worker.

        Only time spent waiting here counts against the heartbeat timeout: a caller that paused
        between two calls does not make its stages look dead.
        """
        assert self.server is not None
        start = self._begin_wait()
        got: dict[int, list[Message]] = {k: [] for k in counts}
        missing = {k for k, c in counts.items() if c > 0}
        deadline = None if timeout is None else start + timeout
        while missing:
            try:
                r = self.server.recv(_POLL_MS)
            except CodecError as exc:
                raise self._fail(PipelineError(f"malformed message on the control channel: {exc}"))
            now = time.monotonic()
            if r is not None:
                who = self._stage_of(r[0])
                msg = r[1]
                if who is not None:  # anything else is not one of our workers: ignore it
                    role, stage = who
                    if role != "a":
                        self.last_beat[stage] = now
                    if role == "h" or role == "a" and msg.kind is not Kind.ERROR:
                        pass
                    elif msg.kind is Kind.ERROR:
                        raise self._fail(self._blame(self._error_of(r)))
                    elif msg.kind is kind and msg.step == step and stage in missing:
                        got[stage].append(msg)
                        if len(got[stage]) == counts[stage]:
                            missing.discard(stage)
                    elif msg.kind not in _REPLIES:
                        raise self._fail(self._err(
                            f"protocol error: got {msg.kind.name} while waiting for {kind.name}", stage))
            if r is None or now - self._last_health > _POLL_MS / 1000:
                self._check_health()
            if deadline is not None and now > deadline:
                raise self._fail(PipelineError(
                    f"timed out after {timeout} s waiting for {kind.name} ({what}) from stage(s) "
                    f"{sorted(missing)}" + self._start_hint(missing, what)))
        return got

    def _start_hint(self, missing: set[int], what: str) -> str:
        """Multi-host start-up: which missing stages reached the rendezvous, and where they run."""
        if what != "start" or self.store is None or self.rendezvous is None:
            return ""
        rz = self.rendezvous
        hints = []
        for node, stages in enumerate(self.placement):
            lost = [k for k in stages if k in missing]
            if not lost:
                continue
            try:
                seen = [k for k in lost if self.store.check([f"stage/{k}"])]
            except Exception:
                seen = []
            if seen:
                hints.append(f"stage(s) {seen} (node {node}) registered at the rendezvous but never "
                             f"reached the control channel {self.server.address if self.server else ''}: "
                             f"is that port reachable from node {node}?")
            if len(seen) < len(lost):
                hints.append(f"stage(s) {[k for k in lost if k not in seen]} (node {node}) never "
                             f"registered at the rendezvous {rz.master_addr}:{rz.master_port}: is "
                             f"node {node} started (pipeq launch ... --node-rank {node})?")
        return "; " + "; ".join(hints)

    def _begin_wait(self) -> float:
        """Heartbeats are judged from now on: silence while nobody waited is not a failure."""
        now = time.monotonic()
        self.last_beat = [max(b, now) for b in self.last_beat]
        self._last_health = now
        return now

    def _drain_pending(self) -> None:
        """Handle what arrived while no call was waiting (an ERROR above all), without blocking."""
        assert self.server is not None
        while True:
            try:
                r = self.server.recv(0)
            except CodecError as exc:
                raise self._fail(PipelineError(f"malformed message on the control channel: {exc}"))
            if r is None:
                return
            who = self._stage_of(r[0])
            if who is not None and who[0] in ("s", "a") and r[1].kind is Kind.ERROR:
                raise self._fail(self._blame(self._error_of(r)))

    def _send_all(self, messages: list[tuple[int, list[Any]]]) -> None:
        """Send encoded messages to their stages, after checking that every stage is alive.

        Messages are encoded by the caller before this is called, so a message that cannot be
        encoded is refused before any stage has been told anything (no half-sent command).
        """
        assert self.server is not None
        self._drain_pending()
        self._begin_wait()
        self._check_health()
        for k, frames in messages:
            try:
                self.server.send(k, frames)
            except PeerUnreachable:
                self._check_health()  # names the stage and its own error if it died
                raise self._fail(self._err("its control socket is gone", k))

    def _next_control_id(self) -> int:
        self._control_id -= 1  # control requests count down, steps count up: never equal
        return self._control_id

    # -- commands --------------------------------------------------------------------------
    def step(
        self, step: int, sizes: list[int], weights: list[float], x: torch.Tensor, target: torch.Tensor
    ) -> float:
        return self.step_replicated(step, [(sizes, weights)], x, target)

    def step_replicated(
        self, step: int, shards: list[tuple[list[int], ...]], x: torch.Tensor, target: torch.Tensor
    ) -> float:
        """One step: replica r trains on the r-th shard of the batch (its microbatch sizes and
        loss weights, relative to the whole batch); returns the whole batch's loss."""
        self._check_usable()
        msgs = []
        offset = 0
        for r, shard in enumerate(shards):
            sizes, weights = shard[0], shard[1]
            n = sum(sizes)
            xr, tr_ = x[offset:offset + n], target[offset:offset + n]
            offset += n
            extra: dict[str, Any] = {"sizes": sizes, "weights": weights}
            if len(shard) > 2:  # auxiliary heads' loss weights, relative to the whole batch too
                extra["aux_weights"] = shard[2]
            for k in range(self.n):
                tensors = ([xr] if k == 0 else []) + ([tr_] if k in self.target_stages else [])
                msgs.append((r * self.n + k, codec.encode(Kind.STEP, step, 0, tensors, extra)))
        t0 = time.perf_counter_ns()
        self._send_all(msgs)
        lasts = {r * self.n + self.n - 1: 1 for r in range(len(shards))}
        replies = self._collect(Kind.LOSS, lasts, step=step, what=f"step {step}")
        if self.trace_path is not None:
            self.spans.append((step, True, t0, time.perf_counter_ns(), len(shards[0][0])))
        # each replica's loss is already weighted by its share of the batch: they add up
        return sum(float(replies[g][0].extra["loss"]) for g in lasts)

    def predict(self, step: int, sizes: list[int], x: torch.Tensor) -> list[Tensors]:
        self._check_usable()
        last = self.n - 1
        extra = {"sizes": sizes}
        t0 = time.perf_counter_ns()
        self._send_all([(k, codec.encode(Kind.PREDICT, step, 0, [x] if k == 0 else [], extra))
                        for k in range(self.n)])
        out = self.output_stage
        msgs = self._collect(Kind.OUTPUT, {out: len(sizes)}, step=step, what=f"predict {step}")[out]
        if self.trace_path is not None:
            self.spans.append((step, False, t0, time.perf_counter_ns(), len(sizes)))
        msgs.sort(key=lambda m: m.microbatch)
        return [tuple(m.tensors) for m in msgs]

    def get_state(self) -> list[tuple[list[str], list[torch.Tensor]]]:
        self._check_usable()
        req = self._next_control_id()
        self._send_all([(k, codec.encode(Kind.GET_STATE, req)) for k in range(self.n)])
        got = self._collect(Kind.STATE, dict.fromkeys(range(self.n), 1), step=req, what="state_dict")
        return [(list(got[k][0].extra["names"]), got[k][0].tensors) for k in range(self.n)]

    def set_state(self, per_stage: list[tuple[list[str], list[torch.Tensor]]]) -> None:
        self._check_usable()
        req = self._next_control_id()
        self._send_all([(r * self.n + k, codec.encode(Kind.SET_STATE, req, 0, tensors, {"names": names}))
                        for r in range(self.R) for k, (names, tensors) in enumerate(per_stage)])
        self._collect(Kind.ACK, dict.fromkeys(range(self.P), 1), step=req, what="load_state_dict")

    def get_snapshots(self) -> list[dict[str, Any]]:
        """Every stage's packed snapshot (see :meth:`StageExecutor.snapshot`) and its tensors."""
        self._check_usable()
        req = self._next_control_id()
        self._send_all([(k, codec.encode(Kind.GET_SNAPSHOT, req)) for k in range(self.n)])
        got = self._collect(Kind.SNAPSHOT, dict.fromkeys(range(self.n), 1), step=req, what="save")
        out = []
        for k in range(self.n):
            msg = got[k][0]
            try:
                out.append(codec.unpack_tree(msg.extra["snapshot"], msg.tensors))
            except (CodecError, KeyError) as exc:
                raise self._fail(self._err(f"malformed snapshot: {exc}", k))
        return out

    def restore(self, snapshots: list[dict[str, Any]]) -> None:
        self._check_usable()
        req = self._next_control_id()
        msgs = []
        for k, snap in enumerate(snapshots):
            tensors: list[torch.Tensor] = []
            tree = codec.pack_tree(snap, tensors, f"stage {k}'s snapshot")
            frames = codec.encode(Kind.RESTORE, req, 0, tensors, {"snapshot": tree})
            msgs += [(r * self.n + k, frames) for r in range(self.R)]  # every replica
        self._send_all(msgs)
        self._collect(Kind.ACK, dict.fromkeys(range(self.P), 1), step=req, what="load")

    def layouts(self) -> list[dict[str, Any]]:
        return [info["layout"] for info in self.worker_info[:self.n]]

    # -- tracing ---------------------------------------------------------------------------------
    def _measure_clocks(self, rounds: int = 8) -> list[tr.ClockSample]:
        """Each stage's clock offset from ours: the least-delayed of ``rounds`` round trips."""
        assert self.server is not None
        out = []
        for k in range(self.P):
            samples = []
            for _ in range(rounds):
                req = self._next_control_id()
                t0 = time.perf_counter_ns()
                self.server.send(k, codec.encode(Kind.CLOCK, req))
                reply = self._collect(Kind.TIME, {k: 1}, step=req, what="clock")[k][0]
                t1 = time.perf_counter_ns()
                ns = reply.extra.get("ns")
                if type(ns) is not int:
                    raise self._fail(self._err(f"malformed clock reply {reply.extra!r}", k))
                samples.append((t0, ns, t1))
            out.append(tr.best_offset(samples))
        return out

    def _fetch_trace(self) -> dict[str, Any]:
        """The merged trace of the run so far (stages' rows on our clock, plus our step spans)."""
        for g, sample in enumerate(self._measure_clocks()):
            self.clocks[g].append(sample)
        req = self._next_control_id()
        self._send_all([(g, codec.encode(Kind.GET_TRACE, req)) for g in range(self.P)])
        got = self._collect(Kind.TRACE, dict.fromkeys(range(self.P), 1), step=req, what="trace")
        rows = []
        for g in range(self.P):
            try:
                rows.append(tr.check_rows(got[g][0].tensors[0], g % self.n))
            except (IndexError, ValueError) as exc:
                raise self._fail(self._err(f"malformed trace: {exc}", g))
        rows = tr.drop_partial_steps(rows, [bool(got[g][0].extra.get("truncated")) for g in range(self.P)])
        first = min((int(t[:, 1].min()) for t in rows if t.numel()), default=0)
        spans = [s for s in self.spans if s[0] >= first]
        meta = tr.TraceMeta(tr.schedule_label(self.schedule), self.n, self.microbatches, replicas=self.R)
        hosts = [str(info.get("host", "")) for info in self.worker_info]
        merged: dict[str, Any] | None = None
        origin = min((float(sp[2]) for sp in spans), default=None)  # one time axis for all replicas
        for r in range(self.R):  # one process (pid) per replica in the trace
            part = slice(r * self.n, (r + 1) * self.n)
            one = tr.build(meta, rows[part], self.clocks[part], spans if r == 0 else [], replica=r,
                           hosts=hosts[part] if len(set(hosts)) > 1 else None, origin_ns=origin)
            if merged is None:
                merged = one
            else:
                merged["traceEvents"] += one["traceEvents"]
        assert merged is not None
        return merged
