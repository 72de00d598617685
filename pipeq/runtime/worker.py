"""A stage process: pinned to its device, holding one or more stages, serving the driver until EXIT.

:func:`worker_entry` is what the driver (or a node's agent) starts, with a
:class:`~pipeq.runtime.config.WorkerConfig` and, per stage the process holds, the stage's
payload: a pickled :class:`~pipeq.stage.spec.StageSpec` handed to the process at start, or a
:class:`~pipeq.stage.spec.StageBuilder` that builds it here from importable names (multi-host:
nothing but plain data crosses hosts). Never anything received over a socket.

The process opens its transport (one :class:`~pipeq.wire.transport.ProcessTransport`, with a
control channel per stage) and a heartbeat thread per stage, builds each stage (its executor,
and its links to its replicas and tie peers), reports each READY, and runs the event loop
(:mod:`pipeq.runtime.loop`). Any exception is reported to the driver as ERROR (message and
traceback) by the stage it happened in (every stage of the process when it is not known which)
before the process exits.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import sys
import time
from typing import Any, Sequence

import torch

from pipeq.errors import error_line, format_remote
from pipeq.runtime import os_process
from pipeq.runtime.config import ChunkConfig, WorkerConfig
from pipeq.runtime.executors import make_executor
from pipeq.runtime.interpreter import ChunkError, chunk_error
from pipeq.runtime.links import PeerLinks
from pipeq.runtime.loop import Chunk, EventLoop
from pipeq.parallel.layers import StageParallel
from pipeq.parallel.mesh import PEER_FAILURE_GRACE_S, StageMesh, peer_failure
from pipeq.stage.executor import StageExecutor
from pipeq.stage.info import info_of
from pipeq.stage.spec import StageSpec
from pipeq.wire import control, shm
from pipeq.wire.control import ErrorReply, Ready
from pipeq.wire.control_link import Heartbeat
from pipeq.wire.errors import Stopped
from pipeq.wire.sockets import remove_ipc_dir, tune_process_allocator
from pipeq.wire.transport import ProcessTransport

__all__ = ["worker_entry", "select_device"]


def _orphaned(cfg: WorkerConfig) -> None:
    """The driver is gone (killed, most likely): clean up what it cannot any more, and exit."""
    if cfg.bind.scheme == "ipc":
        shm.remove_segments(shm.run_prefix(cfg.bind.ipc_dir))
    remove_ipc_dir(cfg.bind.ipc_dir)
    os._exit(3)


def select_device(device: str) -> torch.device:
    """The process's device; a CUDA device becomes the process's current one."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    return dev


def worker_entry(cfg: WorkerConfig, payloads: Sequence[Any]) -> None:
    """Entry point of a stage process (started by the driver, or by a node agent): ``payloads[c]``
    is chunk c's stage (see the module). Each stage is built only once the control channels are
    up, so that a failure to build one is reported with its reason."""
    _prepare_process(cfg)
    s = cfg.settings
    transport = ProcessTransport([c.process for c in cfg.chunks], cfg.control_addr, bind=cfg.bind,
                                 queue_capacity=s.queue_capacity, spin_s=s.spin_s, auth=cfg.auth,
                                 max_frame_bytes=s.max_frame_bytes, shm=cfg.shm(), device=torch.device(cfg.device))
    clean = _serve(cfg, payloads, transport)
    # Skip the interpreter's teardown (a second or more with torch loaded): sockets are closed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if clean else 1)


def _prepare_process(cfg: WorkerConfig) -> None:
    """Before any socket: die with the driver, leave Ctrl-C to it, name the process, tighten its
    timers and pin it to its cores."""
    if cfg.die_with_parent and not os_process.can_watch(cfg.driver_pid):
        # No pidfd to watch the driver with: let the kernel kill us with it (no clean-up then).
        os_process.die_with_parent()
    # Ctrl-C, and a SIGTERM to the whole process group (kill -TERM -PGID, a batch system's
    # cancel), reach the stages too: the driver decides how its stages stop (it finishes the
    # steps in flight and checkpoints first), and kills what does not stop when told.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os_process.set_name(cfg.name())
    os_process.tight_timers()
    tune_process_allocator()
    # Pin first: threads started later (ZeroMQ's I/O thread, torch's pool) inherit the affinity.
    os_process.pin_cpu(cfg.cores, cfg.threads)


def _serve(cfg: WorkerConfig, payloads: Sequence[Any], transport: ProcessTransport) -> bool:
    """Build every stage, report each READY and serve the driver's commands until EXIT; False
    after a failure, which the driver is told of (ERROR) first."""
    beats: list[Heartbeat] = []
    chunks: list[Chunk] = []
    loop: EventLoop | None = None
    mesh: StageMesh | None = None
    try:
        # From here on the driver is watched: if it dies, this process cleans up and exits.
        for c, chunk in enumerate(cfg.chunks):
            beats.append(Heartbeat(transport.ctx, cfg.control_addr, chunk.process, cfg.settings.heartbeat_interval,
                                   cfg.driver_pid or os.getppid(), lambda: _orphaned(cfg), auth=cfg.auth,
                                   status=lambda c=c: control.encode(loop.doing(c)) if loop is not None else None))
        device = select_device(cfg.device)
        mesh = StageMesh(cfg.mesh, device) if cfg.mesh is not None else None
        wait = _Wait(transport.inbox, cfg.settings.spin_s)
        serving = _shard(cfg, transport, mesh) if cfg.shards > 1 else transport
        for c, (chunk, payload) in enumerate(zip(cfg.chunks, payloads)):
            try:
                chunks.append(_make_chunk(cfg, c, chunk, payload, transport, device, mesh, wait))
            except Exception as exc:
                err = chunk_error(exc, len(cfg.chunks), chunk.stage, c)
                if err is None:
                    raise
                raise err from exc
            _report_ready(cfg, c, chunks[-1], transport)
        loop = EventLoop(cfg, serving, chunks)
        wait.loop = loop
        loop.serve()
        return True
    except Stopped:
        return True
    except BaseException as exc:  # report everything, KeyboardInterrupt included
        if peer_failure(exc) and _driver_ends_it(transport):
            return True  # a peer of a collective died: the driver names it, and ends the run
        failed = [exc.chunk] if isinstance(exc, ChunkError) else range(len(cfg.chunks))
        for c in failed:
            _report_error(transport, c, exc, loop)
        return False
    finally:
        for hb in beats:
            hb.stop()
        for ch in chunks:  # their sockets share the transport's context: first
            if ch.links is not None:
                ch.links.close(linger_ms=200)
        transport.close(linger_ms=200)
        if mesh is not None:
            mesh.close()


def _driver_ends_it(transport: ProcessTransport) -> bool:
    """(A collective failed: its peer is gone.) Whether the driver's EXIT comes within
    :data:`~pipeq.parallel.mesh.PEER_FAILURE_GRACE_S`: the peer's death is the run's failure, which
    the driver names; else this process reports the failure as its own."""
    end = time.monotonic() + PEER_FAILURE_GRACE_S
    try:
        transport.inbox.until(lambda: time.monotonic() > end)
    except Stopped:
        return True
    except Exception:
        return False
    return False


def _build(stage: int, n_stages: int, payload: Any) -> StageSpec:
    """The stage's spec: unpickled from the bytes the driver handed this process at start (never
    from a socket), or built here by a recipe."""
    spec = pickle.loads(payload) if isinstance(payload, bytes) else payload.build(stage, n_stages)
    if not isinstance(spec, StageSpec):
        raise TypeError(f"stage {stage} was handed a {type(spec).__name__}, not a StageSpec")
    return spec


def _make_chunk(cfg: WorkerConfig, c: int, chunk: ChunkConfig, payload: Any, transport: ProcessTransport,
                device: torch.device, mesh: StageMesh | None, wait: "_Wait") -> Chunk:
    """Chunk ``c``'s stage on the process's device, on its mesh's layers when it has one
    (tensor parallelism, FSDP, replicas: :class:`~pipeq.parallel.layers.StageParallel`): its
    executor and links."""
    torch.manual_seed(chunk.seed)  # each stage its own stream (dropout masks differ by stage)
    spec = _build(chunk.stage, cfg.n_stages, payload)
    s = cfg.settings
    parallel = StageParallel(mesh, chunk.stage, tp_plan=chunk.tp_plan, sharding=s.sharding,
                             fsdp_reshard=s.fsdp_reshard) if mesh is not None else None
    executor = make_executor(cfg.schedule, chunk.stage, cfg.n_stages, spec, device, s.numerics, compile=s.compile,
                             parallel=parallel)
    executor.keep_on_device = transport.device_payloads  # CUDA IPC to the neighbours
    links = PeerLinks(transport.stages[c], transport.senders[c], cfg.bind, executor, stage=chunk.stage,
                      replica=cfg.replica, replicas=cfg.replicas, shard=cfg.shard, held=cfg.stages, mesh=mesh,
                      wait=wait, fault_tolerant=s.fault_tolerant)
    made = Chunk(c, chunk, executor, links, cfg.settings.trace)
    if parallel is not None:
        parallel.trace = made.rec  # its gathers, frees and reductions, on the stage's track
    return made


class _Wait:
    """How the process's collectives wait (:data:`pipeq.parallel.mesh.Waiter`): through its inbox,
    serving its other traffic (the driver's EXIT, LOST); waiting for a peer is not computing (the
    heartbeat reports no action under way meanwhile: ``step_timeout`` judges computation only)."""

    def __init__(self, inbox: Any, spin_s: float) -> None:
        self.inbox, self.spin_s = inbox, spin_s
        self.loop: EventLoop | None = None

    def __call__(self, done: Any, what: str) -> None:
        if done():
            return
        loop = self.loop
        if loop is not None:
            loop.waiting(True)
        try:
            self.inbox.until(done, self.spin_s)
        finally:
            if loop is not None:
                loop.waiting(False)


def _shard(cfg: WorkerConfig, transport: ProcessTransport, mesh: StageMesh | None) -> Any:
    """Tensor parallelism: shard 0 of this process's stages shares what it receives, the others
    follow it (pipeq.wire.shard_link), over the mesh's tp row."""
    from pipeq.stage.transfer import pinned_copies
    from pipeq.wire.shard_link import MAX_FRAMES, FollowerTransport, LeadTransport, ShardLink

    assert mesh is not None and mesh.tp_group is not None
    where = f"stage {'+'.join(str(s) for s in cfg.stages)}, shard {cfg.shard}"
    # shard 0 shares the CUDA tensors it receives (CUDA IPC) as host copies, through pinned memory
    import torch.distributed as dist

    link = ShardLink(mesh.tp_group, cfg.shard, cfg.shards, where, max_bytes=MAX_FRAMES * cfg.settings.max_frame_bytes,
                     host_copies=pinned_copies, wait=lambda done: transport.inbox.until(done, cfg.settings.spin_s),
                     src=dist.get_global_rank(mesh.tp_group, 0))
    return LeadTransport(transport, link) if cfg.shard == 0 else FollowerTransport(transport, link)


def _publish(cfg: WorkerConfig, chunk: ChunkConfig, info: dict[str, Any]) -> None:
    """Multi-host: publish a stage's endpoints in the rendezvous store as ``stage/<g>`` (JSON,
    signed with the job's secret under the entry's full key, as pipeq.control.rendezvous reads
    it; no pickles). Node 0 only reads it for its start-up hints."""
    if cfg.store is None:
        return
    if cfg.auth is None:
        raise RuntimeError(f"stage {chunk.stage}: a multi-host stage needs the job's secret")
    import datetime

    from torch.distributed import PrefixStore, TCPStore

    host, port, prefix = cfg.store
    key = f"stage/{chunk.process}"
    store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60),
                     wait_for_workers=False)
    PrefixStore(prefix, store).set(key, cfg.auth.secret.sign(prefix + key, info))


def _report_ready(cfg: WorkerConfig, c: int, ch: Chunk, transport: ProcessTransport) -> None:
    """Publish the stage's endpoints (multi-host) and tell the driver it is READY."""
    ex: StageExecutor = ch.executor
    links = ch.links.addresses() if ch.links is not None else {"tie_link": None}
    ready = Ready(**transport.addresses(c), pid=os.getpid(), device=str(ex.device), replica=cfg.replica,
                  stage=ch.stage, shard=cfg.shard, threads=torch.get_num_threads(), host=os.uname().nodename,
                  cores=sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [],
                  # the driver's PEERS hands them to the other replicas and the tie peers
                  **links, inputs=list(info_of(ex.module).inputs) or None, layout=ex.layout())
    entry = control.encode(ready)
    del entry["layout"]  # the rendezvous entry: where the process is, for node 0's start-up hints
    _publish(cfg, ch.cfg, entry)
    transport.send_control(c, control.message(ready))


def _report_error(transport: ProcessTransport, c: int, exc: BaseException, loop: EventLoop | None) -> None:
    """Tell the driver why chunk ``c``'s stage fails, with the traceback (if the driver is still there)."""
    try:
        transport.send_control(c, control.message(ErrorReply(
            message=error_line(exc), traceback=format_remote(exc),
            step=loop.step if loop is not None else None,
            at=time.monotonic())))  # which of a stage's shards failed first (pipeq.control.supervisor)
    except Exception:
        pass
