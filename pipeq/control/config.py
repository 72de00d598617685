"""The run configuration: typed settings, built once and checked once, handed whole to every layer.

:class:`RunConfig` is what a run is: its schedule (resolved once, here), microbatches, and four
parts, each a frozen dataclass that checks itself when built:

    numerics   NumericsConfig   precision, clipping, check_finite, recompute
    wire       WireConfig       transport, host, TCP security, message and queue sizes, shm, spin
    fault      FaultConfig      heartbeats, step / start / stop timeouts
    placement  PlacementConfig  mode, devices, threads, start method, nodes, replicas, shards, sharding

``PipelineRunner(**settings)`` and job files are its front ends (:meth:`RunConfig.from_kwargs`
takes the runner's keyword names); the backends, stage processes, node agents and job identity
read it. What depends on the model (the number of stages) is checked by :meth:`RunConfig.numerics_for`
and :meth:`RunConfig.check_stages` once the stages are known.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from pipeq import schedules
from pipeq.schedules import SchedulePolicy

if TYPE_CHECKING:
    from pipeq.stage.numerics import Numerics

__all__ = ["RunConfig", "NumericsConfig", "WireConfig", "FaultConfig", "PlacementConfig", "MODES", "TRANSPORTS",
           "START_METHODS", "FAULT_TOLERANCE", "LOSS_WEIGHTINGS", "check_step_timeout", "setting_fields",
           "setting_default"]

MODES = ("process", "simulated")
TRANSPORTS = ("ipc", "tcp")
START_METHODS = ("spawn", "forkserver")
#: the environment variable that sets the start method of every runner not given one (a test suite, a docs run)
START_METHOD_ENV = "PIPEQ_START_METHOD"
FAULT_TOLERANCE = (None, "replicas")  # see FaultConfig.fault_tolerance
LOSS_WEIGHTINGS = ("token", "sample")  # see NumericsConfig.loss_weighting
SHARDINGS = ("none", "fsdp", "hsdp")  # see PlacementConfig.sharding
FSDP_RESHARDS = ("step", "microbatch")  # see PlacementConfig.fsdp_reshard


def _whole(value: Any, lo: int, hi: int) -> bool:
    return type(value) is int and lo <= value <= hi


def _seconds(value: Any) -> bool:
    """A finite number of seconds, 0 or more."""
    return type(value) in (int, float) and math.isfinite(value) and value >= 0


def _lists_of_ints(value: Any) -> bool:
    """A list (or tuple) of lists of non-negative integers."""
    return isinstance(value, (list, tuple)) and all(
        isinstance(node, (list, tuple)) and all(type(k) is int and k >= 0 for k in node) for node in value)


@dataclass(frozen=True)
class NumericsConfig:
    """How the stages compute: precision, gradient clipping, finite checks, recomputation.

    Attributes:
        precision: ``"fp32"``, ``"bf16"`` (autocast to bfloat16 on CPU and CUDA: the
            forward and the loss run under ``torch.autocast``; parameters, gradients and the
            optimizer stay float32) or ``"fp16"`` (autocast to float16 with dynamic loss scaling,
            torch.amp.GradScaler's: the found-inf check is combined over every stage and replica,
            so all of them step or skip together, as one GradScaler on the whole model would).
        clip_grad_norm: clip the gradients by their global norm over every stage (after the
            replicas' all-reduce, after fp16's unscaling), as ``torch.nn.utils.clip_grad_norm_``
            on the whole model does; None: no clipping.
        clip_norm_type: the p of ``clip_grad_norm``'s norm (``float('inf')``: the largest value).
        check_finite: ``"raise"`` (or True): check the input, every stage's outputs, the losses and
            the gradients, and fail with a PipelineError naming the stage and microbatch where the
            first NaN or Inf appeared, before any optimizer step changes a weight. ``"skip"``:
            skip the optimizer step on every stage when any gradient is not finite (the step's loss
            may be anything; the runner's ``stats()`` counts the skipped steps). False: no checks.
        recompute: True, or one boolean per stage: the stage keeps only its inputs between a
            microbatch's forward and backward and recomputes the forward in the backward (the same
            RNG state, so the same dropout masks): the same numbers, less activation memory.
            False: none.
        loss_weighting: what a microbatch's (mean) loss is weighted by in the step's loss:
            ``"token"`` (its target's elements, those equal to the loss's ``ignore_index``, -100
            unless the loss has its own, left out: a mean over the batch's tokens, what padded
            language-model targets need; the same as per sample when every row has as many
            target elements and none is ignored) or ``"sample"`` (its rows). Any loss, a plain
            function too; a sum-reduced one is added up either way. See
            :mod:`pipeq.stage.loss`.
        compile: True, or a dict of ``torch.compile`` keyword arguments (``backend``, ``mode``,
            ``dynamic``, ``fullgraph``, ``options``), ``cache_dir`` and ``mark_dynamic`` (default
            True: the inputs' batch and length dimensions are dynamic from the first compile, so a
            new length does not recompile; False: torch's automatic dynamic shapes, static until a
            length changes, then one recompile): each stage process compiles its
            stage with ``torch.compile`` once it is on its device (a ``pipeq.split`` stage: its graph,
            not pipeq's wrapper), keeping the module's own parameter names. ``cache_dir``: torch's
            compile cache (inductor's and AOTAutograd's), shared by the stage processes and kept
            across runs (default: torch's own, ``TORCHINDUCTOR_CACHE_DIR`` or
            ``/tmp/torchinductor_<user>``; ``pipeq launch``: ``OUT/compile-cache``). Every built-in
            schedule runs compiled stages; the split-backward ones compute a compiled stage's whole
            backward at its ``I`` (see the splitting guide's "Compiled stages"). ``runner.stats()``
            reports each stage's compile time and recompiles. False: eager.

    Precision, clipping, check_finite and recompute run with fill-drain, 1F1B, ZB-H1 and your own
    schedules (interlocking, async and AL compute their own way); loss_weighting with every schedule.
    """

    precision: str = "fp32"
    clip_grad_norm: float | None = None
    clip_norm_type: float = 2.0
    check_finite: bool | str = False
    recompute: bool | Sequence[bool] = False
    loss_weighting: str = "token"
    compile: bool | Mapping[str, Any] = False

    def __post_init__(self) -> None:
        from pipeq.stage import numerics
        from pipeq.stage.compiled import options

        numerics.check(self.precision, self.clip_grad_norm, self.clip_norm_type, self.check_finite, self.recompute,
                       None)  # the per-stage recompute list's length: once the stages are known
        if self.loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(f"loss_weighting must be 'token' (each microbatch's loss weighted by its target's "
                             f"tokens) or 'sample' (by its rows), got {self.loss_weighting!r}")
        options(self.compile)  # checked now: a ValueError names what is wrong


@dataclass(frozen=True)
class WireConfig:
    """How stages talk: the transport and its limits.

    Attributes:
        transport: ``"ipc"`` (Unix sockets, one host) or ``"tcp"`` (what a multi-host run uses).
        host: the address stages bind to with ``transport="tcp"``.
        tcp_security: how TCP sockets are protected: ``"encrypt"`` (CURVE on every
            socket: encrypted and authenticated) or ``"authenticate"`` (CURVE on the control
            channel, a Poly1305 MAC on every data message: no encryption of activations and gradients,
            2-3x the bandwidth at 4-64 MiB). Either way only holders of the job's secret get in:
            this runner makes one, a multi-host run takes it from ``rendezvous.secret``.
        max_message_mb: the largest tensor (MiB) one stage sends another; a larger frame is
            refused by the receiving stage before it is buffered, and the sender fails naming it.
        shm_slots: with ``transport="ipc"``, a message's tensors of 64 KiB or more cross to the
            next (previous) stage through shared memory: each channel has this many reusable
            slots (a sender waits while all are in use), 0 sends everything in ZeroMQ frames.
            Other transports ignore it.
        spin: seconds a stage waiting for a message busy-polls (yielding its core to anything
            else runnable) before it blocks: a blocked process wakes up 0.1-0.5 ms later on a
            virtual machine, on every hop. 0 never spins (least CPU, most latency).
        queue_capacity: messages a stage's queue holds, at least ``microbatches`` (None: four
            steps' worth, at least 64).
        trusted_network: whether the network between a multi-host run's hosts is yours alone. The
            replicas' and shards' collectives are torch's (gloo, NCCL), which authenticate and
            encrypt nothing, so a multi-host run with ``data_parallel`` is refused without it (a
            stage's tensor-parallel shards share its host, on loopback) (the pipeline's own channels stay authenticated either way; the
            security guide says what each covers). On one host they bind to loopback only.
    """

    transport: str = "ipc"
    host: str = "127.0.0.1"
    tcp_security: str = "encrypt"
    max_message_mb: int = 256
    shm_slots: int = 4
    queue_capacity: int | None = None
    spin: float = 0.01
    trusted_network: bool = False

    def __post_init__(self) -> None:
        from pipeq.wire.security import SECURITY_MODES

        if type(self.trusted_network) is not bool:
            raise ValueError(f"trusted_network must be True or False, got {self.trusted_network!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.tcp_security not in SECURITY_MODES:
            raise ValueError(f"tcp_security must be one of {SECURITY_MODES}, got {self.tcp_security!r}")
        if not _whole(self.max_message_mb, 1, 1 << 20):
            raise ValueError(
                f"max_message_mb must be a whole number of MiB from 1 to 1048576, got {self.max_message_mb!r}")
        if not _whole(self.shm_slots, 0, 64):
            raise ValueError(
                f"shm_slots must be a whole number from 0 (no shared memory) to 64, got {self.shm_slots!r}")
        if type(self.host) is not str or not self.host.strip():
            raise ValueError(f"host must be the address (a name or an IP) the stages bind on, got {self.host!r}")
        if self.queue_capacity is not None and not _whole(self.queue_capacity, 1, 1 << 20):
            raise ValueError(f"queue_capacity must be a whole number of messages from 1 to 1048576, or None "
                             f"(four steps' worth), got {self.queue_capacity!r}")
        if not _seconds(self.spin) or self.spin > 1:
            raise ValueError(f"spin must be seconds from 0 (never busy-poll) to 1, got {self.spin!r}")


@dataclass(frozen=True)
class FaultConfig:
    """How failures are noticed: heartbeats and timeouts, in seconds.

    Attributes:
        heartbeat_interval: seconds between a stage's heartbeats.
        heartbeat_timeout: seconds of silence (no heartbeat) before a stage is failed; longer
            than ``heartbeat_interval``.
        step_timeout: seconds a stage may spend in one compute action (a forward, a backward, an
            optimizer step) before the run fails with a PipelineError naming the stage and the
            action (a stage alive, heartbeating, but stuck in its own computation; its waiting
            neighbours are not blamed). Judged from each stage's heartbeats, so only a stage
            that stops making progress fails, never a step that is merely long. None:
            off, as a library cannot know how long one action of a user's model may
            legitimately take (a first CUDA compile, huge microbatches, a starved CPU);
            ``pipeq launch`` sets 300 s. Must be longer than ``heartbeat_interval``.
            Process mode only (a simulated run has no stage processes to watch).
        start_timeout: seconds to wait for every stage to start.
        stop_timeout: seconds ``close()`` lets the stages finish what they were sent before they
            are terminated (a failure is raised then).
        fault_tolerance: None (any stage failure ends the run) or ``"replicas"`` (with
            ``data_parallel >= 2``): when a replica's stage fails in a training step, the other
            replicas finish that step without it (its update and loss are the mean over their
            samples), and the lost replica is rebuilt from a healthy one's live state to rejoin
            at the next step (the runner's ``degraded_steps`` and ``replica_failures`` say what
            happened).
    """

    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 15.0
    step_timeout: float | None = None
    start_timeout: float = 120.0
    stop_timeout: float = 60.0
    fault_tolerance: str | None = None

    def __post_init__(self) -> None:
        if self.fault_tolerance not in FAULT_TOLERANCE:
            raise ValueError(f"fault_tolerance must be None (a failure ends the run) or 'replicas', got "
                             f"{self.fault_tolerance!r}")
        for name in ("heartbeat_interval", "heartbeat_timeout", "start_timeout", "stop_timeout"):
            if not _seconds(getattr(self, name)) or not getattr(self, name) > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {getattr(self, name)!r}")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError("heartbeat_timeout must be longer than heartbeat_interval")
        check_step_timeout(self.step_timeout, self.heartbeat_interval)


@dataclass(frozen=True)
class PlacementConfig:
    """Where stages run: in processes or this one, on which devices, nodes, replicas and shards.

    Attributes:
        mode: ``"process"`` (stage processes: one per stage, or one per ``stages_per_process``
            stages) or ``"simulated"`` (all in this process).
        devices: one device string per stage; None: ``cuda:k`` round-robin when CUDA is
            available, else ``cpu`` with each stage pinned to its share of the CPU cores (with
            ``tensor_parallel``, each is the device of the stage's shard 0: see there).
        threads_per_stage: torch threads per stage process (None: this host's cores / its stage
            processes, at least 1).
        start_method: ``"spawn"`` (every stage a fresh interpreter importing torch,
            all at once: 4-9 s for 3 stages on 2 busy cores) or ``"forkserver"`` (stages fork
            from a server that imports torch once: 2-4 s for the first runner of a process,
            ~0.1 s for later ones; the server lives on until this process exits).
            Both run the main script again in each stage: start the runner under
            ``if __name__ == "__main__":`` (it refuses otherwise). The environment variable
            ``PIPEQ_START_METHOD`` sets the default for every runner of a process.
        placement: stages per node in a multi-host run (the runner's ``rendezvous``), e.g.
            ``[[0], [1, 2]]`` (None: an even, contiguous split).
        data_parallel: R replicas of the pipeline (R x N processes), gradients all-reduced.
        tensor_parallel: each stage split over T processes of one host (R x N x T processes),
            on torch's DTensor, as ``tp_plan`` says. With
            ``data_parallel``, each shard's gradients are summed with the same shard of the other
            replicas. States and checkpoints hold whole tensors (they load at any T). Plain
            backprop's schedules (fill-drain, 1F1B, the zero-bubble and interleaved ones, several
            stages per process included) and your own; not yet with precision, clipping,
            check_finite or recompute. On CUDA a stage process's T shards run on T different GPUs
            (NCCL refuses two on one): by default shard s of the host's j-th stage process (j =
            r*P + p for replica r's process p of P on one host) on ``cuda:((j*T + s) mod G)``, G the
            host's GPUs (T consecutive GPUs per process), and with ``devices`` shard 0 on
            ``devices[k]`` = ``cuda:d`` and shard s on ``cuda:((d + s) mod G)``. A run whose
            stage would put two shards on one GPU (T > G) is refused before it starts.
        tp_plan: with ``tensor_parallel``, one plan per stage: a dict mapping submodule names
            (``stage.get_submodule(name)``; ``""`` is the stage itself) to ``"colwise"`` or
            ``"rowwise"`` (torch's ``ColwiseParallel`` / ``RowwiseParallel``, or such objects),
            ``{}`` for a stage left whole, or a callable ``(stage_module, mesh) -> module``. A
            "colwise" entry hands its shard to the "rowwise" entry directly after it, else gathers
            its output: a stage always hands on whole tensors, from its shard 0, once.
        stages_per_process: v model stages per process (virtual stages, :mod:`pipeq.schedules.placement`):
            the N = S/v processes hold the S stages given, looped (interleaved-1f1b, looped-bfs: any
            v >= 2) or in a V (zbv, dualpipev: 2, implied by the schedule). Stages of one process
            share its device and cores; activations between two of them are handed over in memory.
            Tied weights work: the copies one process holds are summed in its memory, the others
            over the tie links; so do tensor parallelism (a process's shards split each of its
            stages) and multi-host runs (a node holds whole processes).
        sharding: how the ``data_parallel`` replicas hold a stage (:mod:`pipeq.parallel.mesh`):
            ``"none"`` (each whole, the gradients all-reduced with torch's collectives), ``"fsdp"``
            (the R replicas shard its parameters, gradients and optimizer state with torch's FSDP2,
            ``fully_shard``; the gradients reduce-scatter once per step) or ``"hsdp"`` (shard
            inside groups of ``shard_size`` replicas, replicate across the groups: the groups
            all-reduce their pieces). States and checkpoints hold whole tensors (they load at any
            ``data_parallel``, sharded or not). With every synchronous schedule, ``tensor_parallel``
            (FSDP shards the shards' pieces: a 2-D mesh), compile and tied weights;
            ``fault_tolerance="replicas"`` with ``"none"`` and ``"hsdp"`` (a shard group lost whole).
        shard_size: with ``sharding="hsdp"``, the replicas of each shard group (at least 2, a divisor
            of ``data_parallel`` smaller than it).
        fsdp_reshard: with ``sharding="fsdp"`` or ``"hsdp"``, when a stage's gathered parameters are freed:
            ``"step"`` (gathered before the stage's first forward of a step and kept to the step's
            reduce-scatter: one all-gather per step) or ``"microbatch"`` (gathered before every
            forward and backward of a microbatch and freed after it: the whole parameters are held
            only while computing, at an all-gather per action).
    """

    mode: str = "process"
    devices: Sequence[str] | None = None
    threads_per_stage: int | None = None
    start_method: str = field(default_factory=lambda: os.environ.get(START_METHOD_ENV) or "spawn")
    placement: Sequence[Sequence[int]] | None = None
    data_parallel: int = 1
    tensor_parallel: int = 1
    tp_plan: Sequence[Any] | None = None
    stages_per_process: int | None = None
    sharding: str = "none"
    shard_size: int | None = None
    fsdp_reshard: str = "step"

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise ValueError(f"sharding must be 'none' (whole replicas), 'fsdp' (replicas shard each stage with "
                             f"torch's FSDP2) or 'hsdp' (shard in groups of shard_size, replicate across them), got "
                             f"{self.sharding!r}")
        if self.fsdp_reshard not in FSDP_RESHARDS:
            raise ValueError(f"fsdp_reshard must be 'step' (gathered parameters kept through the step) or "
                             f"'microbatch' (freed after each forward and backward), got {self.fsdp_reshard!r}")
        if type(self.data_parallel) is not int or self.data_parallel < 1:
            raise ValueError(f"data_parallel must be a positive integer, got {self.data_parallel!r}")
        if type(self.tensor_parallel) is not int or self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be a positive integer, got {self.tensor_parallel!r}")
        if self.sharding == "fsdp" and self.data_parallel < 2:
            raise ValueError(f"sharding='fsdp' shards each stage over its data_parallel replicas: it needs "
                             f"data_parallel >= 2, got data_parallel={self.data_parallel!r}")
        _check_shard_size(self.sharding, self.shard_size, self.data_parallel)
        if self.stages_per_process is not None and not _whole(self.stages_per_process, 1, 1 << 10):
            raise ValueError(f"stages_per_process must be a positive integer, got {self.stages_per_process!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.threads_per_stage is not None and (type(self.threads_per_stage) is not int
                                                   or self.threads_per_stage < 1):
            raise ValueError(f"threads_per_stage must be a positive integer, got {self.threads_per_stage!r}")
        if self.start_method not in START_METHODS:
            raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {self.start_method!r}"
                             + (f" (from {START_METHOD_ENV})" if os.environ.get(START_METHOD_ENV) == self.start_method
                                else ""))
        if self.devices is not None and (isinstance(self.devices, (str, bytes)) or not isinstance(self.devices, Sequence)):
            raise ValueError(f"devices must be a list of device strings, one per stage process (e.g. "
                             f"['cuda:0', 'cuda:1']), or None, got {self.devices!r}")
        if self.devices:
            _check_devices(self.devices)
        if self.placement is not None and not _lists_of_ints(self.placement):
            raise ValueError(f"placement must be a list per node of the stages it runs (e.g. [[0, 1], [2]]), or "
                             f"None, got {self.placement!r}")
        if self.tp_plan is not None and (not isinstance(self.tp_plan, (list, tuple)) or not all(
                isinstance(plan, Mapping) or callable(plan) for plan in self.tp_plan)):
            raise ValueError(f"tp_plan must be a list with one plan per stage (a dict, or a callable (stage_module, "
                             f"mesh) -> module; {{}} for a stage left whole), or None, got {self.tp_plan!r}")

    @property
    def shard_group(self) -> int:
        """The replicas that shard a stage together: 1 (``"none"``), R (``"fsdp"``), ``shard_size`` (``"hsdp"``)."""
        return {"none": 1, "fsdp": self.data_parallel}.get(self.sharding, self.shard_size or 1)


def _check_shard_size(sharding: str, size: Any, replicas: int) -> None:
    """``shard_size``: with ``"hsdp"``, a divisor of ``data_parallel`` from 2 to ``data_parallel / 2``."""
    if sharding != "hsdp":
        if size is not None:
            raise ValueError(f"shard_size={size!r} is for sharding='hsdp' (shard groups of shard_size replicas); "
                             f"this run's sharding is {sharding!r}")
        return
    if type(size) is not int or size < 2 or size >= replicas or replicas % size:
        divisors = [d for d in range(2, replicas) if replicas % d == 0]
        allowed = f"one of {divisors}" if divisors else "none here: use a data_parallel with a divisor, or 'fsdp'"
        raise ValueError(f"sharding='hsdp' needs shard_size: the replicas of each shard group, a divisor of "
                         f"data_parallel={replicas} from 2 to {replicas // 2} ({allowed}), got shard_size={size!r}")


def _check_devices(devices: Sequence[str]) -> None:
    """Each of ``devices`` a device string of a device this host has ("cpu", "cuda:k")."""
    import torch

    for k, d in enumerate(devices):
        try:
            dev = torch.device(d)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"devices[{k}] = {d!r} is not a device: {exc}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"devices[{k}] = {d!r}, but CUDA is not available here")
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"devices[{k}] = {d!r}: pipeq runs stages on 'cpu' or 'cuda'")


_PARTS = {"numerics": NumericsConfig, "wire": WireConfig, "fault": FaultConfig, "placement": PlacementConfig}


@dataclass(frozen=True)
class RunConfig:
    """One run's settings: ``PipelineRunner(config=...)`` takes one whole, instead of keyword arguments.

    Attributes:
        schedule: the schedule, as the runner's ``schedule`` argument names it (a name is resolved
            when the configuration is built).
        microbatches: microbatches per step, as the runner's ``microbatches`` argument.
        trace: a file path: every stage records each action it runs (forward, backward,
            optimizer step, send, waiting for input) and ``close()`` writes one merged Chrome
            trace-event JSON file there (Perfetto, chrome://tracing; ``pipeq report`` reads it).
            Process mode only. None: no trace.
        numerics: how the stages compute (:class:`NumericsConfig`).
        wire: how the stages talk (:class:`WireConfig`).
        fault: how failures are noticed (:class:`FaultConfig`).
        placement: where the stages run (:class:`PlacementConfig`).
        auto_memory_limit: with ``schedule="auto"``: the memory each stage process may hold, in
            bytes (``"8GiB"``, ``"512MiB"``, an integer) or as a fraction of its device (``0.8``,
            ``"80%"``: of a GPU's memory, or of the host's on the CPU, shared by the processes on
            it): ``auto`` picks the fastest schedule whose every process's predicted peak fits
            (the Memory guide says how). None: 1F1B's activations, in microbatches.
    """

    schedule: SchedulePolicy = "1f1b"  # type: ignore[assignment]  # a name or a schedule: resolved when built
    microbatches: int = 8
    trace: str | os.PathLike[str] | None = None
    numerics: NumericsConfig = field(default_factory=NumericsConfig)
    wire: WireConfig = field(default_factory=WireConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    #: ``schedule="auto"`` was asked for: ``schedule`` is ZB-H1 until the runner settles it at its
    #: first step (see :mod:`pipeq.control.auto_schedule`)
    auto: bool = False
    auto_memory_limit: str | int | float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.schedule, str) and self.schedule == "auto":  # a stand-in until it is settled
            v = self.placement.stages_per_process
            object.__setattr__(self, "schedule", "zb-h1" if v is None or v == 1 else "interleaved-1f1b")
            object.__setattr__(self, "auto", True)
        object.__setattr__(self, "schedule", _with_chunks(schedules.resolve(self.schedule),
                                                          self.placement.stages_per_process))
        if self.auto_memory_limit is not None:
            from pipeq.control.memory_limit import check_setting

            check_setting(self.auto_memory_limit, self.auto, self.placement)
        m = self.microbatches
        if type(m) is not int or m < 1:
            raise ValueError(f"microbatches must be a positive integer, got {m!r}")
        cap = self.wire.queue_capacity
        if cap is not None and (type(cap) is not int or cap < m):
            raise ValueError(
                f"queue_capacity={cap!r} is too small: a stage may hold every microbatch of a "
                f"step, so it must be an integer >= microbatches ({m})")
        from pipeq import compat

        compat.check(self)
        if self.trace is not None and (not isinstance(self.trace, (str, os.PathLike))
                                       or self.placement.mode != "process"):
            raise ValueError(
                f"trace={self.trace!r}: give a file path, in process mode (a simulated run has no timeline "
                "worth tracing: every stage runs in this one process)")

    @classmethod
    def from_kwargs(cls, schedule: Any = None, microbatches: int | None = None, **settings: Any) -> "RunConfig":
        """The configuration the runner's keyword arguments (``precision=``, ``transport=``...)
        name; ``schedule`` and ``microbatches`` None: not given (their fields' defaults). An unknown
        keyword is refused as Python would (a schedule's option says where it belongs)."""
        parts = {}
        for name, kind in _PARTS.items():
            known = {f.name for f in dataclasses.fields(kind)}
            parts[name] = kind(**{k: settings.pop(k) for k in list(settings) if k in known})
        own = {k: v for k, v in (("schedule", schedule), ("microbatches", microbatches),
                                 ("trace", settings.pop("trace", None)),
                                 ("auto_memory_limit", settings.pop("auto_memory_limit", None))) if v is not None}
        if settings:
            from pipeq.control.checks import refuse_unknown

            refuse_unknown(settings)
        return cls(**own, **parts)

    @property
    def queue_capacity(self) -> int:
        """Messages a stage's queue holds (default: enough for four steps, at least 64)."""
        return self.wire.queue_capacity or max(64, 4 * self.microbatches)

    @property
    def trace_path(self) -> str | None:
        return os.fspath(self.trace) if self.trace is not None else None

    def check_stages(self, n_stages: int) -> None:
        """What depends on the number of stages: one device per stage; with several stages per
        process, whole processes (sharing a device)."""
        devices = self.placement.devices
        if devices is not None and len(devices) != n_stages:
            raise ValueError(f"devices names {len(devices)} device(s) for {n_stages} stages")
        sched = self.schedule
        if sched.stages_per_process == 1:
            return
        try:
            groups = schedules.process_stages(sched, n_stages)
        except schedules.ScheduleError as exc:
            raise ValueError(f"schedule {sched.name!r}: {exc}") from None
        for p, group in enumerate(groups):
            if devices is not None and len({devices[s] for s in group}) > 1:
                raise ValueError(f"stages {group} share process {p} ({sched.name}, {sched.placement} placement) but "
                                 f"devices gives them {[devices[s] for s in group]}: give them one device")

    def numerics_for(self, n_stages: int) -> Numerics:
        """The numerics settings checked for ``n_stages`` stages and this run's schedule and devices."""
        import torch

        from pipeq.stage import numerics as numerics_mod
        from pipeq.stage.numerics import Numerics

        from pipeq import compat

        given = self.numerics
        nm = numerics_mod.check(given.precision, given.clip_grad_norm, given.clip_norm_type,
                                given.check_finite, given.recompute, n_stages)
        used = [f.name for f in dataclasses.fields(nm) if getattr(nm, f.name) != getattr(Numerics(), f.name)]
        try:
            compat.check(self, numerics=bool(used))
        except ValueError as exc:
            raise ValueError(f"{', '.join(used)}: {exc}") if used else exc from None
        devices = self.placement.devices
        numerics_mod.check_device(nm, devices or (["cuda"] if torch.cuda.is_available() else ["cpu"]))
        return nm


def setting_fields() -> list[dataclasses.Field]:
    """Every setting the runner takes by keyword: each part's fields, then ``trace`` and ``auto_memory_limit``."""
    out = [f for kind in _PARTS.values() for f in dataclasses.fields(kind)]
    return out + [f for f in dataclasses.fields(RunConfig) if f.name in ("trace", "auto_memory_limit")]


def setting_default(name: str) -> Any:
    """The default of setting ``name`` (``schedule``, ``microbatches`` or one of :func:`setting_fields`),
    read from the dataclass field that declares it: the one place a setting's default is written
    (job-file keys, the runner's signature and the docs read it here). A default computed when a
    configuration is built (``start_method``: from ``PIPEQ_START_METHOD``) is computed now."""
    own = [f for f in dataclasses.fields(RunConfig) if f.name in ("schedule", "microbatches")]
    for f in own + setting_fields():
        if f.name == name:
            return f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
    raise KeyError(f"{name!r} is not a setting of a RunConfig")


def _with_chunks(schedule: SchedulePolicy, v: int | None) -> SchedulePolicy:
    """``schedule`` holding ``v`` stages per process (None: as it is); refused when it cannot."""
    if v is None or v == schedule.stages_per_process:
        return schedule
    if "stages_per_process" in schedule.option_names:
        return schedule.with_options(**{**schedule.options, "stages_per_process": v})
    raise ValueError(
        f"stages_per_process={v}: schedule {schedule.name!r} runs {schedule.stages_per_process} stage(s) per "
        "process; for several, use interleaved-1f1b or looped-bfs (looped placement, any number >= 2) or zbv / "
        "dualpipev (V placement, 2 stages per process)")


def check_step_timeout(step_timeout: Any, heartbeat_interval: float) -> None:
    """``step_timeout``: None (off), or seconds longer than the heartbeat interval (a stage
    reports the action it is in once per heartbeat)."""
    if step_timeout is None:
        return
    if type(step_timeout) not in (int, float) or not math.isfinite(step_timeout) or step_timeout <= 0:
        raise ValueError(f"step_timeout must be a positive number of seconds, or None (off), got {step_timeout!r}")
    if step_timeout <= heartbeat_interval:
        raise ValueError(
            f"step_timeout={step_timeout!r} must be longer than heartbeat_interval={heartbeat_interval!r}: "
            "a stage reports the action it is in once per heartbeat")
