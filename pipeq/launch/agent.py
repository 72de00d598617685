"""The node agent: starts this node's stages in a multi-host run and watches them.

Node 0 runs the driver; every other node runs :func:`run_agent`::

    node r agent                              node 0 driver (ROUTER)
      | read "control", "placement", ... from the rendezvous store (signed: pipeq.control.rendezvous)
      | start its stages (made once on this node from the job's importable names, each handed its own)
      |--- READY {agent: r, stages, pids} -------------------->|
      |--- ERROR {stage: k, message} when a stage dies ------->|   (named within ~0.1 s)
      |<-- EXIT {abort} ---------------------------------------|   (the run is over)

The agent is its stages' parent: they watch it (pidfd) and die with it. It watches the driver:
its connection carries ZeroMQ heartbeats, and once the driver is disconnected for
``driver_grace`` seconds (default 2 s; the driver process died, or its host went silent for the
heartbeat timeout) the agent stops its stages and exits non-zero. So no stage waits forever on a
peer that is gone. (ZeroMQ keeps a connection through short network trouble: a disconnect means
the driver's end closed it or stayed silent for the whole heartbeat timeout.)
"""

from __future__ import annotations

import json
from pipeq.control.stage_handle import StageHandle
from pipeq.control.waiting import AGENT_ABORT_S, AGENT_EXIT_S, wait_until
import os
import signal
import time
from typing import Any, Callable, NoReturn, Sequence

from pipeq.control import rendezvous as rdzv
from pipeq.errors import CodecError
from pipeq.launch import elastic
from pipeq.runtime.faults import ENV as FAULT_ENV
from pipeq.stage.spec import StageBuilder
from pipeq.wire import control as protocol  # (``control`` names the driver's address here)
from pipeq.wire.control import AgentReady, ErrorReply, Exit
from pipeq.wire.messages import Kind, Message
from pipeq.control.processes import (Numbering, RunSetup, exit_reason, job_identity, of_stages, process_context,
                                     start_workers, stop_processes, worker_configs)
from pipeq.control.rendezvous import Rendezvous
from pipeq.wire.control_link import DriverLink
from pipeq.wire.keys import JobSecret
from pipeq.wire.security import WireAuth
from pipeq.wire.sockets import BindTo, make_ipc_dir, remove_ipc_dir

__all__ = ["run_agent", "AgentError", "TERM_GRACE"]

_TICK_MS = 100
TERM_GRACE = 30.0  # seconds an agent told to terminate waits for the driver to end the run
_POLL_S = 0.05  # how often the agent looks for node 0's entries in the rendezvous store


class AgentError(RuntimeError):
    """The agent could not start its stages or lost the driver."""


def _fetch(store: Any, key: str, what: str, rz: Rendezvous, deadline: float, timeout: float,
           log: Callable[[str], None], moved: Callable[[], bool] = lambda: False) -> Any:
    """Node 0's entry ``key`` (its ``what``), once one signed with this node's secret is there.

    Anything else under the key (unsigned, signed with another secret, moved from another key)
    is ignored, whoever wrote it: anyone who reaches the store's port can write it, and node 0
    writes its entries again every half second, so this keeps polling until ``deadline``
    (time.monotonic()) instead of giving up on a forged entry. The first foreign one is logged at
    once; if one is still there at the deadline, the secrets most likely differ. ``moved()``
    true: node 0 started a newer generation (raises :class:`_Moved`)."""
    warned = False
    where = f"{key!r} at the rendezvous {rz.master_addr}:{rz.master_port}"
    while True:
        try:
            state, value = rz.read(store, key)
        except RuntimeError as exc:  # the store went away (node 0, its host, ended: torch's DistNetworkError)
            lost = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            if warned:
                raise AgentError(
                    f"node {rz.node_rank}: node 0's {what} ({where}) was not signed with this node's job "
                    f"secret, and then the store went away ({lost}): the nodes were most likely started with "
                    "different secrets; pass the same --secret-file (or PIPEQ_SECRET) on every node") from None
            raise AgentError(f"node {rz.node_rank}: lost the rendezvous store ({where}) while waiting for node 0's "
                             f"{what} ({lost}): node 0 ended, or its host became unreachable") from None
        if state == rdzv.VALID:
            return value
        try:
            if moved():
                raise _Moved()
        except RuntimeError:  # the store went away: said on the next read
            pass
        if state == rdzv.FOREIGN and not warned:
            warned = True
            log(f"node {rz.node_rank}: ignoring the rendezvous store's {key!r} entry: it is not signed "
                f"with this node's job secret; waiting up to {max(0.0, deadline - time.monotonic()):.0f} s "
                "for node 0's (if this lasts, node 0 was started with another secret)")
        if time.monotonic() > deadline:
            break
        time.sleep(_POLL_S)
    if state == rdzv.FOREIGN:
        raise AgentError(
            f"node {rz.node_rank}: node 0's {what} ({where}) is not signed with this node's job secret "
            f"after {timeout:.0f} s: the "
            "nodes were most likely started with different secrets; pass the same --secret-file (or "
            "PIPEQ_SECRET) on every node"
        )
    raise AgentError(
        f"node {rz.node_rank}: node 0 did not publish its {what} at the rendezvous "
        f"{rz.master_addr}:{rz.master_port} within {timeout:.0f} s; is node 0 started with the "
        "same --master-addr/--master-port and run id?"
    )


def _differences(theirs: dict, ours: dict, prefix: str = "") -> list[str]:
    """Where two job descriptions differ, one line per key (nested keys dotted)."""
    out = []
    for key in sorted(set(theirs) | set(ours)):
        a, b = theirs.get(key), ours.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key} is {a!r} on node 0 but {b!r} here")
    return out


def _secret(rz: Rendezvous) -> JobSecret:
    """The job's secret (refused without one)."""
    if rz.secret is None:
        raise AgentError(f"node {rz.node_rank}: a multi-host run needs the job's secret")
    return rz.secret


def _tell_driver(control: str, rz: Rendezvous, message: str) -> None:
    """Send one ERROR to the driver (so it fails at once, naming this node), then hang up."""
    # the control channel is CURVE-encrypted whatever the run's tcp_security: either mode reaches it
    link = DriverLink(control, rz.node_rank, linger_ms=2000, auth=WireAuth(_secret(rz), "encrypt"))
    try:
        link.send(protocol.message(ErrorReply(message=message)))
    finally:
        link.close()


def run_agent(
    rz: Rendezvous,
    builder: StageBuilder,
    n_stages: int,
    setup: RunSetup,
    *,
    driver_grace: float = 2.0,
    log: Callable[[str], None] = print,
) -> int:
    """Run node ``rz.node_rank``'s stages until the driver ends the run; the exit code (0 = ok).

    ``setup`` is the job's run configuration (its schedule, timeouts, replicas and start method:
    see :func:`pipeq.control.processes.process_context`) with its checked numerics, from which
    what its stages are told is derived; whether the run is traced, and its ``tcp_security``,
    are node 0's (the driver decides them).

    A run with restarts (node 0's "generation" entry: :mod:`pipeq.launch.elastic`) is joined at
    the generation node 0 points at, also in progress (as a lost node's replacement); after a
    failed start this agent waits for the next one instead of exiting."""
    start_timeout = setup.config.fault.start_timeout
    _secret(rz)  # no secret: refused before the store is touched
    store = rz.store(start_timeout)
    deadline = time.monotonic() + start_timeout
    # signed: node 0 names this node if its secret is another (ProcessBackend._start_hint)
    me = f"agent/{rz.node_rank}"
    store.set(me, rz.sign(me, {"node": rz.node_rank, "host": os.uname().nodename, "pid": os.getpid()}))
    last = -1  # the generation this agent last ran
    while True:
        try:
            generation = _next_generation(store, rz, last, deadline, start_timeout, log)
        except _NotNeeded as exc:  # not a failure: nothing (torchrun, a batch system) should start it again
            log(str(exc))
            return 0
        try:
            code = _run_generation(rz.at(generation), store, builder, n_stages, setup, driver_grace, deadline, log)
        except _Moved:  # node 0 points at a newer start than the one being joined: join that one
            continue
        try:
            point = elastic.pointer(store, rz) if code == _ABORTED else None
        except RuntimeError:  # the store is gone with node 0: no restart to wait for
            point = None
        if point is None:
            return 1 if code == _ABORTED else code
        last = generation
        os.environ.pop(FAULT_ENV, None)  # an injected fault fires in the first start only (as on node 0)
        wait = float(point.get("rejoin_timeout") or 0) + start_timeout
        deadline = time.monotonic() + wait
        log(f"node {rz.node_rank}: the run failed; waiting up to {wait:.0f} s for node 0 to start it again")


class _Moved(Exception):
    """Node 0 started a newer generation while this agent was joining another."""


class _NotNeeded(Exception):
    """The run went on without this node (its stages re-placed on the others)."""


_ABORTED = -1  # _watch's code for an EXIT after a failure (a restart may follow)


def _next_generation(store: Any, rz: Rendezvous, last: int, deadline: float, timeout: float,
                     log: Callable[[str], None]) -> int:
    """The generation to join: node 0's newest after ``last`` (0 in a run without restarts, whose
    node 0 points at none), once node 0 points at one."""
    while True:
        try:
            point = elastic.pointer(store, rz)
        except RuntimeError as exc:  # the store went away: node 0 ended the run
            lost = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise AgentError(f"node {rz.node_rank}: lost the rendezvous store at {rz.master_addr}:{rz.master_port} "
                             f"({lost}): node 0 ended the run, or its host became unreachable") from None
        if point is None and last < 0:
            return 0
        nodes = point.get("nodes") if point is not None else None
        if isinstance(nodes, list) and rz.node_rank not in nodes:
            raise _NotNeeded(f"node {rz.node_rank}: the run goes on without this node (its stages were re-placed "
                             f"on node(s) {nodes} after it was lost); nothing to do here")
        if point is not None and point["generation"] > last:
            return point["generation"]
        if time.monotonic() > deadline:
            raise AgentError(f"node {rz.node_rank}: node 0 did not start the run again within {timeout:.0f} s")
        time.sleep(_POLL_S)


def _run_generation(rz: Rendezvous, base: Any, builder: StageBuilder, n_stages: int, setup: RunSetup,
                    driver_grace: float, deadline: float, log: Callable[[str], None]) -> int:
    """Join generation ``rz.generation``: fetch node 0's entries, start this node's stages, watch
    them until the driver ends the start; the exit code (:data:`_ABORTED` after a failure)."""
    config = setup.config
    schedule, start_timeout = config.schedule, config.fault.start_timeout
    store = rz.on(base) if rz.generation else base
    me = f"agent/{rz.node_rank}"
    if rz.generation:  # node 0 waits for this before a restart
        store.set(me, rz.sign(me, {"node": rz.node_rank, "generation": rz.generation, "pid": os.getpid()}))

    def moved() -> bool:
        point = elastic.pointer(base, rz)
        return point is not None and point["generation"] > rz.generation

    def fetch(key: str, what: str) -> Any:
        return _fetch(store, key, what, rz, max(deadline, time.monotonic() + 1.0), start_timeout, log, moved)

    control = fetch("control", "control address")
    plan = fetch("placement", "stage placement")
    options = fetch("options", "run options")
    traced = bool(options.get("trace")) if isinstance(options, dict) else False
    replicas = options.get("replicas", 1) if isinstance(options, dict) else 1
    shards = options.get("shards", 1) if isinstance(options, dict) else 1
    security = options.get("tcp_security") if isinstance(options, dict) else None  # node 0's (else the job's)
    auth = WireAuth(_secret(rz), str(security or config.wire.tcp_security))
    _check_run(rz, control, plan, n_stages, replicas, shards, config.placement.data_parallel, setup.shards)
    _check_job(rz, control, fetch("job", "job description"), builder, schedule, setup)
    mine: list[int] = plan[rz.node_rank]
    if not mine:
        log(f"node {rz.node_rank}: the run goes on without this node (its stages were re-placed on the others)")
        return 0
    ctx = process_context(config.placement.start_method, compiles=bool(config.numerics.compile))
    procs: dict[int, StageHandle] = {}
    setup = setup.with_security(auth.mode)
    interval = config.fault.heartbeat_interval
    link = DriverLink(control, rz.node_rank, heartbeat_s=(interval, config.fault.heartbeat_timeout), auth=auth)
    # SIGTERM (a batch system's cancel reaches node 0 too): let the driver finish the steps in
    # flight and checkpoint; it ends the run with EXIT. Only if it does not within
    # TERM_GRACE seconds are the stages stopped here. (Ctrl-C on this node stops them at once.)
    terminated: list[float] = []
    previous = signal.signal(signal.SIGTERM, lambda *_: terminated or terminated.append(time.monotonic()))
    code = 1
    tp_dir = make_ipc_dir() if shards > 1 else None  # where this node's stages' shards meet
    try:
        configs = worker_configs(mine, n_stages, replicas, setup, control_addr=control, bind=BindTo.tcp(rz.bind),
                                 seed_of=lambda g: builder.seed_for(g % n_stages), rendezvous=rz, auth=auth,
                                 tp_dir=tp_dir, traced=traced)
        num = Numbering(n_stages, replicas, shards)  # (a shard's process number is not its stage's)
        procs.update(start_workers(ctx, configs, lambda g: builder.for_stage(num.stage(g))))
        log(f"node {rz.node_rank}: started stage(s) {mine} (pids "
            f"{sorted({p.pid for p in procs.values()})}), driver at {control}")
        link.send(protocol.message(AgentReady(agent=rz.node_rank, stages=mine, pids=[procs[g].pid for g in mine])))
        code = _watch(rz, link, procs, interval, driver_grace, start_timeout, log, terminated)
    except KeyboardInterrupt:
        log(f"node {rz.node_rank}: interrupted; stopping stage(s) {mine}")
        # the driver names the node at once instead of waiting for missing heartbeats
        link.send(protocol.message(ErrorReply(stage=mine[0], message=f"node {rz.node_rank}'s agent was interrupted")),
                  block=False)
        code = 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_processes(list(procs.values()))
        remove_ipc_dir(tp_dir)
        link.close()
    return code


def _refuse(control: str, rz: Rendezvous, message: str) -> NoReturn:
    """Tell the driver why this node cannot take part (so it fails at once), and raise it here."""
    _tell_driver(control, rz, message)
    raise AgentError(message)


def _check_run(rz: Rendezvous, control: Any, plan: Any, n_stages: int, replicas: int, shards: int,
               data_parallel: int, tensor_parallel: int) -> None:
    """This node was started as node 0 was: as many replicas and shards per stage, and node 0's
    placement covers every process of this node's job."""
    if replicas != data_parallel:
        _refuse(control, rz, f"node {rz.node_rank} was started with data_parallel={data_parallel}, node 0 with "
                             f"{replicas}; pass the same job file and flags on every node")
    if shards != tensor_parallel:
        _refuse(control, rz, f"node {rz.node_rank} was started with tensor_parallel={tensor_parallel}, node 0 "
                             f"with {shards}; pass the same job file and flags on every node")
    # the placement names processes (pipeq.control.processes.Numbering): g = replica * n_stages + stage
    # for shard 0 of each stage, the other shards after them
    if (not isinstance(control, str) or not isinstance(plan, list) or len(plan) != rz.nnodes
            or sorted(k for node in plan for k in node) != list(range(n_stages * replicas * shards))):
        raise AgentError(
            f"node {rz.node_rank}: the driver runs a different job (placement {plan!r} for "
            f"{rz.nnodes} nodes, this node's job file has {n_stages} stages x {replicas} replicas x "
            f"{shards} shards)"
        )


def _check_job(rz: Rendezvous, control: str, theirs: Any, builder: StageBuilder, schedule: Any,
               setup: RunSetup) -> None:
    """Node 0's job description (``theirs``) is this node's: the same recipe, schedule and numerics."""
    ours = job_identity(builder, schedule, setup.numerics, setup.tp_plans)
    ours = json.loads(json.dumps(ours))  # as it came through JSON
    if theirs != ours:
        differ = _differences(theirs, ours) if isinstance(theirs, dict) else ["everything"]
        if all(line.startswith("recipe.made.") for line in differ):  # the same job, split otherwise here
            _refuse(control, rz, f"node {rz.node_rank}'s stages function made other stages than node 0's: "
                                 f"{'; '.join(differ)}; each node calls it once, and a split it measures "
                                 "(pipeq.split(..., balance='time' or 'memory')) may differ from host to host: "
                                 "give pipeq.split the split_points node 0 chose instead")
        _refuse(control, rz, f"node {rz.node_rank} was started with another job than node 0: "
                             f"{'; '.join(differ)}; pass the same job file and flags on every node")


def _watch(
    rz: Rendezvous, link: DriverLink, procs: dict[int, StageHandle],
    interval: float, grace: float, start_timeout: float, log: Callable[[str], None],
    terminated: Sequence[float] = (),
) -> int:
    """The agent's loop: forward stage deaths, obey EXIT, give up on a vanished driver (or, after
    a SIGTERM, on a driver that does not end the run within TERM_GRACE seconds)."""
    reported: set[int] = set()
    told = False
    last_beat = 0.0
    beat = 0
    while True:
        try:
            msg = link.recv(_TICK_MS)
            command = protocol.decode(msg) if msg is not None else None
        except CodecError as exc:
            log(f"node {rz.node_rank}: ignoring a malformed message from the driver ({exc})")
            command = None
        if isinstance(command, Exit):
            abort = command.abort
            # the driver has stopped (or is stopping) the stages; give them a moment to exit
            wait_until(lambda: all(p.exitcode is not None for p in procs.values()),
                       AGENT_ABORT_S if abort else AGENT_EXIT_S)
            if abort:
                log(f"node {rz.node_rank}: the driver ended the run after a failure")
            return _ABORTED if abort else (143 if terminated else 0)
        if terminated:
            if not told:
                told = True
                log(f"node {rz.node_rank}: SIGTERM; waiting up to {TERM_GRACE:.0f} s for the driver to "
                    "checkpoint and end the run")
            if time.monotonic() - terminated[0] > TERM_GRACE:
                log(f"node {rz.node_rank}: the driver did not end the run {TERM_GRACE:.0f} s after SIGTERM; "
                    "stopping this node's stages")
                return 143
        for g, p in procs.items():
            if p.exitcode is not None and g not in reported:
                held = [h for h, q in procs.items() if q is p]  # (a process may hold several stages)
                reported.update(held)
                if p.exitcode == 0:  # only after the driver told it to exit: not a failure
                    continue
                which = of_stages(held)  # (by process number, as the line names the stage)
                log(f"node {rz.node_rank}: stage {g} (pid {p.pid}{which}) {exit_reason(p.exitcode)}")
                # A stage that raised has already sent its own ERROR with the traceback; this
                # names the ones that could not (killed, OOM, os._exit).
                link.send(protocol.message(ErrorReply(stage=g, message=f"stage process (pid {p.pid}){which} "
                                                                      f"{exit_reason(p.exitcode)}")))
        now = time.monotonic()
        if link.connected is not True:
            limit = grace if link.connected is False else start_timeout
            if now - link.lost_since > limit:
                what = "lost the driver" if link.connected is False else "could not reach the driver"
                log(f"node {rz.node_rank}: {what} at {rz.master_addr} for {now - link.lost_since:.1f} s; "
                    "stopping this node's stages")
                return 1
        if now - last_beat > interval:
            beat += 1
            last_beat = now
            link.send(Message(Kind.HEARTBEAT, beat), block=False)
