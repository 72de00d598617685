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

import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .codec import Kind, Message
from .errors import CodecError, PipelineError
from .schedules import ScheduleFn
from .stage import Tensors
from .transport import ControlServer, make_ipc_dir, remove_ipc_dir
from .worker import WorkerConfig, worker_entry

_POLL_MS = 100


def plan_devices(n_stages: int, devices: Sequence[str] | None) -> list[tuple[str, list[int], int]]:
    """(device, cpu cores, threads) per stage: CUDA round-robin when present, else a CPU share."""
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(ncpu))
    per = max(1, ncpu // n_stages)
    plan = []
    for k in range(n_stages):
        if devices is not None:
            dev = devices[k]
        elif torch.cuda.is_available():
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


class ProcessBackend:
    def __init__(
        self,
        stages: Sequence[nn.Module],
        loss_fn: Callable,
        optimizer: Callable[..., Any],
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
    ) -> None:
        self.start_method = start_method
        self.stop_timeout = stop_timeout
        self.stages = list(stages)
        self.n = len(self.stages)
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.schedule = schedule
        self.devices = devices
        self.threads_per_stage = threads_per_stage
        self.transport = transport
        self.host = host
        self.queue_capacity = queue_capacity
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.start_timeout = start_timeout
        self.spin_s = spin_s
        self.procs: list[mp.process.BaseProcess] = []
        self.server: ControlServer | None = None
        self.ipc_dir: str | None = None
        self.last_beat: list[float] = []
        self.failure: PipelineError | None = None
        self._last_health = 0.0

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self._teardown()
            raise

    def _start(self) -> None:
        self.ipc_dir = make_ipc_dir()
        where = self.ipc_dir if self.transport == "ipc" else self.host
        self.server = ControlServer(self.transport, where)
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            # The fork server imports torch and pipeq once; each stage is then a cheap fork of it
            # (stages start in ~50 ms instead of ~2 s; the fork server outlives the runner).
            ctx.set_forkserver_preload(["pipeq._preload"])
        plan = plan_devices(self.n, self.devices)
        main_thread = threading.current_thread() is threading.main_thread()
        for k, (dev, cores, threads) in enumerate(plan):
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
            )
            # Plain pickle bytes: each worker gets a private copy (multiprocessing's own pickler
            # would move the tensors to shared memory, and workers would train the caller's modules).
            payload = pickle.dumps((self.stages[k], self.loss_fn if k == self.n - 1 else None, self.optimizer))
            p = ctx.Process(
                target=worker_entry, args=(cfg, payload),
                name=f"pipeq-stage{k}", daemon=True,
            )
            p.start()
            self.procs.append(p)
        self.last_beat = [float("inf")] * self.n  # heartbeats are watched once a stage is READY
        replies = self._collect(Kind.READY, dict.fromkeys(range(self.n), 1),
                                timeout=self.start_timeout, what="start")
        ready = {k: msgs[0] for k, msgs in replies.items()}
        for k in range(self.n):
            extra: dict[str, Any] = {}
            if k + 1 < self.n:
                extra["next_forward"] = ready[k + 1].extra["forward"]
            if k > 0:
                extra["prev_backward"] = ready[k - 1].extra["backward"]
            self.server.send(k, Kind.PEERS, extra=extra)
        self.worker_info = [ready[k].extra for k in range(self.n)]

    def close(self) -> None:
        """Stop every worker and remove the ipc files.

        Two phases: STOP lets each stage finish what it was sent and answer ACK (so an error in
        the last step still reaches the caller, and no message is in flight any more); EXIT
        then ends the processes. Stragglers get SIGTERM, then SIGKILL.
        """
        if self.server is None or self.failure is not None:
            self._teardown()
            return
        alive = [k for k, p in enumerate(self.procs) if p.exitcode is None]
        for k in alive:
            self.server.send(k, Kind.STOP)
        self._collect(Kind.ACK, dict.fromkeys(alive, 1), timeout=self.stop_timeout, what="stop")
        for k in alive:
            self.server.send(k, Kind.EXIT)
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._teardown()

    def _teardown(self) -> None:
        for p in self.procs:
            if p.exitcode is None:
                p.terminate()
        deadline = time.monotonic() + 3.0
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.exitcode is None:
                p.kill()
                p.join(5.0)
        for p in self.procs:
            if p.exitcode is not None:
                p.close()
        self.procs = []
        if self.server is not None:
            self.server.close()
            self.server = None
        remove_ipc_dir(self.ipc_dir)
        self.ipc_dir = None

    # -- failure handling ------------------------------------------------------------------
    def _stage_of(self, ident: bytes) -> tuple[str, int]:
        return chr(ident[0]), int(ident[1:])

    def _error_of(self, got: tuple[bytes, Message]) -> PipelineError:
        _, stage = self._stage_of(got[0])
        extra = got[1].extra
        return PipelineError(str(extra.get("message", "failed")), stage, extra.get("traceback"))

    def _fail(self, err: PipelineError) -> PipelineError:
        self.failure = err
        self._teardown()
        return err

    def _check_health(self) -> None:
        now = time.monotonic()
        self._last_health = now
        for k, p in enumerate(self.procs):
            code = p.exitcode
            if code is not None:
                # An ERROR may still be in flight from a stage that raised and exited: prefer it.
                end = time.monotonic() + 0.5
                while self.server is not None and time.monotonic() < end:
                    got = self.server.recv(50)
                    if got is not None and got[1].kind is Kind.ERROR:
                        raise self._fail(self._error_of(got))
                how = f"was killed by {_signal_name(code)}" if code < 0 else f"exited with code {code}"
                raise self._fail(PipelineError(f"stage process (pid {p.pid}) {how}", k))
            if now - self.last_beat[k] > self.heartbeat_timeout:
                raise self._fail(PipelineError(
                    f"no heartbeat for {now - self.last_beat[k]:.1f} s (heartbeat_timeout="
                    f"{self.heartbeat_timeout}); the stage is hung or unreachable", k))

    def _check_usable(self) -> None:
        if self.failure is not None:
            raise PipelineError(f"the pipeline has failed and is closed: {self.failure}")
        if self.server is None:
            raise PipelineError("the pipeline is not running; use 'with runner:' or runner.start()")

    def _collect(
        self, kind: Kind, counts: dict[int, int], *, timeout: float | None = None, what: str = "reply"
    ) -> dict[int, list[Message]]:
        """Wait for ``counts[k]`` messages of ``kind`` from each stage k, watching every worker."""
        assert self.server is not None
        got: dict[int, list[Message]] = {k: [] for k in counts}
        missing = {k for k, c in counts.items() if c > 0}
        deadline = None if timeout is None else time.monotonic() + timeout
        while missing:
            try:
                r = self.server.recv(_POLL_MS)
            except CodecError as exc:
                raise self._fail(PipelineError(f"malformed message on the control channel: {exc}"))
            now = time.monotonic()
            if r is not None:
                role, stage = self._stage_of(r[0])
                msg = r[1]
                self.last_beat[stage] = now
                if role == "h":
                    pass
                elif msg.kind is Kind.ERROR:
                    raise self._fail(self._error_of(r))
                elif msg.kind is kind and stage in missing:
                    got[stage].append(msg)
                    if len(got[stage]) == counts[stage]:
                        missing.discard(stage)
                else:
                    raise self._fail(PipelineError(
                        f"protocol error: got {msg.kind.name} while waiting for {kind.name}", stage))
            if r is None or now - self._last_health > _POLL_MS / 1000:
                self._check_health()
            if deadline is not None and now > deadline:
                raise self._fail(PipelineError(
                    f"timed out after {timeout} s waiting for {kind.name} ({what}) from stage(s) "
                    f"{sorted(missing)}"))
        return got

    # -- commands --------------------------------------------------------------------------
    def step(self, step: int, sizes: list[int], x: torch.Tensor, target: torch.Tensor) -> float:
        self._check_usable()
        assert self.server is not None
        last = self.n - 1
        extra = {"sizes": sizes}
        for k in range(self.n):
            tensors: list[torch.Tensor] = []
            if k == 0:
                tensors.append(x)
            if k == last:
                tensors.append(target)
            self.server.send(k, Kind.STEP, step, 0, tensors, extra)
        reply = self._collect(Kind.LOSS, {last: 1}, what=f"step {step}")[last][0]
        return float(reply.extra["loss"])

    def predict(self, step: int, sizes: list[int], x: torch.Tensor) -> list[Tensors]:
        self._check_usable()
        assert self.server is not None
        last = self.n - 1
        for k in range(self.n):
            self.server.send(k, Kind.PREDICT, step, 0, [x] if k == 0 else [], {"sizes": sizes})
        msgs = self._collect(Kind.OUTPUT, {last: len(sizes)}, what=f"predict {step}")[last]
        msgs.sort(key=lambda m: m.microbatch)
        return [tuple(m.tensors) for m in msgs]

    def get_state(self) -> list[tuple[list[str], list[torch.Tensor]]]:
        self._check_usable()
        assert self.server is not None
        for k in range(self.n):
            self.server.send(k, Kind.GET_STATE)
        got = self._collect(Kind.STATE, dict.fromkeys(range(self.n), 1), what="state_dict")
        return [(list(got[k][0].extra["names"]), got[k][0].tensors) for k in range(self.n)]

    def set_state(self, per_stage: list[tuple[list[str], list[torch.Tensor]]]) -> None:
        self._check_usable()
        assert self.server is not None
        for k, (names, tensors) in enumerate(per_stage):
            self.server.send(k, Kind.SET_STATE, tensors=tensors, extra={"names": names})
        self._collect(Kind.ACK, dict.fromkeys(range(self.n), 1), what="load_state_dict")
