"""Which executor runs a stage: the schedule decides; the stage's layers compose on it.

A stage is built from a :class:`~pipeq.stage.spec.StageSpec` (or a
:class:`~pipeq.stage.spec.StageBuilder` makes one in the stage process; both are importable
from here too). :func:`make_executor` builds the executor the schedule asks for
(:meth:`pipeq.schedules.SchedulePolicy.executor`), else plain backprop's
:class:`~pipeq.stage.executor.StageExecutor` with the run's numerics. Whatever the stage's
parallel layers (tensor parallelism, FSDP, replicas: a :class:`~pipeq.parallel.layers.StageParallel`)
and whether it is compiled, the executor is the same: the layers hook its F / B / I / W / STEP,
the compile wraps its module's forward (:mod:`pipeq.stage.compiled`), and its memory meter is
asked to measure the run's first training step. The worker process and the simulated engine both
build theirs here, and a stage with tied weights is refused here with a schedule that cannot sum
them (:func:`pipeq.stage.tie_groups.refuse_ties`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pipeq.errors import ScheduleError
from pipeq.schedules.actions import Op
from pipeq.schedules.protocol import SchedulePolicy
from pipeq.schedules.registry import resolve
from pipeq.stage.compiled import CompileOptions, compile_stage, unwrap
from pipeq.stage.executor import StageExecutor
from pipeq.stage.numerics import Numerics
from pipeq.stage.spec import StageBuilder, StageSpec
from pipeq.stage.tie_groups import refuse_ties

__all__ = ["StageSpec", "StageBuilder", "make_executor", "splits_backward"]


def splits_backward(policy: SchedulePolicy, n_stages: int) -> bool:
    """Whether ``policy`` runs some backward as ``I`` and ``W`` apart (its plan for the run's
    processes and twice as many microbatches has an ``I``): a compiled stage's backward is then
    cut in two (:mod:`pipeq.stage.split_backward`)."""
    processes = max(1, n_stages // max(1, policy.stages_per_process))
    for m in (2 * processes, 4 * processes):
        try:
            plan = policy.plan(processes, m)
        except (ValueError, ScheduleError):
            continue
        return any(a.op is Op.INPUT_GRAD for row in plan for a in row)
    return False


def make_executor(schedule: "SchedulePolicy | str", index: int, n_stages: int, spec: StageSpec, device: torch.device,
                  numerics: Numerics | None = None, compile: CompileOptions | None = None,
                  parallel: Any = None) -> StageExecutor:
    """Stage ``index``'s executor; ``numerics`` (precision, clipping...) apply to plain backprop's
    (the run refuses them with the other schedules). ``compile``: the stage's module is compiled,
    once on its device (:mod:`pipeq.stage.compiled`). ``parallel``: the stage's parallel layers
    (a research schedule's executor holds its stage whole: only its replicas' sums)."""
    module, compiled_here = unwrap(spec.module)  # a recipe's stage compiled in the stage process
    if compiled_here:
        spec = dataclasses.replace(spec, module=module)
        compile = compile or CompileOptions()
    policy = resolve(schedule)
    refuse_ties(policy, [spec.module], first=index)
    ex = policy.executor(index, n_stages, spec, device)
    if ex is None:
        ex = StageExecutor(index, n_stages, spec, device, parallel=parallel)
        if numerics is not None:
            ex.set_numerics(numerics)
    elif parallel is not None:
        ex.adopt(parallel)
    if compile is not None:  # (tensor-parallel stages compile static shapes: pipeq.compat, tp-compile-dynamic)
        if type(ex) is StageExecutor and splits_backward(policy, n_stages):
            compile = dataclasses.replace(compile, split_backward=True)
        ex.compile_watch = compile_stage(ex.module, compile, static=parallel is not None and parallel.tp, stage=index)
    ex.memory.ask()  # a run measures its first training step (pipeq.stage.memory)
    return ex
