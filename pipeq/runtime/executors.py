"""Which executor runs a stage: the schedule decides.

A stage is built from a :class:`~pipeq.stage.spec.StageSpec` (or a
:class:`~pipeq.stage.spec.StageBuilder` makes one in the stage process; both are importable
from here too). :func:`make_executor` builds the executor the schedule asks for
(:meth:`pipeq.schedules.SchedulePolicy.executor`): plain backprop's
:class:`~pipeq.stage.executor.StageExecutor` with the run's numerics when it names none, the
tensor-parallel one (:mod:`pipeq.parallel.tensor`) when the stage is sharded, its memory meter
asked to measure the run's first training step. The worker process and the simulated engine both
build theirs here, and a stage with tied weights is refused here
with a schedule or a split that cannot sum them (:func:`pipeq.stage.tie_groups.refuse_ties`).
"""

from __future__ import annotations

import dataclasses

import torch

from pipeq.schedules.protocol import SchedulePolicy
from pipeq.schedules.registry import resolve
from pipeq.stage.compiled import CompileOptions, compile_stage, unwrap
from pipeq.stage.executor import StageExecutor
from pipeq.stage.numerics import Numerics
from pipeq.stage.spec import StageBuilder, StageSpec
from pipeq.stage.tie_groups import refuse_ties

__all__ = ["StageSpec", "StageBuilder", "make_executor"]


def make_executor(schedule: "SchedulePolicy | str", index: int, n_stages: int, spec: StageSpec, device: torch.device,
                  numerics: Numerics | None = None, sharded: bool = False,
                  compile: CompileOptions | None = None, fsdp_reshard: str | None = None) -> StageExecutor:
    """Stage ``index``'s executor; ``numerics`` (precision, clipping...) apply to plain backprop's
    (the runner refuses them with the other schedules). ``sharded``: the module is split over
    its tensor-parallel shards (plain backprop only: pipeq.parallel.tensor). ``compile``: the
    stage's module is compiled, once on its device (:mod:`pipeq.stage.compiled`). ``fsdp_reshard``:
    the module is sharded over its replicas with FSDP2, freed as it says (pipeq.parallel.fsdp)."""
    module, compiled_here = unwrap(spec.module)  # a recipe's stage compiled in the stage process
    if compiled_here:
        spec = dataclasses.replace(spec, module=module)
        compile = compile or CompileOptions()
    refuse_ties(resolve(schedule), [spec.module], first=index, sharded=sharded)
    if sharded:
        from pipeq.parallel.tensor import ShardedStageExecutor

        ex: StageExecutor = ShardedStageExecutor(index, n_stages, spec, device)
    elif fsdp_reshard is not None:
        from pipeq.parallel.fsdp import FsdpStageExecutor

        ex = FsdpStageExecutor(index, n_stages, spec, device, reshard=fsdp_reshard)
        if numerics is not None:
            ex.set_numerics(numerics)
    else:
        ex = resolve(schedule).executor(index, n_stages, spec, device)
        if ex is None:
            ex = StageExecutor(index, n_stages, spec, device)
            if numerics is not None:
                ex.set_numerics(numerics)
        if compile is not None:
            ex.compile_watch = compile_stage(ex.module, compile)
    ex.memory.ask()  # a run measures its first training step (pipeq.stage.memory)
    return ex
