"""A stage's parallel layers: what tensor parallelism, FSDP and the replicas add to its compute.

One object per stage, :class:`StageParallel`, which the stage's executor
(:class:`~pipeq.stage.executor.StageExecutor`, the same for every combination) calls around the
same F / B / I / W / STEP. Each layer is there or not; none excludes another::

    prepare(module)      tp: split over mesh["tp"] (pipeq.parallel.tensor); then shard: fully_shard
                         over mesh["shard"] (pipeq.parallel.fsdp)
    begin(training)      shard: gather the parameters ("step")
    around(fn, *args)    shard: gather and free around one action ("microbatch", forward-only steps)
    output(value)        tp: whole tensors for the neighbour
    arm / start / finish the step's gradient reduction: shard's reduce-scatter over the slice, then
                         the replicate slices' all-reduce (pipeq.parallel.data.GradSync)
    combine(stats)       the step's statistics over the slice: each process holds pieces
    norm_weight(grad)    how much of a gradient piece this process counts (a piece held by k
                         processes of the slice counts 1/k on each)
    release()            shard: free the gathered parameters before a state is read or loaded

A stage's compile (:mod:`pipeq.stage.compiled`) and memory meter (:mod:`pipeq.stage.memory`)
compose the same way: the compiled forward runs inside these hooks, and the meter counts what
the gathered parameters hold.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
from torch import nn

from pipeq.stage.numerics import StepStats

__all__ = ["StageParallel"]


class StageParallel:
    """Stage ``stage``'s layers on ``mesh`` (a :class:`~pipeq.parallel.mesh.StageMesh`):
    ``tp_plan`` (with ``tensor_parallel``), ``sharding`` (``"none"``, ``"fsdp"``, ``"hsdp"``) with
    ``fsdp_reshard``. The replicas' gradient sum is attached once the optimizer exists
    (:meth:`attach_replicas`)."""

    def __init__(self, mesh: Any, stage: int, *, tp_plan: Any = None, sharding: str = "none",
                 fsdp_reshard: str = "step") -> None:
        self.mesh, self.stage = mesh, stage
        self.tp_plan = tp_plan
        self.sharded = sharding != "none" and mesh.plan.shard_size > 1
        self.fsdp_reshard = fsdp_reshard
        self.sharding: Any = None  # a pipeq.parallel.fsdp.Sharding once prepared
        self.sync: Any = None  # the replicas' pipeq.parallel.data.GradSync (attach_replicas)
        self.tp = mesh.plan.shards > 1
        self.slice_size = mesh.plan.slice_size
        self.params: list[torch.Tensor] = []  # the module's, once prepared
        self._gradients_laid_out = False

    # -- building --------------------------------------------------------------------------------
    def prepare(self, module: nn.Module, device: torch.device) -> nn.Module:
        """``module`` on ``device``, split and sharded as the stage's layers say."""
        module = module.to(device)
        if self.tp:
            from pipeq.parallel import tensor as tensorpar

            tensorpar.check_stage(self.stage, module, self.tp_plan, self.mesh.plan.shards)
            module = tensorpar.parallelize(module, self.tp_plan, self.mesh.tp_mesh)
        if self.sharded:
            from pipeq.parallel import fsdp

            module = fsdp.shard(module, self.mesh.shard_mesh)
            self.sharding = fsdp.Sharding(module, self.fsdp_reshard)
        self.params = list(module.parameters())
        return module

    def attach_replicas(self, sync: Any) -> None:
        """The replicas' :class:`~pipeq.parallel.data.GradSync` (None with one replicate slice)."""
        self.sync = sync

    # -- a step ----------------------------------------------------------------------------------
    def begin(self, training: bool) -> None:
        self._gradients_laid_out = False
        if self.sharding is not None:
            self.sharding.begin(training)

    def around(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.sharding is not None:
            return self.sharding.around(fn, *args)
        return fn(*args)

    def output(self, value: Any) -> Any:
        if not self.tp:
            return value
        from pipeq.parallel.tensor import whole

        return whole(value)  # a user's style with use_local_output=False may leave a DTensor

    def arm(self) -> None:
        """Before the step's last backward."""
        if self.sync is not None and self.sharding is None:
            self.sync.arm()

    def start(self) -> None:
        """After the step's last backward: the reduce-scatter (sharded), then the replicas' sums start."""
        self._laid_out()
        if self.sharding is not None:
            self.sharding.reduce()
        if self.sync is not None:
            self.sync.start()

    def finish(self) -> None:
        """Before the optimizer step: every reduction done."""
        self._laid_out()
        if self.sharding is not None:
            self.sharding.reduce()  # (no backward ran on this stage this step: it still takes part)
        if self.sync is not None:
            self.sync.finish()

    def _laid_out(self) -> None:
        """(Tensor parallelism, once per step, the replicas' buckets as they go.) Each gradient laid
        out as its parameter is (:func:`~pipeq.parallel.data.laid_out`)."""
        if not self.tp or self._gradients_laid_out:
            return
        self._gradients_laid_out = True
        from pipeq.parallel.data import laid_out

        for p in self.params:
            laid_out(p)

    def release(self) -> None:
        if self.sharding is not None:
            self.sharding.free()

    # -- the step's statistics ----------------------------------------------------------------------
    def norm_weight(self, grad: torch.Tensor) -> float:
        """The share of ``grad``'s norm term this process counts: 1 / (the slice's processes that
        hold the same piece)."""
        if self.slice_size == 1:
            return 1.0
        pieces = 1
        if hasattr(grad, "placements"):
            for placement, size in zip(grad.placements, grad.device_mesh.shape):  # type: ignore[attr-defined]
                if placement.is_shard() or type(placement).__name__ == "_StridedShard":
                    pieces *= size
        return pieces / self.slice_size

    def combine(self, mine: StepStats, norm_type: float) -> StepStats:
        """This process's statistics combined with its slice's (pieces of one stage)."""
        if self.slice_size == 1:
            return mine
        term = torch.tensor([mine.norm_term], dtype=torch.float64)
        bad = torch.tensor([mine.first_bad], dtype=torch.float64)
        self.mesh.all_reduce(term, "max" if math.isinf(norm_type) else "sum")
        self.mesh.all_reduce(bad, "min")
        return StepStats(float(term[0]), float(bad[0]))

    def weighted(self, grads: Sequence[torch.Tensor]) -> list[float] | None:
        """Each gradient's :meth:`norm_weight` (None: every one counts whole)."""
        if self.slice_size == 1:
            return None
        return [self.norm_weight(g) for g in grads]
