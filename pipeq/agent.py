"""The node agent: starts this node's stages in a multi-host run and watches them.

Node 0 runs the driver; every other node runs :func:`run_agent`::

    node r agent                              node 0 driver (ROUTER)
      | read "control", "placement" from the rendezvous store
      | start its stages (each builds itself from the job's importable names)
      |--- READY {agent: r, stages, pids} -------------------->|
      |--- ERROR {stage: k, message} when a stage dies ------->|   (named within ~0.1 s)
      |<-- EXIT {abort} ---------------------------------------|   (the run is over)

The agent is its stages' parent: they watch it (pidfd) and die with it. It watches the driver:
its connection carries ZeroMQ heartbeats, and once the driver is disconnected for
``driver_grace`` seconds (the driver process died, or its host) the agent stops its stages and
exits non-zero. So no stage waits forever on a peer that is gone.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from typing import Any, Callable, Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from . import codec
from . import rendezvous as rdzv
from .codec import Kind
from .driver import exit_reason, job_identity, plan_devices, start_worker, stop_processes
from .rendezvous import Rendezvous
from .worker import StageBuilder, WorkerConfig

_TICK_MS = 100


class AgentError(RuntimeError):
    """The agent could not start its stages or lost the driver."""


def _fetch(store: Any, key: str, what: str, rz: Rendezvous, timeout: float) -> Any:
    try:
        store.wait([key])
    except Exception:
        raise AgentError(
            f"node {rz.node_rank}: node 0 did not publish its {what} at the rendezvous "
            f"{rz.master_addr}:{rz.master_port} within {timeout:.0f} s; is node 0 started with the "
            "same --master-addr/--master-port and run id?"
        ) from None
    return rdzv.decode_json(store.get(key), what)


def _differences(theirs: dict, ours: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(theirs) | set(ours)):
        a, b = theirs.get(key), ours.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key} is {a!r} on node 0 but {b!r} here")
    return out


def _tell_driver(control: str, rz: Rendezvous, message: str) -> None:
    """Send one ERROR to the driver (so it fails at once, naming this node), then hang up."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, b"a%d" % rz.node_rank)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(control)
        sock.send_multipart(codec.encode(Kind.ERROR, extra={"message": message}))
        sock.close()
    finally:
        ctx.term()


def run_agent(
    rz: Rendezvous,
    builder: StageBuilder,
    n_stages: int,
    schedule: Any,
    *,
    devices: Sequence[str] | None = None,
    threads_per_stage: int | None = None,
    queue_capacity: int = 64,
    heartbeat_interval: float = 1.0,
    heartbeat_timeout: float = 15.0,
    start_timeout: float = 120.0,
    spin_s: float = 0.01,
    driver_grace: float = 5.0,
    log: Callable[[str], None] = print,
    data_parallel: int = 1,
) -> int:
    """Run node ``rz.node_rank``'s stages until the driver ends the run; the exit code (0 = ok)."""
    store = rz.store(start_timeout)
    control = _fetch(store, "control", "control address", rz, start_timeout)
    plan = _fetch(store, "placement", "stage placement", rz, start_timeout)
    options = _fetch(store, "options", "run options", rz, start_timeout)
    traced = bool(options.get("trace")) if isinstance(options, dict) else False
    replicas = options.get("replicas", 1) if isinstance(options, dict) else 1
    if replicas != data_parallel:
        message = (f"node {rz.node_rank} was started with data_parallel={data_parallel}, node 0 with "
                   f"{replicas}; pass the same job file and flags on every node")
        _tell_driver(control, rz, message)
        raise AgentError(message)
    # the placement names processes: g = replica * n_stages + stage
    if (not isinstance(control, str) or not isinstance(plan, list) or len(plan) != rz.nnodes
            or sorted(k for node in plan for k in node) != list(range(n_stages * replicas))):
        raise AgentError(
            f"node {rz.node_rank}: the driver runs a different job (placement {plan!r} for "
            f"{rz.nnodes} nodes, this node's job file has {n_stages} stages x {replicas} replicas)"
        )
    theirs = _fetch(store, "job", "job description", rz, start_timeout)
    ours = json.loads(json.dumps(job_identity(builder, schedule)))  # as it came through JSON
    if theirs != ours:
        differ = _differences(theirs, ours) if isinstance(theirs, dict) else ["everything"]
        message = (f"node {rz.node_rank} was started with another job than node 0: "
                   f"{'; '.join(differ)}; pass the same job file and flags on every node")
        _tell_driver(control, rz, message)
        raise AgentError(message)
    mine: list[int] = plan[rz.node_rank]
    ctx = mp.get_context("spawn")
    procs: dict[int, mp.process.BaseProcess] = {}
    zctx = zmq.Context(io_threads=1)
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"a%d" % rz.node_rank)
    sock.setsockopt(zmq.LINGER, 500)
    # ZMTP heartbeats: a driver host that vanishes (no FIN ever comes) is noticed too.
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_interval * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout * 1000))
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    sock.connect(control)
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    code = 1
    try:
        local_devices = [devices[g % n_stages] for g in mine] if devices is not None else None
        for g, (dev, cores, threads) in zip(mine, plan_devices(len(mine), local_devices, rz)):
            k = g % n_stages
            cfg = WorkerConfig(
                stage=k, n_stages=n_stages, schedule=schedule, control_addr=control,
                transport="tcp", where=rz.bind, device=dev, cores=cores,
                threads=threads_per_stage or threads, queue_capacity=queue_capacity,
                heartbeat_interval=heartbeat_interval, spin_s=spin_s, die_with_parent=True,
                driver_pid=os.getpid(), seed=builder.seed_for(k), store=rz.store_address(),
                trace=traced, replica=g // n_stages, replicas=replicas, process=g,
                dp_store=rz.store_address() if replicas > 1 else None,
            )
            procs[g] = start_worker(ctx, cfg, builder)
        log(f"node {rz.node_rank}: started stage(s) {mine} (pids "
            f"{[p.pid for p in procs.values()]}), driver at {control}")
        sock.send_multipart(codec.encode(Kind.READY, extra={
            "agent": rz.node_rank, "stages": mine, "pids": [procs[k].pid for k in mine]}))
        code = _watch(rz, sock, monitor, procs, heartbeat_interval, driver_grace, start_timeout, log)
    except KeyboardInterrupt:
        log(f"node {rz.node_rank}: interrupted; stopping stage(s) {mine}")
        try:  # the driver names the node at once instead of waiting for missing heartbeats
            sock.send_multipart(codec.encode(Kind.ERROR, extra={
                "stage": mine[0], "message": f"node {rz.node_rank}'s agent was interrupted"}),
                flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        code = 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_processes(list(procs.values()))
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close()
        zctx.term()
    return code


def _watch(
    rz: Rendezvous, sock: zmq.Socket, monitor: zmq.Socket, procs: dict[int, mp.process.BaseProcess],
    interval: float, grace: float, start_timeout: float, log: Callable[[str], None],
) -> int:
    """The agent's loop: forward stage deaths, obey EXIT, give up on a vanished driver."""
    reported: set[int] = set()
    connected_once = False
    lost_since: float | None = time.monotonic()  # not yet connected: allow start_timeout
    last_beat = 0.0
    beat = 0
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    while True:
        events = dict(poller.poll(_TICK_MS))
        if monitor in events:
            ev = recv_monitor_message(monitor)
            if ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                connected_once, lost_since = True, None
            elif ev["event"] == zmq.EVENT_DISCONNECTED and lost_since is None:
                lost_since = time.monotonic()
        if sock in events:
            try:
                msg = codec.decode(sock.recv_multipart(copy=False))
            except codec.CodecError as exc:
                log(f"node {rz.node_rank}: ignoring a malformed message from the driver ({exc})")
                continue
            if msg.kind is Kind.EXIT:
                abort = bool(msg.extra.get("abort"))
                # the driver has stopped (or is stopping) the stages; give them a moment to exit
                end = time.monotonic() + (2.0 if abort else 10.0)
                while time.monotonic() < end and any(p.exitcode is None for p in procs.values()):
                    time.sleep(0.05)
                if abort:
                    log(f"node {rz.node_rank}: the driver ended the run after a failure")
                return 1 if abort else 0
        for k, p in procs.items():
            if p.exitcode is not None and k not in reported:
                reported.add(k)
                if p.exitcode == 0:  # only after the driver told it to exit: not a failure
                    continue
                log(f"node {rz.node_rank}: stage {k} (pid {p.pid}) {exit_reason(p.exitcode)}")
                # A stage that raised has already sent its own ERROR with the traceback; this
                # names the ones that could not (killed, OOM, os._exit).
                sock.send_multipart(codec.encode(Kind.ERROR, extra={
                    "stage": k, "message": f"stage process (pid {p.pid}) {exit_reason(p.exitcode)}"}))
        now = time.monotonic()
        limit = grace if connected_once else start_timeout
        if lost_since is not None and now - lost_since > limit:
            what = "lost the driver" if connected_once else "could not reach the driver"
            log(f"node {rz.node_rank}: {what} at {rz.master_addr} for {now - lost_since:.1f} s; "
                "stopping this node's stages")
            return 1
        if now - last_beat > interval:
            beat += 1
            last_beat = now
            try:
                sock.send_multipart(codec.encode(Kind.HEARTBEAT, beat), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
