"""Sharded replicas on torch's FSDP2 (``data_parallel=R, sharding="fsdp"``).

Without sharding each of a stage's R replicas holds the whole stage and the replicas sum their
gradients over pipeq's replica links (:mod:`pipeq.parallel.data`). With ``sharding="fsdp"`` the
R replicas of a stage process form a torch.distributed process group (:func:`join`: the one
tensor parallelism makes, :func:`pipeq.parallel.tensor.join`: a FileStore in the run's private
directory, gloo bound to loopback, NCCL beside it for CUDA tensors) and each stage's module is
``torch.distributed.fsdp.fully_shard``-ed over it (:func:`shard`): replica r holds the r-th
piece (dim 0) of every parameter, of its gradient and of the optimizer's state (the optimizer
is built on the sharded parameters). Nothing here shards anything: FSDP2 does.

A step, per stage (chunk) of the process::

    begin         module.unshard(): the parameters all-gathered (fsdp_reshard="step": once, kept)
    F / B / I / W the gathered parameters compute; their gradients accumulate, whole, in the
                  gathered parameters' .grad (FSDP's per-backward reduce-scatter is off:
                  set_requires_gradient_sync(False)); fsdp_reshard="microbatch" gathers before
                  each action and frees after it
    last B / W    the step's one reduce-scatter (:class:`ReduceScatter`, in the slot of the
                  replicated run's GradSync): each replica gets the SUM of the replicas'
                  gradients of its piece (the divide factor is 1: every microbatch's loss is
                  weighted by its share of the whole batch already), and the parameters are freed
    STEP          the optimizer steps on the pieces; clipping's norm term and the found-inf of
                  fp16 / check_finite are all-reduced over the replicas (:class:`ShardedStepper`)

The zero-bubble schedules' ``W`` (:mod:`pipeq.stage.backprop`) differentiates into the module's
parameters: while gathered FSDP2 registers the gathered ones on the module, which are what the
forward used. The V schedules' two chunks per process are two FSDP roots over one group; every
replica runs the same actions in the same order, so their collectives line up.

States leave the stage whole (:class:`~pipeq.parallel.tensor.ShardedStateIO`, as tensor
parallelism's: ``full_tensor()`` to read, a local cut to load), so ``state_dict``, snapshots and
checkpoints hold the usual names and load at any ``data_parallel``, sharded or not. Reading one is
a collective: the driver asks every replica of a sharded stage (and takes replica 0's answer), as it
does a ``predict``.

Refused (:func:`refuse_settings`, :func:`refuse_model`), each before any process starts: tied
weights (their sum across stages would have to be a sum of pieces), ``tensor_parallel`` (a 2-D
mesh), ``compile``, ``fault_tolerance="replicas"`` (a lost replica takes its pieces with it: a run
restarts from a snapshot or a checkpoint instead), the schedules that compute their own way or
stream across batches, simulated mode and multi-host runs (the group meets in a private directory).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from pipeq.parallel.tensor import ShardedStateIO, join, leave
from pipeq.stage.executor import StageExecutor
from pipeq.stage.numerics import StepStats
from pipeq.stage.spec import StageSpec
from pipeq.stage.step import Stepper

__all__ = ["join", "leave", "shard", "refuse_settings", "refuse_model", "ReduceScatter", "ShardedStepper",
           "FsdpStageExecutor"]


def refuse_settings(cfg: Any) -> None:
    """What ``sharding="fsdp"`` does not compose with in a run's :class:`~pipeq.RunConfig`, refused
    naming the setting and why."""
    place, sched = cfg.placement, cfg.schedule
    if place.mode != "process":
        raise ValueError("sharding='fsdp': the replicas of a stage shard it among their processes; use "
                         "mode='process'")
    if place.tensor_parallel != 1:
        raise ValueError(f"sharding='fsdp' with tensor_parallel={place.tensor_parallel}: a 2-D mesh (replica x "
                         "shard) is not supported; use one of them")
    if cfg.fault.fault_tolerance == "replicas":
        raise ValueError("sharding='fsdp' with fault_tolerance='replicas': a lost replica takes its pieces of every "
                         "parameter and optimizer state with it, so no healthy replica can rebuild it; restart from "
                         "a snapshot or a checkpoint instead (pipeq launch --max-restarts)")
    if cfg.numerics.compile not in (False, None):
        raise ValueError("sharding='fsdp' with compile: torch.compile of FSDP2-sharded stages is not supported "
                         "here yet; run them eager")
    if not sched.plain_backprop or sched.streams_across_batches or sched.per_microbatch_steps:
        raise ValueError(f"sharding='fsdp' runs with the synchronous schedules of plain backprop (fill-drain, 1f1b, "
                         f"interleaved-1f1b, zb-h1, zb-h2, zbv, dualpipev, v-half, v-min and your own of F, B, I, W "
                         f"and STEP), not with {sched.name!r}")


def refuse_model(has_ties: bool, multi_host: bool) -> None:
    """What the model or the run's hosts add to :func:`refuse_settings`."""
    if has_ties:
        raise ValueError("sharding='fsdp' with tied weights: their gradients are summed across stages whole, and "
                         "a sharded stage holds only a piece of each; untie them or use sharding='none'")
    if multi_host:
        raise ValueError("sharding='fsdp' runs on one host (the replicas' process group meets in the run's private "
                         "directory); use sharding='none' across hosts")


def shard(module: nn.Module, mesh: Any) -> nn.Module:
    """``module`` (on its device) with replica 0's parameters and buffers (broadcast: replicas
    never start apart), then ``fully_shard``-ed over ``mesh``: gathered
    parameters kept after the forward (pipeq decides when to free them), the reduce-scatter a
    sum (divide factor 1, no pre-/post-scaling)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=0)
    fully_shard(module, mesh=mesh, reshard_after_forward=False)
    module.set_gradient_divide_factor(1.0)  # type: ignore[operator]
    module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]  # a plain SUM (gloo has no PREMUL_SUM)
    # a parameter one replica's microbatches left unused still takes part (a zero gradient), so that
    # every replica's reduce-scatter holds the same tensors, as the replicated run's sum does
    module.set_reduce_scatter_unused_params(True)  # type: ignore[operator]
    return module


def _accumulating(module: Any) -> None:
    """Within a step: FSDP's hooks accumulate whole gradients and free nothing (pipeq does)."""
    module.set_requires_gradient_sync(False)
    module.set_reshard_after_backward(False)
    module.set_is_last_backward(False)


class ReduceScatter:
    """The step's one reduce-scatter of a sharded stage's gradients, where the replicated run's
    :class:`~pipeq.parallel.data.GradSync` sits (:class:`~pipeq.stage.step.Stepper` calls
    :meth:`start` after the step's last backward, :meth:`finish` before the optimizer step). As
    torch's own pipelining stage does it: FSDP's post-backward of every parameter group, by hand,
    with gradient sync on, then its root's final callback (which waits for the reductions)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.started = False

    def start(self) -> None:
        from torch.distributed.fsdp import fully_shard

        self.started = True
        module = self.module
        module.set_requires_gradient_sync(True)  # type: ignore[operator]
        module.set_reshard_after_backward(True)  # type: ignore[operator]
        module.set_is_last_backward(True)  # type: ignore[operator]
        root = fully_shard.state(module)
        for state in root._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                group.post_backward()
        root._root_post_backward_final_callback()
        _accumulating(self.module)

    def finish(self) -> None:
        if not self.started:  # no backward ran on this stage this step: it still takes part
            self.start()
        self.started = False


class ShardedStepper(Stepper):
    """A sharded stage's :class:`~pipeq.stage.step.Stepper`: its gradients are pieces (DTensors),
    so it unscales, checks and clips their local tensors, and its part of the step's statistics
    (the norm term, the first stage with a non-finite gradient) is combined over the replicas
    (the process group) before the stages combine theirs."""

    def _grads(self) -> list[torch.Tensor]:
        return [_local(g) for g in super()._grads()]

    def _norm_grads(self) -> list[torch.Tensor]:
        return [_local(g) for g in super()._norm_grads()]

    def stats(self) -> StepStats:
        import math

        import torch.distributed as dist

        mine = super().stats()
        terms = torch.tensor([mine.norm_term], dtype=torch.float64)
        bad = torch.tensor([mine.first_bad], dtype=torch.float64)
        inf = math.isinf(self.numerics.clip_norm_type)
        dist.all_reduce(terms, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
        dist.all_reduce(bad, op=dist.ReduceOp.MIN)
        return StepStats(float(terms[0]), float(bad[0]))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class FsdpStageExecutor(StageExecutor):
    """A stage sharded over its replicas with FSDP2 (see the module): plain backprop's executor,
    its module gathered and freed around the step's computation as ``reshard`` says
    (``"step"`` or ``"microbatch"``), its gradients reduce-scattered once per step, its states
    whole (:class:`~pipeq.parallel.tensor.ShardedStateIO`)."""

    stepper_type = ShardedStepper

    def __init__(self, index: int, n_stages: int, spec: StageSpec, device: torch.device, *, reshard: str) -> None:
        super().__init__(index, n_stages, spec, device)
        if self.tied is not None:  # (a recipe's ties are known only here)
            refuse_model(True, False)
        self.stepper.grad_sync = ReduceScatter(self.module)
        self.state_io = ShardedStateIO(index, self.module, device, self.stepper)
        self.per_action = reshard == "microbatch"
        _accumulating(self.module)

    def _gather(self) -> None:
        self.module.unshard()  # a no-op when gathered already (no collective then, on every replica alike)

    def _free(self) -> None:
        self.module.reshard()  # local: frees the gathered copy, the pieces are the module's again

    def begin(self, step: int, sizes: Sequence[int], training: bool, x: Any = None, target: Any = None,
              weights: Sequence[float] | None = None, aux_weights: Sequence[float] | None = None,
              inputs: dict[str, Any] | None = None) -> None:
        super().begin(step, sizes, training, x, target, weights, aux_weights, inputs)
        if training and not self.per_action:
            self._gather()

    def _around(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the gathered parameters: gathered per action with ``"microbatch"``, and
        in a forward-only step (predict, evaluate) whatever the policy, which no reduce-scatter
        ends: a replica keeps only its pieces after it (every replica runs the same forwards)."""
        if self.training and not self.per_action:
            return fn(*args)
        self._gather()
        try:
            return fn(*args)
        finally:
            self._free()

    def forward(self, j: int, received: Any) -> Any:
        return self._around(super().forward, j, received)

    def backward(self, j: int, grads: Any) -> Any:
        return self._around(super().backward, j, grads)

    def input_grad(self, j: int, grads: Any) -> Any:
        return self._around(super().input_grad, j, grads)

    def weight_grad(self, j: int) -> None:
        self._around(super().weight_grad, j)

    # -- state: read and loaded from the pieces (the gathered copy freed first: local) ------------
    def state_tensors(self) -> tuple[list[str], list[torch.Tensor]]:
        self._free()
        return super().state_tensors()

    def load_state(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
        self._free()
        super().load_state(names, tensors)

    def snapshot(self) -> dict[str, Any]:
        self._free()
        return super().snapshot()

    def restore(self, snap: dict[str, Any]) -> None:
        self._free()
        super().restore(snap)
