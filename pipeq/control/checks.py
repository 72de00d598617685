"""Checking the model a :class:`~pipeq.PipelineRunner` is given, before any process starts.

Every refusal is a ``ValueError`` that names the stage or setting at fault and says what to do.
:func:`check_model` turns the model arguments into a :class:`Model`: one
:class:`~pipeq.stage.spec.StageSpec` per stage and replica, or the recipe that builds them in the
stage processes, asking the schedule (:class:`~pipeq.schedules.SchedulePolicy`) what it needs
and refuses. :func:`process_payloads` makes what each stage process is started with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
from torch import nn

from pipeq import schedules
from pipeq.control import ties as tied
from pipeq.control.main_guard import check_picklable, stage_pickle
from pipeq.checkpoint.names import positional
from pipeq.control.stage_inputs import check_declared
from pipeq.stage.spec import StageBuilder, StageSpec
from pipeq.schedules import SchedulePolicy
from pipeq.stage import lr_schedulers
from pipeq.stage.loss import loss_weight_mode
from pipeq.stage.lr_schedulers import LRSchedule
from pipeq.stage.numerics import Numerics
from pipeq.stage.tie_groups import refuse_ties

if TYPE_CHECKING:
    from pipeq.control.rendezvous import Rendezvous

__all__ = ["SCHEDULE_ONLY", "refuse_unknown", "Model", "check_model", "check_tensor_parallel", "process_payloads"]


#: The schedules' options by the names the schedule objects, job files and ``pipeq schedule``
#: give them (``distance``: ``Interlock("nwise", distance=d)``, ``{ name = "nwise", distance = d }``,
#: ``--distance d``): passed to the runner, they say where they belong.
SCHEDULE_ONLY = {
    "distance": "schedule=pipeq.schedules.Interlock('nwise', distance={value!r})",
    "warmup": "schedule=pipeq.schedules.AsyncOneFOneB(warmup={value!r})",
    "first_loss": "schedule=pipeq.schedules.AssociatedLearning(first_loss={value!r})",
    "inference_layer": "schedule=pipeq.schedules.AssociatedLearning(inference_layer={value!r})",
}


def refuse_unknown(kwargs: Mapping[str, Any]) -> None:
    """A schedule's option given to the runner says where it belongs; anything else is an
    unknown argument, as in Python."""
    for key, value in kwargs.items():
        if key in SCHEDULE_ONLY:
            raise ValueError(f"{key} is an option of the schedule, not of the runner: pass "
                             f"{SCHEDULE_ONLY[key].format(value=value)}")
        raise TypeError(f"PipelineRunner() got an unexpected keyword argument {key!r}")


@dataclass
class Model:
    """The checked model: stage specs per replica, or the recipe the stage processes build from."""

    n_stages: int
    n_replicas: int
    loss_fn: Callable  # weights the microbatches' losses (the recipe's, when one builds the stages)
    replicas: list[list[StageSpec]] = field(default_factory=list)  # empty when built remotely
    builder: StageBuilder | None = None
    aux_loss: Callable | None = None  # with auxiliary heads: weights their losses
    lr_schedule: LRSchedule = field(default_factory=LRSchedule)  # who steps the lr schedulers, and how
    ties: bool = False  # a stage holds tied weights (pipeq.control.ties), as far as this process knows


def check_model(
    stages: Any, loss_fn: Any, optimizer: Any, lr_scheduler: Any, schedule: SchedulePolicy, *,
    aux_heads: Sequence[nn.Module] | None, aux_loss: Any, data_parallel: int, mode: str,
    rendezvous: "Rendezvous | None", lr_scheduler_interval: str | None = None, ties: Any = None,
) -> Model:
    """The model arguments of :class:`~pipeq.PipelineRunner`, checked (see its docstring); ``ties``
    declared on the stages (:func:`pipeq.control.ties.apply_ties`)."""
    if isinstance(stages, StageBuilder):
        if aux_heads is not None or aux_loss is not None:
            raise ValueError("with a stage recipe, the auxiliary heads come from it: name them in the "
                             "recipe (aux_heads, aux_loss) and pass aux_heads=None")
        if lr_scheduler_interval is not None:
            raise ValueError("with a stage recipe, the scheduler and its interval come from it: set "
                             "lr_scheduler_interval in the recipe (job file) and pass lr_scheduler_interval=None")
        if ties is not None:
            raise ValueError("with a stage recipe, tied weights come from the stages it builds (their "
                             "pipeq.StageInfo, as pipeq.split makes them): pass ties=None")
        return _check_recipe(stages, loss_fn, optimizer, lr_scheduler, schedule, mode, data_parallel,
                             multi_host=rendezvous is not None)
    if rendezvous is not None:
        raise ValueError(
            "a multi-host run builds each stage on its own host from importable names: pass a job "
            "recipe (pipeq.Recipe, or use pipeq launch) instead of modules")
    copies = [tied.apply_ties(c, ties) for c in _replica_lists(stages, data_parallel)]
    stages = copies[0]
    refuse_ties(schedule, stages)
    n = len(stages)
    if loss_fn is None:
        loss_fn = schedule.default_loss()
    _check_factories(loss_fn, optimizer, lr_scheduler)
    lr_schedule = lr_schedulers.check(lr_scheduler_interval, lr_scheduler, optimizer)
    _check_heads(schedule, n, aux_heads, aux_loss)
    schedule.check_stages(stages)
    check_declared(stages, schedule)
    heads = list(aux_heads) + [None] if aux_heads is not None else [None] * n
    replicas = [[StageSpec(module, optimizer, loss_fn if schedule.computes_loss(k, n) else None, lr_scheduler,
                           heads[k], aux_loss if aux_heads is not None else None, lr_schedule.interval)
                 for k, module in enumerate(copy)] for copy in copies]
    return Model(n, data_parallel, loss_fn, replicas, None,
                 (aux_loss if aux_loss is not None else nn.CrossEntropyLoss()) if aux_heads is not None else None,
                 lr_schedule, tied.has_ties(stages))


def _check_factories(loss_fn: Any, optimizer: Any, lr_scheduler: Any) -> None:
    if not callable(loss_fn):
        raise ValueError("loss_fn must be callable as loss_fn(output, target)")
    loss_weight_mode(loss_fn)
    if not callable(optimizer):
        raise ValueError("optimizer must be a factory called with one stage's parameters, e.g. "
                         "functools.partial(torch.optim.SGD, lr=0.1)")
    if lr_scheduler is not None and not callable(lr_scheduler):
        raise ValueError("lr_scheduler must be a factory called with one stage's optimizer, e.g. "
                         "functools.partial(torch.optim.lr_scheduler.StepLR, step_size=10)")


def _check_recipe(builder: StageBuilder, loss_fn: Any, optimizer: Any, lr_scheduler: Any, schedule: SchedulePolicy,
                  mode: str, data_parallel: int, multi_host: bool = False) -> Model:
    """A job's recipe (pipeq launch, multi-host): the stage processes build the stages (and
    heads); the heads are built here too, to be checked. What the recipe leaves to the
    launching process (a measured balance) is decided here, once."""
    if loss_fn is not None or optimizer is not None or lr_scheduler is not None:
        raise ValueError("with a stage recipe, the loss, optimizer and scheduler come from it: "
                         "pass loss_fn=None, optimizer=None")
    builder = builder.prepared(multi_host).for_schedule(schedule)
    n = builder.count_stages()  # type: ignore[attr-defined]
    heads = builder.heads(n)  # type: ignore[attr-defined]
    aux_loss = builder.aux_loss_fn()  # type: ignore[attr-defined]
    _check_heads(schedule, n, heads, aux_loss, hint="name them in the job: aux_heads = 'pkg.module:heads', "
                 f"a function returning the {n - 1} heads")
    loss = builder.loss_fn()  # type: ignore[attr-defined]
    schedule.check_recipe(builder, n)
    if loss is None:
        loss = schedule.default_loss()
    if loss is None:
        raise ValueError(f"the recipe names no loss; schedule {schedule.name!r} needs "
                         "one (only Associated Learning's layers do without)")
    loss_weight_mode(loss)
    lr_schedule = lr_schedulers.check(getattr(builder, "lr_scheduler_interval", None),
                                      builder.scheduler_factory(),  # type: ignore[attr-defined]
                                      builder.optimizer_factory())  # type: ignore[attr-defined]
    weigh_aux = (aux_loss if aux_loss is not None else nn.CrossEntropyLoss()) if heads is not None else None
    if mode == "simulated":  # build them here, as the stage processes would
        specs = [builder.build(k, n) for k in range(n)]
        modules = [spec.module for spec in specs]
        refuse_ties(schedule, modules)
        return Model(n, 1, loss, [specs], aux_loss=weigh_aux, lr_schedule=lr_schedule,
                     ties=tied.has_ties(modules))
    return Model(n, data_parallel, loss, [], builder, weigh_aux, lr_schedule)


def _replica_lists(stages: Any, data_parallel: int) -> list[list[nn.Module]]:
    """Every replica's stage list: R given lists (checked alike), or the one list R times."""
    if (data_parallel > 1 and isinstance(stages, (list, tuple)) and stages
            and all(isinstance(s, (list, tuple)) for s in stages)):
        if len(stages) != data_parallel:
            raise ValueError(f"{len(stages)} replica stage lists for data_parallel={data_parallel}")
        copies = [list(s) for s in stages]
    else:
        copies = [stages] * data_parallel
    first = copies[0]
    if isinstance(first, nn.Module):
        raise ValueError(f"stages is one {type(first).__name__}: pass a list of nn.Module, one per pipeline "
                         "stage, or the whole nn.Sequential with balance=[layers per stage] (measured by "
                         "pipeq.balance(model, n_stages, sample))")
    if not isinstance(first, (list, tuple)) or not first:
        raise ValueError("stages must be a non-empty list of nn.Module, one per pipeline stage")
    for k, s in enumerate(first):
        if not isinstance(s, nn.Module):
            raise ValueError(f"stage {k} is a {type(s).__name__}, not an nn.Module")
    copies = [[positional(s) for s in copy] for copy in copies]
    shapes = [[{n: tuple(t.shape) for n, t in s.state_dict().items()} for s in copy] for copy in copies]
    for r in range(1, len(copies)):
        if shapes[r] != shapes[0]:
            raise ValueError(f"replica {r}'s stages differ from replica 0's (names or shapes)")
    return [list(c) for c in copies]



def _check_heads(schedule: SchedulePolicy, n: int, aux_heads: Any, aux_loss: Any, hint: str | None = None) -> None:
    """Heads only with a schedule that takes them, one per stage but the last; the schedule
    says when they are required. ``hint``: where the heads come from (default: the aux_heads argument)."""
    hint = hint or f"pass aux_heads=[head_0, ..., head_{n - 2}] (one per stage but the last)"
    if aux_heads is not None or aux_loss is not None:
        if not schedule.takes_aux_heads:
            raise ValueError(
                f"aux_heads/aux_loss train with the interlocking schedules ({', '.join(schedules.taking_aux_heads())}), "
                f"not with {schedule.name!r}")
        if aux_heads is None or len(aux_heads) != n - 1 or not all(isinstance(h, nn.Module) for h in aux_heads):
            raise ValueError(
                f"aux_heads must be a list of {n - 1} nn.Module (one per stage but the last, stage k's "
                f"head reading stage k's output), got {aux_heads!r}")
        if aux_loss is not None and not callable(aux_loss):
            raise ValueError("aux_loss must be callable as aux_loss(head_output, target)")
    if schedule.takes_aux_heads:
        schedule.check_heads(n, aux_heads, aux_loss, hint)


def check_tensor_parallel(model: Model, tensor_parallel: int, tp_plan: Any) -> list[Any] | None:
    """``tp_plan`` (see :mod:`pipeq.parallel.tensor`): each stage's plan, or None without tensor
    parallelism. Checked against the stages' modules when this process has them; a recipe's
    stages are built on the meta device to be checked (no memory, no data)."""
    if tensor_parallel == 1 and tp_plan is None:
        return None
    if tensor_parallel == 1:
        raise ValueError("tp_plan is given but tensor_parallel=1: pass tensor_parallel=T (the shards per "
                         "stage), or drop tp_plan")
    from pipeq.parallel import tensor as tensorpar

    stages: list[nn.Module] | None = None
    if model.replicas:
        stages = [spec.module for spec in model.replicas[0]]
    elif model.builder is not None:
        try:
            with torch.device("meta"):
                stages = [model.builder.build(k, model.n_stages).module for k in range(model.n_stages)]
        except Exception:  # a recipe that cannot build on meta: each stage process checks its own
            stages = None
    plans = tensorpar.check_plans(stages, tp_plan, tensor_parallel, model.n_stages)
    for k, plan in enumerate(plans):
        check_picklable(f"tp_plan[{k}]", plan)
    return plans


def process_payloads(model: Model, schedule: SchedulePolicy) -> list["bytes | StageBuilder"]:
    """What each stage process (replica r's stage k is process r * N + k) is started with: its
    pickled :class:`StageSpec`, or the recipe. Checks that everything pickles and that the stage
    processes can find what it names, naming what does not."""
    check_picklable("schedule", schedule)
    if model.builder is not None:  # what it made for stage k (prepared), stage k's process only
        builder = model.builder
        return [builder.for_stage(g % model.n_stages) for g in range(model.n_stages * model.n_replicas)]
    out: list[bytes | StageBuilder] = []
    for copy in model.replicas:
        for k, spec in enumerate(copy):
            for what, obj in (("stage %d (%s)" % (k, type(spec.module).__name__), spec.module),
                              ("loss_fn", spec.loss_fn), ("optimizer", spec.optimizer),
                              ("lr_scheduler", spec.lr_scheduler), (f"aux_heads[{k}]", spec.aux_head),
                              ("aux_loss", spec.aux_loss)):
                check_picklable(what, obj, by_value=True)
            out.append(stage_pickle(spec))
    return out
