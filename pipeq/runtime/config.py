"""What a stage process is told at start: plain data, made by the control plane in one place.

The run's settings are a :class:`pipeq.RunConfig`, built and checked once in the driver (or a
node's agent). What every stage process takes of them is a :class:`StageSettings`, derived from
it by :meth:`pipeq.control.processes.RunSetup.stage_settings` and nowhere else; where each process runs and
which stages it holds is a :class:`WorkerConfig` (:func:`pipeq.control.processes.worker_configs`).
Neither declares a default for a setting: every default lives in the RunConfig's parts
(tests/unit/control/test_settings_path.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from pipeq.parallel.mesh import MeshPlan
from pipeq.runtime.faults import Fault
from pipeq.stage.compiled import CompileOptions
from pipeq.stage.numerics import Numerics
from pipeq.wire import shm
from pipeq.wire.security import WireAuth
from pipeq.wire.shm import ShmConfig
from pipeq.wire.sockets import BindTo

__all__ = ["StageSettings", "ChunkConfig", "WorkerConfig"]


@dataclass(frozen=True)
class StageSettings:
    """What a run's configuration tells every stage process."""

    queue_capacity: int  # messages a stage may hold per direction (RunConfig.queue_capacity)
    max_frame_bytes: int  # inbound data frames above this are refused (max_message_mb)
    heartbeat_interval: float  # seconds between heartbeats
    spin_s: float  # how long a wait busy-polls before it sleeps (spin)
    shm_slots: int  # ipc: shared-memory slots per data channel (pipeq.wire.shm); 0: ZeroMQ frames only
    trace: bool  # record every action (pipeq.trace)
    numerics: Numerics  # precision, clipping, checks (pipeq.stage.numerics)
    compile: CompileOptions | None  # torch.compile each stage (pipeq.stage.compiled); None: eager
    sharding: str  # "fsdp" / "hsdp": the replicas shard each stage (pipeq.parallel.fsdp); "none": whole replicas
    fsdp_reshard: str  # with sharding: "step" or "microbatch" (PlacementConfig.fsdp_reshard)
    fault_tolerant: bool  # fault_tolerance="replicas": replicas carry on without a lost one (pipeq.parallel.membership)


@dataclass(frozen=True)
class ChunkConfig:
    """One stage a process holds (its chunk): the stage, its number on the control channel
    (``g``, :class:`pipeq.control.processes.Numbering`), its seed, and with tensor parallelism how
    its module is split over its shards (None otherwise)."""

    stage: int
    process: int
    seed: int
    tp_plan: Any


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a stage process needs to know to start: the stages it holds (``chunks``, in
    the order of the schedule's plan for the process: its chunk numbers), where it runs, how it
    reaches the driver, and the run's :class:`StageSettings`."""

    chunks: tuple[ChunkConfig, ...]
    index: int  # the process's place in its replica's pipeline: its plan in the schedule
    n_stages: int  # the run's model stages
    schedule: str | Callable[[int, int], list] | Any  # a registered name, or a schedule object or function
    settings: StageSettings
    control_addr: str
    bind: BindTo  # where this process binds its inbound sockets
    device: str
    cores: list[int]
    threads: int
    # data parallelism: this process belongs to replica ``replica`` of ``replicas``
    replica: int
    replicas: int
    # tensor parallelism: this process is shard ``shard`` of its stages' ``shards``
    shard: int
    shards: int
    # with replicas or shards: the process's place in its stages' mesh (pipeq.parallel.mesh), None otherwise
    mesh: MeshPlan | None
    auth: WireAuth | None  # tcp: the job's secret (handed over at start, never sent)
    driver_pid: int  # the process this one dies with: the driver, or its node's agent
    die_with_parent: bool
    # multi-host: the rendezvous store (host, port, key prefix) where this process publishes its
    # endpoints; None on one host
    store: tuple[str, int, str] | None
    fault: Fault | None  # a failure to inject on purpose (PIPEQ_FAULT: pipeq.runtime.faults)

    @property
    def stages(self) -> list[int]:
        return [c.stage for c in self.chunks]

    def name(self) -> str:
        """The process's name (``ps``, ``top``): ``pipeq-stage2`` or ``pipeq-stage0+3r1t1``."""
        return ("pipeq-stage" + "+".join(str(s) for s in self.stages)
                + (f"r{self.replica}" if self.replicas > 1 else "") + (f"t{self.shard}" if self.shards > 1 else ""))

    def shm(self) -> ShmConfig | None:
        """This process's shared-memory payloads: on one host (ipc), where the host has them."""
        slots = self.settings.shm_slots
        if self.bind.scheme != "ipc" or slots < 1 or not shm.available():
            return None
        return ShmConfig(shm.run_prefix(self.bind.ipc_dir), slots, max_bytes=self.settings.max_frame_bytes)
