"""Stage processes: where each one runs, what it is told at start, and how it is stopped.

Used by both halves of the control plane that start stages: the driver (every stage on one host,
or node 0's in a multi-host run) and a node's agent (the stages of node r > 0). A run's processes
are numbered by :class:`Numbering` (``g = replica * n_stages + stage`` for shard 0 of each stage,
the other shards of tensor-parallel stages after them). What a stage process is told comes from
the run's :class:`~pipeq.control.config.RunConfig` here and nowhere else: :meth:`RunSetup.stage_settings`
is the one place a :class:`~pipeq.runtime.config.StageSettings` is made, :func:`worker_configs` the
one place a :class:`~pipeq.runtime.config.WorkerConfig` is. An OS process may hold several stages
(virtual stages): each of them keeps its own number ``g`` (its control channel's, its sockets'),
and :func:`host_process` says which OS process holds which.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import os
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from pipeq.control import forkserver
from pipeq.control.main_guard import starting_stages
from pipeq.control.waiting import KILLED_EXIT_S
from pipeq.control.stage_handle import StageHandle
from pipeq import schedules
from pipeq.stage import compiled
from pipeq.stage.spec import StageBuilder
from pipeq.stage.numerics import Numerics
from pipeq.wire.security import WireAuth
from pipeq.wire.sockets import BindTo
from pipeq.runtime import faults
from pipeq.parallel.mesh import MeshPlan, gloo_interface
from pipeq.runtime.config import ChunkConfig, StageSettings, WorkerConfig
from pipeq.runtime.worker import worker_entry
from pipeq.schedules.placement import process_chunk, stages_of

if TYPE_CHECKING:
    from pipeq.control.config import RunConfig
    from pipeq.control.rendezvous import Rendezvous


@dataclass(frozen=True)
class Numbering:
    """How a run's processes are numbered. Shard 0 of replica r's stage k, the stage's *lead*,
    is ``g = r * n_stages + k``, as without tensor parallelism (the driver commands only leads);
    with ``shards = T > 1`` the other shards follow all the leads, T - 1 per lead, in lead order::

        g:  0 .. R*N-1                     R*N + lead*(T-1) + (s-1)
            leads (shard 0)                shard s >= 1 of lead ``lead``
    """

    n_stages: int
    replicas: int = 1
    shards: int = 1

    @property
    def leads(self) -> int:
        return self.n_stages * self.replicas

    @property
    def total(self) -> int:
        return self.leads * self.shards

    def lead(self, g: int) -> int:
        return g if g < self.leads else (g - self.leads) // (self.shards - 1)

    def shard(self, g: int) -> int:
        return 0 if g < self.leads else (g - self.leads) % (self.shards - 1) + 1

    def stage(self, g: int) -> int:
        return self.lead(g) % self.n_stages

    def replica(self, g: int) -> int:
        return self.lead(g) // self.n_stages

    def group(self, lead: int) -> list[int]:
        """Every process of lead ``lead``'s stage, by shard."""
        first = self.leads + lead * (self.shards - 1)
        return [lead, *range(first, first + self.shards - 1)]

    def where(self, g: int) -> str:
        """``replica r, stage k, shard s`` (only what the run has)."""
        parts = [f"replica {self.replica(g)}"] if self.replicas > 1 else []
        parts.append(f"stage {self.stage(g)}")
        if self.shards > 1:
            parts.append(f"shard {self.shard(g)}")
        return ", ".join(parts)


@dataclass(frozen=True)
class RunSetup:
    """A run's configuration with what was checked against its stages: the numerics of its
    ``n_stages`` (:meth:`~pipeq.control.config.RunConfig.numerics_for`) and, with tensor
    parallelism, each stage's plan (``tp_plans``, None without). The driver and a node's agent
    each make one; every stage process's settings are derived from it (:meth:`stage_settings`)."""

    config: "RunConfig"
    numerics: Numerics
    tp_plans: Sequence[Any] | None

    @property
    def shards(self) -> int:
        return self.config.placement.tensor_parallel

    def traced(self) -> bool:
        return self.config.trace is not None

    def stage_settings(self, traced: bool | None = None) -> StageSettings:
        """What every stage process is told (``traced``: whether the run records its actions, when
        another process decides it: a node's agent takes node 0's word)."""
        config = self.config
        return StageSettings(
            queue_capacity=config.queue_capacity, max_frame_bytes=config.wire.max_message_mb << 20,
            heartbeat_interval=config.fault.heartbeat_interval, spin_s=config.wire.spin,
            shm_slots=config.wire.shm_slots, trace=self.traced() if traced is None else traced,
            numerics=self.numerics, compile=compiled.options(config.numerics.compile),
            sharding=config.placement.sharding, fsdp_reshard=config.placement.fsdp_reshard,
            fault_tolerant=config.fault.fault_tolerance == "replicas")

    def with_security(self, tcp_security: str) -> "RunSetup":
        """This setup with another ``tcp_security`` (a node's agent takes node 0's)."""
        wire = dataclasses.replace(self.config.wire, tcp_security=tcp_security)
        return dataclasses.replace(self, config=dataclasses.replace(self.config, wire=wire))


def plan_devices(
    n_local: int, devices: Sequence[str] | None, rendezvous: "Rendezvous | None" = None, *,
    places: Sequence[tuple[int, int]] | None = None, shards: int = 1,
) -> list[tuple[str, list[int], int]]:
    """(device, cpu cores, threads) for each of this host's ``n_local`` stage processes: the
    given devices, else CUDA round-robin when present, else ``cpu``, each with its share of cores.

    ``places[i]``: process i's ``(j, s)``, its stage's place j among this host's stages (their
    shard 0s, in order) and its shard s of ``shards`` (tensor parallelism); default ``(i, 0)``,
    one process per stage. ``devices[i]`` (when given) is process i's stage's device.

    Devices, deterministically (T = ``shards``, G = this host's GPUs):

    - ``devices`` given: shard 0 runs on its stage's device as given; shard s of a stage given
      ``cuda:d`` runs on ``cuda:((d + s) mod G)`` (an unindexed ``"cuda"`` counts as ``cuda:0``),
      so that a stage's T shards take T different GPUs (T <= G); a ``cpu`` stage's shards all run
      on the CPU. E.g. ``devices=["cuda:0", "cuda:2"]``, T = 2, 4 GPUs: stage 0 on cuda:0 and
      cuda:1, stage 1 on cuda:2 and cuda:3.
    - else, with CUDA: stage j's T shards on T consecutive GPUs from the (j*T)-th, wrapping
      around: ``cuda:((j*T + s) mod G)`` (with T = 1, stage j on ``cuda:(j mod G)``: round-robin).
      E.g. 2 stages, T = 2, 2 GPUs: each stage on cuda:0 and cuda:1; 4 GPUs: stage 0 on cuda:0
      and cuda:1, stage 1 on cuda:2 and cuda:3.
    - else ``cpu``.

    Under torchrun/srun several pipeq nodes may share a host: LOCAL_RANK / LOCAL_WORLD_SIZE then
    give this node its share of the host's GPUs (G // LOCAL_WORLD_SIZE of them, at least one,
    from the LOCAL_RANK-th share on: the default placement above runs within it) or its slice of
    the host's cores. :func:`worker_configs` refuses a plan that puts two shards of one stage on
    one GPU (NCCL refuses two ranks of a group on one device).
    """
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    local_rank = rendezvous.local_rank if rendezvous is not None else None
    local_size = rendezvous.local_world_size if rendezvous is not None else None
    if local_rank is not None and local_size and local_size > 1 and len(cores) >= local_size:
        share = len(cores) // local_size
        cores = cores[local_rank * share:(local_rank + 1) * share]
    per = max(1, len(cores) // n_local)
    places = [(i, 0) for i in range(n_local)] if places is None else places
    if len(places) != n_local:
        raise ValueError(f"{len(places)} places for {n_local} processes")
    plan = []
    for i, (j, s) in enumerate(places):
        if devices is not None:
            dev = _shard_device(devices[i], s)
        elif torch.cuda.is_available():
            # under torchrun/srun this node's share of the host's GPUs (one each when there are as
            # many as nodes); within it, each stage's shards on consecutive GPUs of their own
            count = torch.cuda.device_count()
            share = max(1, count // local_size) if local_rank is not None and local_size else count
            first = local_rank * share if local_rank is not None and local_size else 0
            dev = f"cuda:{(first + (j * shards + s) % share) % count}"
        else:
            dev = "cpu"
        start = (i * per) % len(cores)
        plan.append((dev, [cores[(start + c) % len(cores)] for c in range(per)], per))
    return plan


def _shard_device(device: str, shard: int) -> str:
    """Shard ``shard``'s device in a stage given ``device``: the same for shard 0 and off CUDA,
    else the GPU ``shard`` places after it (see :func:`plan_devices`)."""
    dev = torch.device(device)
    if shard == 0 or dev.type != "cuda":
        return device
    count = torch.cuda.device_count()
    index = (dev.index or 0) + shard
    return f"cuda:{index % count if count else index}"


def _check_mesh_apart(num: Numbering, processes: Sequence[int], plan: Sequence[tuple[str, list[int], int]],
                      slice_of: Callable[[int], int]) -> None:
    """Refuse a plan that puts two processes of one stage's slice (its shards, its sharding
    replicas) on one GPU, before any process starts (NCCL would refuse it later, in the stage
    processes); ``slice_of(g)``: process g's slice (its replicate slice)."""
    from pipeq.compat import refusal

    seen: dict[tuple[int, int, int], int] = {}
    for g, (dev, _, _) in zip(processes, plan):
        d = torch.device(dev)
        if d.type != "cuda":
            continue
        index = d.index or 0  # an unindexed "cuda": a fresh process's current device, cuda:0
        other = seen.setdefault((num.stage(g), slice_of(g), index), g)
        if other != g:
            raise ValueError(f"{num.where(other)} and {num.where(g)} would both run on cuda:{index}, and this host "
                             f"has {torch.cuda.device_count()} GPU(s) visible (under torchrun/srun, this node a "
                             "share of them): " + refusal("nccl-one-gpu").message()
                             + "; pipeq.PlacementConfig.devices says how shards are placed")


def mesh_store(tp_dir: str | None, rendezvous: "Rendezvous | None", replicas: int) -> tuple[Any, ...] | None:
    """Where a run's meshes meet: the multi-host rendezvous store when replicas span hosts, else a
    FileStore in this host's private directory ``tp_dir``."""
    if rendezvous is not None and replicas > 1:
        return ("tcp", *rendezvous.store_address())
    return ("file", os.path.join(tp_dir, "mesh")) if tp_dir is not None else None


def worker_configs(
    processes: Sequence[int],
    n_stages: int,
    replicas: int,
    setup: RunSetup,
    *,
    control_addr: str,
    bind: BindTo,
    seed_of: Callable[[int], int],
    rendezvous: "Rendezvous | None" = None,
    die_with_parent: bool = True,
    auth: WireAuth | None = None,
    tp_dir: str | None = None,
    traced: bool | None = None,
    generation: int = 0,
) -> list[WorkerConfig]:
    """The start-up configuration of each OS process that holds this host's ``processes``
    (numbers g; with several stages per process, one configuration holds several g).

    ``auth`` carries the job secret to stages on tcp. ``seed_of(g)`` seeds process g's torch
    RNG. The workers watch this process (``driver_pid``) and exit when it is gone;
    ``die_with_parent`` adds the kernel's PDEATHSIG, which is only safe when this is the main
    thread (it fires when the *thread* that started them exits). ``tp_dir``: with replicas or
    tensor parallelism, this host's private directory where each stage's processes meet (their
    mesh, :mod:`pipeq.parallel.mesh`; across hosts, replicas meet in the rendezvous store).
    Every shard of a stage gets its lead's seed (the same dropout masks outside split layers).
    ``traced``: see :meth:`RunSetup.stage_settings`. ``generation``: how often these processes'
    replicas were started again (fault_tolerance="replicas": their groups meet under new names).
    """
    schedule = setup.config.schedule
    num = Numbering(n_stages, replicas, setup.shards)
    place = setup.config.placement
    meshed = replicas > 1 or num.shards > 1
    store = mesh_store(tp_dir, rendezvous, replicas) if meshed else None
    if meshed and store is None:
        raise ValueError("replicas and tensor-parallel stages need a private directory to meet in (tp_dir)")
    group = place.shard_group
    # the OS process each stage runs in: its own, or its group's (virtual stages)
    owner = {g: host_process(num, g, schedule) for g in processes}
    hosts = list(dict.fromkeys(owner.values()))
    held = {h: sorted((g for g in processes if owner[g] == h), key=lambda g: _chunk(num, g, schedule)) for h in hosts}
    devices = setup.config.placement.devices
    host_devices = [devices[num.stage(held[h][0])] for h in hosts] if devices is not None else None
    # each process's stage's place among this host's stages, and its shard (see plan_devices)
    stages = {lead: j for j, lead in enumerate(dict.fromkeys(num.lead(held[h][0]) for h in hosts))}
    places = [(stages[num.lead(held[h][0])], num.shard(held[h][0])) for h in hosts]
    plan = plan_devices(len(hosts), host_devices, rendezvous, places=places, shards=num.shards)
    if meshed:
        _check_mesh_apart(num, [held[h][0] for h in hosts], plan, lambda g: num.replica(g) // group)
    # replicas across hosts meet on the interface this node binds to; anything else stays on loopback
    ifname = gloo_interface(bind.host if bind.scheme == "tcp" else None) if store and store[0] == "tcp" else None
    settings = setup.stage_settings(traced)
    fault = faults.from_environ(n_stages, replicas=replicas)  # PIPEQ_FAULT: read here, handed over as plain data
    threads_per_stage = setup.config.placement.threads_per_stage
    tp_plans = setup.tp_plans
    configs = []
    for h, (dev, cores, threads) in zip(hosts, plan):
        first = held[h][0]
        chunks = tuple(ChunkConfig(stage=num.stage(g), process=g, seed=seed_of(num.lead(g)),
                                   tp_plan=tp_plans[num.stage(g)] if num.shards > 1 and tp_plans else None)
                       for g in held[h])
        configs.append(WorkerConfig(
            chunks=chunks, index=_index(num, first, schedule), n_stages=n_stages, schedule=schedule,
            settings=settings, control_addr=control_addr, bind=bind, device=dev, cores=cores,
            threads=threads_per_stage or threads, replica=num.replica(first), replicas=replicas,
            shard=num.shard(first), shards=num.shards,
            mesh=MeshPlan(replicas, group, num.shards, num.replica(first), num.shard(first),
                          f"p{_index(num, first, schedule)}", store, generation, ifname) if store is not None else None,
            auth=auth, driver_pid=os.getpid(), die_with_parent=die_with_parent,
            store=rendezvous.store_address() if rendezvous is not None else None, fault=fault))
    return configs


def _chunk(num: Numbering, g: int, schedule: Any) -> int:
    """The chunk of its process that holds process g's stage."""
    policy = schedules.resolve(schedule)
    v = policy.stages_per_process
    return 0 if v == 1 else process_chunk(num.stage(g), num.n_stages // v, policy.placement)[1]


def _index(num: Numbering, g: int, schedule: Any) -> int:
    """The place in its replica's pipeline of the process that holds process g's stage."""
    policy = schedules.resolve(schedule)
    v = policy.stages_per_process
    return num.stage(g) if v == 1 else process_chunk(num.stage(g), num.n_stages // v, policy.placement)[0]


def host_process(num: Numbering, g: int, schedule: Any) -> int:
    """The OS process that runs process g's stage: g itself, or with several stages per process
    (the schedule's ``stages_per_process``) the lowest g of the stages its process holds (of
    the same replica and shard)."""
    policy = schedules.resolve(schedule)
    v = policy.stages_per_process
    if v == 1:
        return g
    n = num.n_stages // v
    lead = num.replica(g) * num.n_stages + min(stages_of(_index(num, g, schedule), n, v, policy.placement))
    return num.group(lead)[num.shard(g)]


def process_groups(num: Numbering, schedule: Any) -> list[list[int]]:
    """The leads (shard 0 of each stage, see :class:`Numbering`) each stage process holds, in
    order: one each, or with several stages per process the stages of one process together."""
    held: dict[int, list[int]] = {}
    for g in range(num.leads):
        held.setdefault(host_process(num, g, schedule), []).append(g)
    return list(held.values())


def place_leads(num: Numbering, schedule: Any, nnodes: int, alive: Sequence[int] | None,
                nodes: Sequence[Sequence[int]] | None) -> list[list[int]]:
    """Which leads each node of a multi-host run holds (see
    :func:`pipeq.control.rendezvous.placement_over`): whole processes, so that the stages of one
    process (several, with virtual stages) are on one node. A given ``nodes`` table that splits
    a process is refused, naming its stages."""
    from pipeq.control import rendezvous as rdzv

    groups = process_groups(num, schedule)
    if len(groups) == num.leads:  # one stage per process
        return rdzv.placement_over(num.leads, nnodes, alive, nodes)
    policy = schedules.resolve(schedule)
    held = f"schedule {policy.name!r} holds {policy.stages_per_process} stages per process"
    if nodes is not None and (alive is None or sorted(alive) == list(range(nnodes))):
        plan = rdzv.placement(num.leads, nnodes, nodes)
        where = {g: r for r, node in enumerate(plan) for g in node}
        for group in groups:
            if len({where[g] for g in group}) > 1:
                raise ValueError(f"the placement puts {', '.join(num.where(g) for g in group)} on nodes "
                                 f"{sorted({where[g] for g in group})}, but they share one process ({held}): "
                                 "place them on one node")
        return plan
    if nnodes > len(groups):
        raise ValueError(f"{nnodes} nodes for {len(groups)} stage processes ({held}): some nodes would run "
                         f"nothing; use at most {len(groups)} nodes")
    by_group = rdzv.placement_over(len(groups), nnodes, alive)
    return [sorted(g for i in node for g in groups[i]) for node in by_group]


def start_workers(ctx: Any, configs: Sequence[WorkerConfig], payload_of: Callable[[int], "bytes | StageBuilder"],
                  ) -> dict[int, StageHandle]:
    """Start one OS process per configuration; the handle of each process g it holds (the
    stages of one process share its handle)."""
    procs: dict[int, StageHandle] = {}
    for cfg in configs:
        proc = ctx.Process(target=worker_entry, args=(cfg, [payload_of(c.process) for c in cfg.chunks]),
                           name=cfg.name(), daemon=True)
        with starting_stages():
            proc.start()
        handle = StageHandle(proc)
        procs.update({c.process: handle for c in cfg.chunks})
    return procs


def job_identity(payload: "bytes | StageBuilder", schedule: Any, numerics: Numerics | None = None,
                 tp_plans: Sequence[Any] | None = None) -> dict[str, Any]:
    """What every node of a multi-host run must agree on (compared by the agents): the schedule
    and its options, the recipe, how the stages compute (precision, clipping...) and, with
    tensor parallelism, how each stage is split (``tp_plans``)."""
    from pipeq.trace.format import schedule_label

    recipe = payload.describe() if isinstance(payload, StageBuilder) else {}
    schedule = schedules.resolve(schedule)
    # the options too: "async" with and without weight stashing share a name, not a plan
    plain = {k: str(v) if isinstance(v, float) and not math.isfinite(v) else v  # inf: JSON has none
             for k, v in dataclasses.asdict(numerics or Numerics()).items()}
    identity = {"schedule": schedule_label(schedule), "schedule_options": schedules.options_of(schedule),
                "recipe": recipe, "numerics": plain}
    if tp_plans:  # (a style object or a callable by its type's name: job files give strings)
        identity["tp_plan"] = [{n: v if isinstance(v, str) else type(v).__name__ for n, v in plan.items()}
                               if isinstance(plan, dict) else getattr(plan, "__qualname__", type(plan).__name__)
                               for plan in tp_plans]
    return identity


def of_stages(stages: Sequence[int]) -> str:
    """The words ``" of stages 1 and 2"`` naming the stages a process holds when it holds several
    (virtual stages), else ``""``: its death takes them all."""
    stages = sorted(stages)
    return f" of stages {', '.join(map(str, stages[:-1]))} and {stages[-1]}" if len(stages) > 1 else ""


def exit_reason(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"was killed by {name}"


def process_context(start_method: str, compiles: bool = False) -> Any:
    """The multiprocessing context stage processes are started with. With ``"forkserver"`` the
    fork server imports torch and pipeq once (``pipeq.runtime.preload``) and each stage is a fork of it:
    ~0.1 s for a 3-stage runner once the server runs, instead of seconds; the server lives until
    this process exits. ``compiles``: the run compiles its stages (the server then imports
    torch.compile's machinery once, :func:`pipeq.control.forkserver.start`)."""
    if start_method == "forkserver":
        forkserver.start(compiles)
    return mp.get_context(start_method)


def stop_processes(procs: Sequence[StageHandle]) -> None:
    """Kill every process still running: nothing outlives this call. Stage processes ignore
    SIGINT and SIGTERM (their driver decides when they stop: EXIT asks them, and those that
    did not go when asked are past saving), so SIGKILL it is."""
    procs = list({id(p): p for p in procs}.values())  # stages sharing a process share its handle
    for p in procs:
        if p.exitcode is None:
            p.kill()
    for p in procs:
        p.join(KILLED_EXIT_S)
    for p in procs:
        if p.exitcode is not None:
            p.close()
