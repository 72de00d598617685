"""Checking what a :class:`~pipeq.PipelineRunner` is given, before any process starts.

Every refusal is a ``ValueError`` that names the stage or setting at fault and says what to do.
:func:`check_model` turns the model arguments into a :class:`Model`: one
:class:`~pipeq.executors.StageSpec` per stage and replica, or the recipe that builds them in the
stage processes. :func:`check_run` checks the process settings; :func:`process_payloads` makes
what each stage process is started with.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import math
import os
import pickle
import sys
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
from torch import nn

from pipeq.stage import lr_schedulers
from pipeq.stage import numerics
from pipeq import schedules
from pipeq.errors import MainScriptError
from pipeq.runtime.executors import StageBuilder, StageSpec
from pipeq.stage.lr_schedulers import LRSchedule
from pipeq.stage.numerics import Numerics
from pipeq.stage.executor import loss_weight_mode
from pipeq.wire.security import SECURITY_MODES

if TYPE_CHECKING:
    from pipeq.control.rendezvous import Rendezvous

MODES = ("process", "simulated")
TRANSPORTS = ("ipc", "tcp")
START_METHODS = ("spawn", "forkserver")

#: Keyword arguments that used to be the runner's and are now options of a schedule object.
MOVED = {
    "interlock_distance": "schedule=pipeq.schedules.Interlock('nwise', distance={value!r})",
    "weight_stashing": "schedule=pipeq.schedules.AsyncOneFOneB(weight_stashing={value!r})",
    "al_first_loss": "schedule=pipeq.schedules.AssociatedLearning(first_loss={value!r})",
    "al_inference_layer": "schedule=pipeq.schedules.AssociatedLearning(inference_layer={value!r})",
}


#: The schedules' options by the names the schedule objects, job files and ``pipeq schedule``
#: give them (``distance``: ``Interlock("nwise", distance=d)``, ``{ name = "nwise", distance = d }``,
#: ``--distance d``): passed to the runner, they say where they belong.
SCHEDULE_ONLY = {
    "distance": "schedule=pipeq.schedules.Interlock('nwise', distance={value!r})",
    "warmup": "schedule=pipeq.schedules.AsyncOneFOneB(warmup={value!r})",
    "first_loss": MOVED["al_first_loss"],
    "inference_layer": MOVED["al_inference_layer"],
}


def refuse_moved(kwargs: Mapping[str, Any]) -> None:
    """A moved option, or a schedule's option given to the runner, says where it belongs;
    anything else is an unknown argument, as in Python."""
    for key, value in kwargs.items():
        if key in MOVED:
            raise ValueError(f"{key} is an option of the schedule now: pass {MOVED[key].format(value=value)}")
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


def check_model(
    stages: Any, loss_fn: Any, optimizer: Any, lr_scheduler: Any, schedule: Any, *,
    aux_heads: Sequence[nn.Module] | None, aux_loss: Any, data_parallel: int, mode: str,
    rendezvous: "Rendezvous | None", lr_scheduler_interval: str | None = None,
) -> Model:
    """The model arguments of :class:`~pipeq.PipelineRunner`, checked (see its docstring)."""
    name = schedules.schedule_name(schedule)
    if type(data_parallel) is not int or data_parallel < 1:
        raise ValueError(f"data_parallel must be a positive integer, got {data_parallel!r}")
    if data_parallel > 1:
        if mode != "process":
            raise ValueError("data_parallel > 1 runs R x N stage processes: use mode='process'")
        if isinstance(schedule, (schedules.AssociatedLearning, schedules.AsyncOneFOneB)):
            raise ValueError(
                f"schedule {name!r} updates after every microbatch; replicas would have to all-reduce "
                "every microbatch: data_parallel is not supported with it (use fill-drain, 1f1b or an "
                "interlocking schedule)")
    if isinstance(stages, StageBuilder):
        if aux_heads is not None or aux_loss is not None:
            raise ValueError("with a stage recipe, the auxiliary heads come from it: name them in the "
                             "recipe (aux_heads, aux_loss) and pass aux_heads=None")
        if lr_scheduler_interval is not None:
            raise ValueError("with a stage recipe, the scheduler and its interval come from it: set "
                             "lr_scheduler_interval in the recipe (job file) and pass lr_scheduler_interval=None")
        return _check_recipe(stages, loss_fn, optimizer, lr_scheduler, schedule, mode, data_parallel,
                             multi_host=rendezvous is not None)
    if rendezvous is not None:
        raise ValueError(
            "a multi-host run builds each stage on its own host from importable names: pass a job "
            "recipe (pipeq.job.Recipe, or use pipeq launch) instead of modules")
    copies = _replica_lists(stages, data_parallel)
    stages = copies[0]
    n = len(stages)
    is_al = isinstance(schedule, schedules.AssociatedLearning)
    if is_al and loss_fn is None:
        loss_fn = nn.MSELoss()  # the associated and autoencoder losses' criterion
    if not callable(loss_fn):
        raise ValueError("loss_fn must be callable as loss_fn(output, target)")
    loss_weight_mode(loss_fn)
    if not callable(optimizer):
        raise ValueError("optimizer must be a factory called with one stage's parameters, e.g. "
                         "functools.partial(torch.optim.SGD, lr=0.1)")
    if lr_scheduler is not None and not callable(lr_scheduler):
        raise ValueError("lr_scheduler must be a factory called with one stage's optimizer, e.g. "
                         "functools.partial(torch.optim.lr_scheduler.StepLR, step_size=10)")
    lr_schedule = lr_schedulers.check(lr_scheduler_interval, lr_scheduler, optimizer)
    _check_heads(schedule, n, aux_heads, aux_loss)
    if is_al:
        _check_al_layers(schedule, stages)
    _check_untied(stages)
    heads = list(aux_heads) + [None] if aux_heads is not None else [None] * n
    replicas = [[StageSpec(module, optimizer, loss_fn if is_al or k == n - 1 else None, lr_scheduler,
                           heads[k], aux_loss if aux_heads is not None else None, lr_schedule.interval)
                 for k, module in enumerate(copy)] for copy in copies]
    return Model(n, data_parallel, loss_fn, replicas, None,
                 (aux_loss if aux_loss is not None else nn.CrossEntropyLoss()) if aux_heads is not None else None,
                 lr_schedule)


def _check_recipe(builder: StageBuilder, loss_fn: Any, optimizer: Any, lr_scheduler: Any, schedule: Any,
                  mode: str, data_parallel: int, multi_host: bool = False) -> Model:
    """A job's recipe (pipeq launch, multi-host): the stage processes build the stages (and
    heads); the heads are built here too, to be checked. What the recipe leaves to the
    launching process (a measured balance) is decided here, once."""
    if loss_fn is not None or optimizer is not None or lr_scheduler is not None:
        raise ValueError("with a stage recipe, the loss, optimizer and scheduler come from it: "
                         "pass loss_fn=None, optimizer=None")
    builder = builder.prepared(multi_host)
    n = builder.count_stages()  # type: ignore[attr-defined]
    heads = builder.heads(n)  # type: ignore[attr-defined]
    aux_loss = builder.aux_loss_fn()  # type: ignore[attr-defined]
    _check_heads(schedule, n, heads, aux_loss, hint="name them in the job: aux_heads = 'pkg.module:heads', "
                 f"a function returning the {n - 1} heads")
    loss = builder.loss_fn()  # type: ignore[attr-defined]
    if isinstance(schedule, schedules.AssociatedLearning):
        _check_inference_layer(schedule, n)
        _check_al_recipe(builder, n)
        loss = loss if loss is not None else nn.MSELoss()  # the layers' local criterion
    elif loss is None:
        raise ValueError(f"the recipe names no loss; schedule {schedules.schedule_name(schedule)!r} needs "
                         "one (only Associated Learning's layers do without)")
    loss_weight_mode(loss)
    lr_schedule = lr_schedulers.check(getattr(builder, "lr_scheduler_interval", None),
                                      builder.scheduler_factory(),  # type: ignore[attr-defined]
                                      builder.optimizer_factory())  # type: ignore[attr-defined]
    weigh_aux = (aux_loss if aux_loss is not None else nn.CrossEntropyLoss()) if heads is not None else None
    if mode == "simulated":  # build them here, as the stage processes would
        return Model(n, 1, loss, [[builder.build(k, n) for k in range(n)]], aux_loss=weigh_aux,
                     lr_schedule=lr_schedule)
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
    shapes = [[{n: tuple(t.shape) for n, t in s.state_dict().items()} for s in copy] for copy in copies]
    for r in range(1, len(copies)):
        if shapes[r] != shapes[0]:
            raise ValueError(f"replica {r}'s stages differ from replica 0's (names or shapes)")
    return [list(c) for c in copies]


def _check_heads(schedule: Any, n: int, aux_heads: Any, aux_loss: Any, hint: str | None = None) -> None:
    """Heads only with interlocking, one per stage but the last; required when d < N-1.
    ``hint``: where the heads come from (default: the aux_heads argument)."""
    interlocking = isinstance(schedule, schedules.Interlock)
    hint = hint or f"pass aux_heads=[head_0, ..., head_{n - 2}] (one per stage but the last)"
    if aux_heads is not None or aux_loss is not None:
        if not interlocking:
            raise ValueError(
                f"aux_heads/aux_loss train with the interlocking schedules ({', '.join(schedules.INTERLOCK)}), "
                f"not with {schedules.schedule_name(schedule)!r}")
        if aux_heads is None or len(aux_heads) != n - 1 or not all(isinstance(h, nn.Module) for h in aux_heads):
            raise ValueError(
                f"aux_heads must be a list of {n - 1} nn.Module (one per stage but the last, stage k's "
                f"head reading stage k's output), got {aux_heads!r}")
        if aux_loss is not None and not callable(aux_loss):
            raise ValueError("aux_loss must be callable as aux_loss(head_output, target)")
    if interlocking and aux_heads is None and schedule.distance(n) < n - 1:
        raise ValueError(f"schedule {schedules.schedule_name(schedule)!r} trains with auxiliary heads: {hint}")


def _check_inference_layer(schedule: schedules.AssociatedLearning, n: int) -> None:
    if schedule.inference_layer is not None and schedule.inference_layer >= n:
        raise ValueError(f"AssociatedLearning(inference_layer={schedule.inference_layer}) but there are only "
                         f"{n} AL layers (stages 0..{n - 1})")


def _check_al_recipe(builder: StageBuilder, n: int) -> None:
    """Stage 0 is an AL layer (built here once: a wrong stages function fails before any process)."""
    from pipeq.research.al.executor import ALLayer

    first = builder.build_stage(0, n)  # type: ignore[attr-defined]
    if not isinstance(first, ALLayer):
        raise ValueError(f"schedule 'al' trains pipeq.al.ALLayer stages (f, b, g, h), but the recipe's stages "
                         f"({getattr(builder, 'stages', builder)}) give a {type(first).__name__}; build them with "
                         "pipeq.al.build_al")


def _check_al_layers(schedule: schedules.AssociatedLearning, stages: Sequence[nn.Module]) -> None:
    from pipeq.research.al.executor import ALLayer

    _check_inference_layer(schedule, len(stages))
    for k, st in enumerate(stages):
        if not isinstance(st, ALLayer):
            raise ValueError(f"stage {k} is a {type(st).__name__}: schedule 'al' trains pipeq.al.ALLayer "
                             "stages (f, b, g, h); build them with pipeq.al.build_al")


def _check_untied(stages: Sequence[nn.Module]) -> None:
    """Each stage process owns its tensors: a parameter shared by two stages would untie."""
    owner: dict[int, tuple[int, str]] = {}
    for k, s in enumerate(stages):
        for name, t in list(s.named_parameters()) + list(s.named_buffers()):
            first = owner.setdefault(id(t), (k, name))
            if first[0] != k:
                raise ValueError(
                    f"stage {k}'s {name!r} is the same tensor as stage {first[0]}'s {first[1]!r}; tensors "
                    "shared between stages (tied weights) would be trained apart, one copy per stage "
                    "process: keep them in one stage")


def check_run(
    n_stages: int, microbatches: int, *, mode: str, devices: Sequence[str] | None, threads_per_stage: Any,
    transport: str, start_method: str, queue_capacity: Any, trace: Any, heartbeat_interval: float,
    heartbeat_timeout: float, tcp_security: str = "encrypt", max_message_mb: Any = 256,
    step_timeout: Any = None, shm_slots: Any = 4,
) -> None:
    """The process settings of :class:`~pipeq.PipelineRunner` (see its docstring)."""
    if type(microbatches) is not int or microbatches < 1:
        raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if tcp_security not in SECURITY_MODES:
        raise ValueError(f"tcp_security must be one of {SECURITY_MODES}, got {tcp_security!r}")
    if type(max_message_mb) is not int or not 1 <= max_message_mb <= 1 << 20:
        raise ValueError(f"max_message_mb must be a whole number of MiB from 1 to 1048576, got {max_message_mb!r}")
    if type(shm_slots) is not int or not 0 <= shm_slots <= 64:
        raise ValueError(f"shm_slots must be a whole number from 0 (no shared memory) to 64, got {shm_slots!r}")
    if threads_per_stage is not None and (type(threads_per_stage) is not int or threads_per_stage < 1):
        raise ValueError(f"threads_per_stage must be a positive integer, got {threads_per_stage!r}")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
    if queue_capacity is not None and (type(queue_capacity) is not int or queue_capacity < microbatches):
        raise ValueError(
            f"queue_capacity={queue_capacity!r} is too small: a stage may hold every microbatch of a "
            f"step, so it must be an integer >= microbatches ({microbatches})")
    if devices is not None:
        if len(devices) != n_stages:
            raise ValueError(f"devices names {len(devices)} device(s) for {n_stages} stages")
        for k, d in enumerate(devices):
            try:
                dev = torch.device(d)
            except (RuntimeError, TypeError) as exc:
                raise ValueError(f"devices[{k}] = {d!r} is not a device: {exc}") from None
            if dev.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"devices[{k}] = {d!r}, but CUDA is not available here")
            if dev.type not in ("cpu", "cuda"):
                raise ValueError(f"devices[{k}] = {d!r}: pipeq runs stages on 'cpu' or 'cuda'")
    if trace is not None and (not isinstance(trace, (str, os.PathLike)) or mode != "process"):
        raise ValueError(
            f"trace={trace!r}: give a file path, in process mode (a simulated run has no timeline "
            "worth tracing: every stage runs in this one process)")
    if heartbeat_timeout <= heartbeat_interval:
        raise ValueError("heartbeat_timeout must be longer than heartbeat_interval")
    check_step_timeout(step_timeout, heartbeat_interval)


def check_numerics(schedule: Any, n_stages: int, devices: Sequence[str] | None, **given: Any) -> Numerics:
    """precision, clip_grad_norm, clip_norm_type, check_finite and recompute, checked (see
    :class:`~pipeq.PipelineRunner`): plain backprop's schedules only."""
    nm = numerics.check(given["precision"], given["clip_grad_norm"], given["clip_norm_type"],
                        given["check_finite"], given["recompute"], n_stages)
    if schedules.is_research(schedule) and nm != numerics.Numerics():
        used = [f.name for f in dataclasses.fields(nm) if getattr(nm, f.name) != getattr(numerics.Numerics(), f.name)]
        raise ValueError(
            f"{', '.join(used)}: schedule {schedules.schedule_name(schedule)!r} computes its own way (its "
            "own losses, updates or recomputation); these options run with fill-drain, 1F1B and your own "
            "schedule functions")
    numerics.check_device(nm, devices or (["cuda"] if torch.cuda.is_available() else ["cpu"]))
    return nm


def check_step_timeout(step_timeout: Any, heartbeat_interval: float = 1.0) -> None:
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


def check_tensor_parallel(model: Model, schedule: Any, tensor_parallel: Any, tp_plan: Any, *, mode: str,
                          numerics: Numerics) -> list[Any] | None:
    """``tensor_parallel`` and ``tp_plan`` (see :mod:`pipeq.tensorpar`): each stage's plan, or
    None without tensor parallelism. Checked against the stages' modules when this process has
    them; a recipe's stages are built on the meta device to be checked (no memory, no data)."""
    if tensor_parallel == 1 and tp_plan is None:
        return None
    if type(tensor_parallel) is not int or tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be a positive integer, got {tensor_parallel!r}")
    if tensor_parallel == 1:
        raise ValueError("tp_plan is given but tensor_parallel=1: pass tensor_parallel=T (the shards per "
                         "stage), or drop tp_plan")
    if mode != "process":
        raise ValueError(f"tensor_parallel={tensor_parallel} runs each stage on {tensor_parallel} processes: "
                         "use mode='process'")
    if isinstance(schedule, (schedules.Interlock, schedules.AsyncOneFOneB, schedules.AssociatedLearning)):
        raise ValueError(f"tensor_parallel is supported with fill-drain, 1f1b and your own schedules of F, B "
                         f"and STEP, not with {schedules.schedule_name(schedule)!r}")
    if numerics != Numerics(recompute=numerics.recompute) or any(numerics.recompute):
        raise ValueError("tensor_parallel does not support precision, clip_grad_norm, check_finite or "
                         "recompute yet: leave them at their defaults")
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
        _check_picklable(f"tp_plan[{k}]", plan)
    return plans


def process_payloads(model: Model, schedule: Any) -> list["bytes | StageBuilder"]:
    """What each stage process (replica r's stage k is process r * N + k) is started with: its
    pickled :class:`StageSpec`, or the recipe. Checks that everything pickles and that the stage
    processes can find what it names, naming what does not."""
    _check_picklable("schedule", schedule)
    if model.builder is not None:
        return [model.builder] * (model.n_stages * model.n_replicas)
    out: list[bytes | StageBuilder] = []
    for copy in model.replicas:
        for k, spec in enumerate(copy):
            for what, obj in (("stage %d (%s)" % (k, type(spec.module).__name__), spec.module),
                              ("loss_fn", spec.loss_fn), ("optimizer", spec.optimizer),
                              ("lr_scheduler", spec.lr_scheduler), (f"aux_heads[{k}]", spec.aux_head),
                              ("aux_loss", spec.aux_loss)):
                _check_picklable(what, obj)
            out.append(pickle.dumps(spec))
    return out


class _MainNames(pickle.Pickler):
    """Pickles, and notes the top-level names of ``__main__`` that the pickle refers to."""

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self.names: list[str] = []

    def reducer_override(self, obj: Any) -> Any:
        if (isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__"
                and obj.__qualname__.split(".")[0] not in self.names):
            self.names.append(obj.__qualname__.split(".")[0])
        return NotImplemented  # pickled as usual


def _check_picklable(what: str, obj: Any) -> None:
    pickler = _MainNames(io.BytesIO())
    try:
        pickler.dump(obj)
    except Exception as exc:
        raise ValueError(
            f"{what} cannot be pickled to start its stage process ({exc}); define classes and "
            "functions at module level (no lambdas or local classes), or use mode='simulated'"
        ) from exc
    if pickler.names:
        _check_main_names(what, pickler.names)


# -- the main script: what a stage process finds in it ---------------------------------------
# Both start methods (spawn, forkserver) start a stage by running the main script again as
# ``__mp_main__`` (without what is under its ``if __name__ == "__main__":``) and unpickle what
# refers to ``__main__`` from that; a package's ``__main__.py`` (python -m pkg) is not run again.

def main_script() -> "tuple[str, ast.Module] | None":
    """(path, parsed source) of the script stage processes run again at start; None when they
    run none (a package's ``__main__``, an interactive session, ``python -c``) or it cannot be read."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path or _package_main(main):
        return None
    try:
        with open(path, "rb") as f:
            return path, ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None


def _package_main(main: types.ModuleType) -> bool:
    name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    return name == "__main__" or name.endswith(".__main__")


def _guard(test: ast.expr) -> bool | None:
    """True for ``__name__ == "__main__"``, False for ``!=``, None for any other test."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], (ast.Eq, ast.NotEq))):
        return None
    left, right = test.left, test.comparators[0]

    def name(n: ast.expr) -> bool:
        return isinstance(n, ast.Name) and n.id == "__name__"

    def main(n: ast.expr) -> bool:
        return isinstance(n, ast.Constant) and n.value == "__main__"

    if not (name(left) and main(right) or main(left) and name(right)):
        return None
    return isinstance(test.ops[0], ast.Eq)


def _guarded_lines(tree: ast.Module) -> list[tuple[int, int]]:
    """The line ranges that run only when the script is ``__main__``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (eq := _guard(node.test)) is not None:
            block = node.body if eq else node.orelse
            if block:
                out.append((block[0].lineno, block[-1].end_lineno or block[-1].lineno))
    return out


def _bindings(stmts: list[ast.stmt], guarded: bool, into: tuple[set[str], set[str]]) -> None:
    """Names the statements bind at module level: into[0] outside the guard, into[1] under it."""
    for st in stmts:
        if isinstance(st, ast.If) and (eq := _guard(st.test)) is not None:
            _bindings(st.body, guarded or eq, into)
            _bindings(st.orelse, guarded or not eq, into)
            continue
        names = into[1] if guarded else into[0]
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(st.name)
            continue
        if isinstance(st, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in st.names)
            continue
        blocks = [getattr(st, f) for f in ("body", "orelse", "finalbody") if isinstance(getattr(st, f, None), list)]
        blocks += [h.body for h in getattr(st, "handlers", [])]
        for b in blocks:
            _bindings(b, guarded, into)
        names.update(h.name for h in getattr(st, "handlers", []) if h.name)
        heads = [v for f, v in ast.iter_fields(st) if f not in ("body", "orelse", "finalbody", "handlers")]
        for head in heads:
            for part in head if isinstance(head, list) else [head]:
                if isinstance(part, ast.AST):
                    names.update(n.id for n in ast.walk(part) if isinstance(n, ast.Name)
                                 and isinstance(n.ctx, ast.Store))


def _check_main_names(what: str, names: list[str]) -> None:
    """Refuse a stage (or loss, optimizer...) that a stage process could not unpickle: one that
    names a class or function of the main script defined under its ``__main__`` guard, or of a
    package's ``__main__.py``."""
    main = sys.modules.get("__main__")
    if main is not None and getattr(main, "__file__", None) and _package_main(main):
        raise MainScriptError(
            f"{what}: {names[0]} is defined in {main.__file__}; stage processes do not run a package's "
            "__main__.py again, so they cannot find it. Define it in another module of the package "
            "and import it from there")
    found = main_script()
    if found is None:
        return
    path, tree = found
    outside: set[str] = set()
    inside: set[str] = set()
    _bindings(tree.body, False, (outside, inside))
    for name in names:
        if name in inside and name not in outside:
            script = os.path.basename(path)
            raise MainScriptError(
                f"{what}: {name} is defined under 'if __name__ == \"__main__\":' in {script}; every "
                f"stage process runs {script} again without that block, so it cannot find {name}. Define "
                f"{name} at module level, above the guard (or in a module of its own)")


def check_main_guard() -> None:
    """Refuse to start stage processes from the top level of the main script outside an
    ``if __name__ == "__main__":`` block: each stage process runs the script again (``spawn``
    and ``forkserver`` both do), which would start the pipeline again from inside the stage."""
    found = main_script()
    if found is None:
        return
    path, tree = found
    main_globals = sys.modules["__main__"].__dict__
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_globals is main_globals and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None or os.path.realpath(frame.f_code.co_filename) != os.path.realpath(path):
        return  # not by the script's own top-level code (at exit, a REPL after python -i, exec)
    line = frame.f_lineno
    if any(first <= line <= last for first, last in _guarded_lines(tree)):
        return
    script = os.path.basename(path)
    raise MainScriptError(
        f"the pipeline is started at the top level of {script} (line {line}), outside an "
        f"'if __name__ == \"__main__\":' block. Every stage process runs {script} again when it "
        "starts (with either start method, 'spawn' or 'forkserver'), so each would start the "
        "pipeline again. Put the code that builds and runs the runner under "
        f"'if __name__ == \"__main__\":' (classes and functions the stages use stay above it)")
