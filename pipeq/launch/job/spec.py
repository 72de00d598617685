"""The Job: a loaded job file's settings, and what the driver resolves from them (data, metrics)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

from pipeq import schedules
from pipeq.launch.job.keys import field_of
from pipeq.launch.job.names import check_args, required_positional, resolve
from pipeq.launch.job.recipe import Recipe

if TYPE_CHECKING:
    from pipeq.control.config import RunConfig

__all__ = ["Job"]


@dataclass
class Job:
    """What ``pipeq launch`` trains: the stages' recipe and the driver's settings.

    Its fields are the job file's keys of the same names (their defaults and meanings:
    :data:`pipeq.launch.job.keys.KEYS`), but ``placement``: the processes per node (the file's
    ``[placement] nodes``), and ``path``: the job file's."""

    recipe: Recipe
    data: str
    eval_data: str | None = field_of("eval_data")
    schedule: "str | schedules.ScheduleFn" = field_of("schedule")  # a name, or a schedule object with its options
    microbatches: int = field_of("microbatches")
    auto_memory_limit: str | int | float | None = field_of("auto_memory_limit")
    steps: int | None = field_of("steps")
    epochs: int | None = field_of("epochs")
    out: str = field_of("out")
    checkpoint_every: int = field_of("checkpoint_every")
    keep_checkpoints: int = field_of("keep_checkpoints")
    eval_every: int = field_of("eval_every")
    log_every: int = field_of("log_every")
    placement: list[list[int]] | None = field_of("placement")
    threads_per_stage: int | None = field_of("threads_per_stage")
    heartbeat_timeout: float = field_of("heartbeat_timeout")
    step_timeout: float | None = field_of("step_timeout")  # 0 (in a job file) or None: off
    start_timeout: float = field_of("start_timeout")
    trace: str | None = field_of("trace")
    # None (not set): event files when the tensorboard package is installed;
    # set true, a missing package is an error (pipeq.launch.tensorboard.writer_class)
    tensorboard: bool | None = field_of("tensorboard")
    data_parallel: int = field_of("data_parallel")
    tensor_parallel: int = field_of("tensor_parallel")
    sharding: str = field_of("sharding")
    shard_size: int | None = field_of("shard_size")
    fsdp_reshard: str = field_of("fsdp_reshard")
    tp_plan: list[dict[str, str]] | None = field_of("tp_plan")
    stages_per_process: int | None = field_of("stages_per_process")
    max_restarts: int = field_of("max_restarts")
    snapshot_every: int = field_of("snapshot_every")
    fault_tolerance: str | None = field_of("fault_tolerance")
    rejoin_timeout: float = field_of("rejoin_timeout")
    min_nodes: int | None = field_of("min_nodes")
    tcp_security: str = field_of("tcp_security")
    trusted_network: bool = field_of("trusted_network")
    max_message_mb: int = field_of("max_message_mb")
    shm_slots: int = field_of("shm_slots")
    data_args: dict[str, Any] = field_of("data_args")
    eval_data_args: dict[str, Any] = field_of("eval_data_args")
    metrics: dict[str, str] = field_of("metrics")
    lr_scheduler_monitor: str | None = field_of("lr_scheduler_monitor")  # see monitor()
    # how the stages compute (pipeq.stage.numerics; PipelineRunner's arguments of the same names)
    precision: str = field_of("precision")
    clip_grad_norm: float | None = field_of("clip_grad_norm")
    clip_norm_type: float = field_of("clip_norm_type")
    check_finite: bool | str = field_of("check_finite")
    recompute: bool | list[bool] = field_of("recompute")
    loss_weighting: str = field_of("loss_weighting")
    compile: bool | dict[str, Any] = field_of("compile")
    path: str = ""

    def data_fn(self) -> Callable[..., Iterable]:
        """The function ``data`` names, its ``data_args`` checked."""
        self.recipe._imports()
        fn = resolve(self.data, "data")
        check_args(fn, self.data_args, "data", self.data)
        return fn

    def batches(self, epoch: int) -> Iterable:
        """Epoch ``epoch``'s batches: ``data(epoch, **data_args)`` (or ``data(**data_args)``)."""
        fn = self.data_fn()
        args = self.data_args
        return fn(epoch, **args) if required_positional(fn, args) >= 1 else fn(**args)

    def _eval_source(self) -> Any:
        """What eval_data names, its eval_data_args checked (None without eval_data)."""
        if self.eval_data is None:
            return None
        self.recipe._imports()
        got = resolve(self.eval_data, "eval_data")
        if not callable(got) and self.eval_data_args:
            raise ValueError(f"eval_data_args: eval_data = {self.eval_data!r} is data, not a function to call "
                             "with them; name a function, or drop eval_data_args")
        if callable(got):
            check_args(got, self.eval_data_args, "eval_data", self.eval_data)
        return got

    def eval_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The evaluation set as a list of (x, target) batches (None without eval_data)."""
        got = self._eval_source()
        if got is None:
            return None
        got = got(**self.eval_data_args) if callable(got) else got
        if isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], torch.Tensor):
            return [got]
        return list(got)

    def metric_fns(self) -> dict[str, Callable]:
        """The job's evaluation metrics, by name (see :mod:`pipeq.control.evaluation`)."""
        self.recipe._imports()
        out = {}
        for name, spec in self.metrics.items():
            fn = resolve(spec, f"metrics.{name}")
            if not callable(fn):
                raise ValueError(f"metrics.{name} = {spec!r} is not callable as fn(output, target) -> float")
            out[name] = fn
        return out

    def monitor(self) -> str:
        """What ``pipeq launch`` feeds a ReduceLROnPlateau at the end of each epoch: the job's
        ``lr_scheduler_monitor``, by default ``eval_loss`` with eval data and ``train_loss`` (the
        mean of the epoch's step losses) without."""
        if self.lr_scheduler_monitor is not None:
            return self.lr_scheduler_monitor
        return "eval_loss" if self.eval_data is not None else "train_loss"

    def run_config(self) -> "RunConfig":
        """The run's configuration (:class:`~pipeq.RunConfig`) the job's keys name:
        what node 0's runner and every node's agent are given, and what nodes compare."""
        from pipeq.control.config import FaultConfig, NumericsConfig, PlacementConfig, RunConfig, WireConfig

        tp = self.tensor_parallel
        return RunConfig(
            self.schedule, self.microbatches, self.trace,
            NumericsConfig(self.precision, self.clip_grad_norm, self.clip_norm_type, self.check_finite,
                           self.recompute, self.loss_weighting, self.compile_setting()),
            WireConfig(tcp_security=self.tcp_security, max_message_mb=self.max_message_mb, shm_slots=self.shm_slots,
                       trusted_network=self.trusted_network),
            FaultConfig(heartbeat_timeout=self.heartbeat_timeout, step_timeout=self.step_timeout or None,  # 0: off
                        start_timeout=self.start_timeout, fault_tolerance=self.fault_tolerance),
            PlacementConfig(threads_per_stage=self.threads_per_stage, start_method="forkserver",
                            placement=self.placement, data_parallel=self.data_parallel, tensor_parallel=tp,
                            tp_plan=self.tp_plan if tp > 1 else None,  # --tensor-parallel 1: no plan
                            stages_per_process=self.stages_per_process, sharding=self.sharding,
                            shard_size=self.shard_size, fsdp_reshard=self.fsdp_reshard),
            auto_memory_limit=self.auto_memory_limit)

    def compile_setting(self) -> bool | dict[str, Any]:
        """The job's ``compile``, its cache in the run directory (``OUT/compile-cache``: shared by the
        stage processes, kept across restarts and later runs) unless the job names one."""
        if self.compile is False:
            return False
        given = {} if self.compile is True else dict(self.compile)
        given.setdefault("cache_dir", os.path.join(self.out, "compile-cache"))
        return given

    def check(self) -> None:
        """Resolve what the driver calls (data, eval_data, metrics) and check their arguments,
        before any stage process starts: a ``ValueError`` names the key."""
        self.data_fn()
        self._eval_source()
        self.metric_fns()
