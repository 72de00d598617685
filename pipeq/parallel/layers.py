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
    figures()            what the layers hold beside the stage's state: the gathered parameters,
                         the reductions' buckets (``runner.memory()``: pipeq.control.reports)

A stage's compile (:mod:`pipeq.stage.compiled`) and memory meter (:mod:`pipeq.stage.memory`)
compose the same way: the compiled forward runs inside these hooks. A traced run records each
gather, free and reduction as a ``parallel`` event of the stage's track (:mod:`pipeq.trace.format`:
``GATHER``, ``FREE``, ``REDUCE``).
"""

from __future__ import annotations

import math
import time
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
        self.step = 0
        #: ``rec(row)``: a traced run's record of the stage's actions (pipeq.trace.format rows), else None
        self.trace: Callable[[tuple[int, ...]], None] | None = None
        self.gathered_bytes = 0  # what the parameters take whole (a sharded stage gathers them)

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

            self.gathered_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
            module = fsdp.shard(module, self.mesh.shard_mesh)
            self.sharding = fsdp.Sharding(module, self.fsdp_reshard)
        self.params = list(module.parameters())
        return module

    def _traced(self, code: int, fn: Callable[[], Any], nbytes: int = 0) -> Any:
        """``fn()``, recorded as a ``code`` row of the stage's trace when the run is traced."""
        if self.trace is None:
            return fn()
        t0 = time.perf_counter_ns()
        try:
            return fn()
        finally:
            self.trace((code, self.step, -1, t0, time.perf_counter_ns(), nbytes))

    def attach_replicas(self, sync: Any) -> None:
        """The replicas' :class:`~pipeq.parallel.data.GradSync` (None with one replicate slice)."""
        self.sync = sync

    # -- a step ----------------------------------------------------------------------------------
    def begin(self, step: int, training: bool) -> None:
        self.step = step
        self._gradients_laid_out = False
        sharding = self.sharding
        if sharding is not None and training and not sharding.per_action:
            from pipeq.trace.format import GATHER

            self._traced(GATHER, lambda: sharding.begin(training), self.gathered_bytes)
        elif sharding is not None:
            sharding.begin(training)  # nothing to gather yet: each action gathers its own

    def around(self, fn: Callable[..., Any], *args: Any) -> Any:
        sharding = self.sharding
        if sharding is None or self.trace is None or sharding.gathered(fn):
            return sharding.around(fn, *args) if sharding is not None else fn(*args)
        from pipeq.trace.format import FREE, GATHER

        self._traced(GATHER, sharding.gather, self.gathered_bytes)
        try:
            return fn(*args)
        finally:
            self._traced(FREE, sharding.free)

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
        from pipeq.trace.format import REDUCE

        self._traced(REDUCE, self._start, self.reduce_bytes())

    def _start(self) -> None:
        self._laid_out()
        if self.sharding is not None:
            self.sharding.reduce()
        if self.sync is not None:
            self.sync.start()

    def finish(self) -> None:
        """Before the optimizer step: every reduction done."""
        from pipeq.trace.format import REDUCE

        self._traced(REDUCE, self._finish)

    def _finish(self) -> None:
        self._laid_out()
        if self.sharding is not None:
            self.sharding.reduce()  # (no backward ran on this stage this step: it still takes part)
        if self.sync is not None:
            self.sync.finish()

    def reduce_bytes(self) -> int:
        """The gradient bytes a step's reductions hold in flat buckets (the replicas' all-reduce of
        this process's pieces; a sharded stage's reduce-scatter works in FSDP's own buffers)."""
        return self.sync.layout_bytes if self.sync is not None else 0

    def figures(self) -> dict[str, int]:
        """What the layers hold beside the stage's state: the parameters gathered whole (through a
        training step, or one action at a time with ``fsdp_reshard="microbatch"``), and the
        reductions' buckets."""
        return {"gathered_param_bytes": self.gathered_bytes if self.sharding is not None else 0,
                "reduce_bytes": self.reduce_bytes()}

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
