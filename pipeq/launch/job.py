"""Job files: what ``pipeq launch JOB.toml`` trains, as importable names and settings.

A job file (TOML, read with the standard library's tomllib)::

    stages = "examples.digits_job:stages"        # () -> [stage modules], or (k, n) -> stage k
    n_stages = 3                                 # needed with the (k, n) form
    # or, instead of stages: one nn.Sequential split into stages (pipeq.balance)
    # model = "pkg.mod:model"                    # () -> nn.Sequential
    # balance = [3, 2, 1]                        # layers per stage; or "time" / "memory",
    # balance_sample = "pkg.mod:sample"          # measured on () -> the model's input, into
    #                                            # n_stages stages, once, when the run starts
    loss = "torch.nn:CrossEntropyLoss"           # a class, a zero-argument factory, or the loss
    optimizer = "torch.optim:SGD"                # called with a stage's parameters (+ the args)
    optimizer_args = { lr = 0.1, momentum = 0.9 }
    lr_scheduler = "torch.optim.lr_scheduler:StepLR"   # optional, called with the optimizer
    lr_scheduler_args = { step_size = 20, gamma = 0.5 }
    lr_scheduler_interval = "step"               # or "epoch": stepped between epochs (see below)
    lr_scheduler_monitor = "eval_loss"           # ReduceLROnPlateau's metric (default: eval_loss,
                                                 # or train_loss without eval_data)
    data = "examples.digits_job:train_batches"   # (epoch) -> iterable of (x, target) batches
    data_args = { batch = 32 }                   # keyword arguments of data (optional)
    eval_data = "examples.digits_job:heldout"    # optional: () -> (x, target) or batches
    metrics = { top3 = "examples.digits_job:top3" }   # eval metrics: (output, target) -> float
    schedule = "1f1b"                            # or a table with the schedule's options:
                                                 # { name = "nwise", distance = 2 }
                                                 # { name = "async", warmup = 3, weight_stashing = false }
                                                 # { name = "al", first_loss = "mse", inference_layer = 1 }
    aux_heads = "pkg.mod:heads"                  # interlocking: () -> the N-1 auxiliary heads
    aux_loss = "torch.nn:CrossEntropyLoss"       # their loss (optional, this is the default)
    microbatches = 4
    steps = 60                                   # or epochs = 3 (one of them: see LENGTH_RULE)
    out = "runs/digits"
    checkpoint_every = 20                        # 0: only the final state
    keep_checkpoints = 3                         # the newest 3 (0: keep all)
    seed = 0
    data_parallel = 1                            # R replicas of the pipeline (R x N processes)
    tensor_parallel = 1                          # optional: T processes per stage (R x N x T), with
    tp_plan = [{ "0" = "colwise", "2" = "rowwise" }, {}]   # one table per stage (pipeq.tensorpar)
    precision = "bf16"                           # optional: "fp32" (default), "bf16", "fp16"
    clip_grad_norm = 1.0                         # optional: clip by the global norm (clip_norm_type = 2.0)
    check_finite = "raise"                       # optional: false (default), "raise" (or true), "skip"
    recompute = true                             # optional: or one boolean per stage
    [placement]                                  # optional, multi-host: processes per node
    nodes = [[0], [1, 2]]                        # (process r * n_stages + k: replica r's stage k)

Every factory the job names takes keyword arguments from its ``*_args`` table: ``stages_args``,
``loss_args``, ``optimizer_args``, ``lr_scheduler_args``, ``data_args``, ``eval_data_args``,
``aux_heads_args``, ``aux_loss_args`` (plain TOML tables; an argument the factory does not take
is refused, naming both). With ``lr_scheduler_interval = "epoch"``, ``pipeq launch`` steps the
schedulers between two epochs (an epoch is one pass over the iterable ``data(epoch)`` returns,
also when the job counts ``steps``), a ReduceLROnPlateau with its ``lr_scheduler_monitor``.

Stage processes build their stage from these names themselves (``Recipe.build``), on whichever
host they run: nothing but plain data crosses hosts, and every host builds the same weights
(the stages and heads functions run under ``torch.manual_seed(seed)``). With Associated
Learning (``schedule = "al"``) the stages function returns ``pipeq.al.ALLayer`` s (e.g. from
``pipeq.al.build_al``) and ``loss`` (optional, MSE by default) is the layers' local criterion.

With ``model`` and ``balance``, stage k is ``pipeq.balance.split(model(), counts)[k]``, the model
built under the job's seed. A measured balance (``"time"``, ``"memory"``) is measured once, in
the launching process (:meth:`Recipe.prepared`): the stage processes receive the counts as plain
data in the recipe, and :meth:`Recipe.describe` shows them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import importlib
import inspect
import os
import sys
import tomllib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from pipeq import balance as balancing
from pipeq import schedules
from pipeq.research.al.executor import ALLayer
from pipeq.stage.spec import StageBuilder, StageSpec
from pipeq.tree import as_args


def resolve(spec: str, key: str) -> Any:
    """The object named by ``"package.module:attribute"`` (``key`` names the setting in errors)."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"{key} = {spec!r}: expected 'package.module:name', e.g. 'torch.optim:SGD'")
    mod_name, attr = spec.split(":")
    try:
        obj: Any = importlib.import_module(mod_name)
    except Exception as exc:
        raise ValueError(f"{key} = {spec!r}: cannot import {mod_name!r} ({type(exc).__name__}: {exc})") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{key} = {spec!r}: module {mod_name!r} has no {attr!r}") from None
    return obj


def _required_positional(fn: Callable, given: Iterable[str] = ()) -> int:
    """How many positional arguments ``fn`` needs beyond the keywords ``given`` (its job's
    ``*_args``); -1 when it has no signature to read."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return -1
    given = set(given)
    return sum(1 for p in params if p.default is p.empty and p.name not in given
               and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def check_args(fn: Callable, args: Mapping[str, Any], key: str, spec: str) -> None:
    """The job's ``{key}_args`` are keyword arguments ``fn`` (named ``{key} = spec``) accepts: a
    ``ValueError`` names the key, the factory and the arguments it does not take. (A callable
    without a readable signature, or one taking ``**kwargs``, is left to the call.)"""
    if not args:
        return
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    takes = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [a for a in args if a not in takes]
    if unknown:
        close = did_you_mean(unknown, takes, "it takes") if takes else "it takes no keyword arguments"
        raise ValueError(f"{key}_args: {key} = {spec!r} does not take the argument(s) {unknown}; {close}")


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Build under ``torch.manual_seed(seed)`` (the same weights on every host), and leave the
    caller's RNG as it was (a stage process keeps its own stream, for dropout)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _make_loss(spec: str, key: str, args: Mapping[str, Any] | None = None) -> Callable:
    """A loss named by ``spec``: a class (instantiated with ``args``), a factory taking no
    positional argument (called with ``args``), or the loss itself (a loss function with
    ``args`` bound as keywords, as ``functools.partial`` does)."""
    obj = resolve(spec, key)
    args = dict(args or {})
    if isinstance(obj, type) or (not isinstance(obj, nn.Module) and callable(obj)
                                 and _required_positional(obj, args) == 0):
        check_args(obj, args, key, spec)
        return obj(**args)  # a class, or a factory
    if not callable(obj):
        raise ValueError(f"{key} = {spec!r} is not callable")
    if not args:
        return obj
    if isinstance(obj, nn.Module):
        raise ValueError(f"{key}_args: {key} = {spec!r} is a loss module already built; name its class "
                         "(e.g. 'torch.nn:CrossEntropyLoss') to pass it arguments")
    check_args(obj, args, key, spec)
    bound = functools.partial(obj, **args)
    if "reduction" in args:  # how pipeq weights the microbatches' losses (pipeq.stage.loss_weight_mode)
        bound.reduction = args["reduction"]  # type: ignore[attr-defined]
    return bound


@dataclass
class Recipe(StageBuilder):
    """How a stage process builds its part of a job (plain strings: picklable, host-independent)."""

    stages: str | None  # None: the stages are model split by balance
    loss: str | None  # None: no end-to-end loss (Associated Learning's layers default to MSE)
    optimizer: str
    optimizer_args: dict[str, Any] = field(default_factory=dict)
    lr_scheduler: str | None = None
    lr_scheduler_args: dict[str, Any] = field(default_factory=dict)
    n_stages: int | None = None
    seed: int = 0
    aux_heads: str | None = None  # interlocking: () or (n_stages) -> the N-1 auxiliary heads
    aux_loss: str | None = None  # their loss (None: the executors' default, cross-entropy)
    # keyword arguments of the named factories (plain TOML tables), and who steps the scheduler
    stages_args: dict[str, Any] = field(default_factory=dict)
    loss_args: dict[str, Any] = field(default_factory=dict)
    aux_heads_args: dict[str, Any] = field(default_factory=dict)
    aux_loss_args: dict[str, Any] = field(default_factory=dict)
    lr_scheduler_interval: str | None = None  # None: "step" (pipeq.lr_schedulers)
    model: str | None = None  # () -> an nn.Sequential, split into stages by balance
    balance: list[int] | str | None = None  # layers per stage; "time" / "memory": measured (prepared)
    balance_sample: str | None = None  # () -> the model's input, to measure on
    model_args: dict[str, Any] = field(default_factory=dict)
    balance_sample_args: dict[str, Any] = field(default_factory=dict)
    sys_path: list[str] = field(default_factory=list)

    def _imports(self) -> None:
        """Make the job's modules importable: its folders go *after* everything already on
        sys.path, so installed packages win (a ``pipeq/`` source checkout beside the job file,
        of another version, must not shadow the pipeq running it, here or in a stage process)."""
        for p in self.sys_path:
            if p not in sys.path:
                sys.path.append(p)

    def count_stages(self) -> int:
        """N: the job's ``n_stages``, or the length of the list its stages function returns (or
        of its balance)."""
        if self.model is not None:
            counts = self._counts()
            if self.n_stages is not None and self.n_stages != len(counts):
                raise ValueError(f"n_stages = {self.n_stages}, but balance = {counts} makes {len(counts)} stages")
            return len(counts)
        fn = self._stages_fn()
        if _required_positional(fn, self.stages_args) == 2:
            if self.n_stages is None:
                raise ValueError(f"stages = {self.stages!r} builds stage k of n: the job must set n_stages")
            return self.n_stages
        n = len(self._all_stages(fn))
        if self.n_stages is not None and self.n_stages != n:
            raise ValueError(f"n_stages = {self.n_stages}, but {self.stages} returns {n} stages")
        return n

    def _stages_fn(self) -> Callable:
        """The stages function, its ``stages_args`` checked."""
        self._imports()
        fn = resolve(self.stages, "stages")
        check_args(fn, self.stages_args, "stages", self.stages)
        return fn

    def _all_stages(self, fn: Callable) -> list[nn.Module]:
        args = self.stages_args
        with _seeded(self.seed):
            stages = fn(**args) if _required_positional(fn, args) == 0 else fn(self.n_stages, **args)
        if not isinstance(stages, (list, tuple)) or not all(isinstance(s, nn.Module) for s in stages):
            raise ValueError(f"stages = {self.stages!r} must return a list of nn.Module")
        return list(stages)

    def build_stage(self, k: int, n: int) -> nn.Module:
        if self.model is not None:
            counts = self._counts()
            if len(counts) != n:
                raise ValueError(f"balance = {counts} makes {len(counts)} stages, the run has {n}")
            return balancing.split(self._model(), counts)[k]
        fn = self._stages_fn()
        if _required_positional(fn, self.stages_args) == 2:
            with _seeded(self.seed + k):
                module = fn(k, n, **self.stages_args)
        else:
            stages = self._all_stages(fn)
            if len(stages) != n:
                raise ValueError(f"{self.stages} returned {len(stages)} stages, the run has {n}")
            module = stages[k]
        if not isinstance(module, nn.Module):
            raise ValueError(f"stages = {self.stages!r} gave stage {k} as a {type(module).__name__}")
        return module

    # -- one nn.Sequential split into stages (model + balance) ------------------------------
    def prepared(self, multi_host: bool = False) -> "Recipe":
        """This recipe with its balance as layer counts, checked against the model: measured
        here (``balance = "time"`` / ``"memory"``), once, so every stage process gets the same
        counts. Without ``model`` it is this recipe."""
        if self.model is None:
            return self
        if isinstance(self.balance, str):
            if multi_host:
                raise ValueError(_MEASURED_ON_ONE_NODE.format(by=self.balance))
            return dataclasses.replace(self, balance=self._measure(self.balance))
        balancing.check_counts(self._counts(), len(self._model()))  # here, not in a stage process
        return self

    def _counts(self) -> list[int]:
        if isinstance(self.balance, str):
            raise ValueError(_MEASURED_ON_ONE_NODE.format(by=self.balance))
        if not self.balance:
            raise ValueError(f"model = {self.model!r} needs balance: layer counts per stage, or 'time' / 'memory'")
        return list(self.balance)

    def _model(self) -> nn.Sequential:
        """The job's model, built under its seed (the same weights in every process)."""
        self._imports()
        fn = resolve(self.model, "model")
        if not callable(fn) or _required_positional(fn, self.model_args) > 0:
            raise ValueError(f"model = {self.model!r} must be a function returning an nn.Sequential, called with "
                             "model_args (none by default)")
        check_args(fn, self.model_args, "model", self.model)
        with _seeded(self.seed):
            model = fn(**self.model_args)
        balancing.layers_of(model, f"the model of model = {self.model!r}")
        return model

    def _measure(self, by: str) -> list[int]:
        """Layer counts balanced by ``by`` over ``n_stages`` stages, measured on the sample."""
        if self.n_stages is None or self.balance_sample is None:
            raise ValueError(f"balance = {by!r} measures the layers on balance_sample and splits them into "
                             "n_stages stages: set both")
        self._imports()
        got = resolve(self.balance_sample, "balance_sample")
        if callable(got):
            check_args(got, self.balance_sample_args, "balance_sample", self.balance_sample)
        with _seeded(self.seed):
            sample = got(**self.balance_sample_args) if callable(got) else got
        if not (isinstance(sample, torch.Tensor)
                or isinstance(sample, tuple) and sample and all(isinstance(t, torch.Tensor) for t in sample)):
            raise ValueError(f"balance_sample = {self.balance_sample!r} must give the model's input (a tensor or a "
                             f"tuple of tensors; not an (x, target) pair of a batch), got {type(sample).__name__}")
        return balancing.balance(self._model(), self.n_stages, sample, by=by)

    def heads(self, n_stages: int) -> list[nn.Module] | None:
        """The auxiliary heads (one per stage but the last), or None when the job has none. Built
        like the stages, under the job's seed: every host builds the same ones."""
        if self.aux_heads is None:
            return None
        self._imports()
        fn = resolve(self.aux_heads, "aux_heads")
        args = self.aux_heads_args
        check_args(fn, args, "aux_heads", self.aux_heads)
        with _seeded(self.seed):
            heads = fn(**args) if _required_positional(fn, args) == 0 else fn(n_stages, **args)
        if (not isinstance(heads, (list, tuple)) or len(heads) != n_stages - 1
                or not all(isinstance(h, nn.Module) for h in heads)):
            raise ValueError(f"aux_heads = {self.aux_heads!r} must return a list of {n_stages - 1} nn.Module "
                             f"(one per stage but the last), got {heads!r}")
        return list(heads)

    def loss_fn(self) -> Callable | None:
        self._imports()
        return _make_loss(self.loss, "loss", self.loss_args) if self.loss is not None else None

    def aux_loss_fn(self) -> Callable | None:
        self._imports()
        return _make_loss(self.aux_loss, "aux_loss", self.aux_loss_args) if self.aux_loss is not None else None

    def optimizer_factory(self) -> Callable:
        self._imports()
        fn = resolve(self.optimizer, "optimizer")
        check_args(fn, self.optimizer_args, "optimizer", self.optimizer)
        return functools.partial(fn, **self.optimizer_args) if self.optimizer_args else fn

    def scheduler_factory(self) -> Callable | None:
        if self.lr_scheduler is None:
            return None
        self._imports()
        fn = resolve(self.lr_scheduler, "lr_scheduler")
        check_args(fn, self.lr_scheduler_args, "lr_scheduler", self.lr_scheduler)
        return functools.partial(fn, **self.lr_scheduler_args) if self.lr_scheduler_args else fn

    def build(self, stage: int, n_stages: int) -> StageSpec:
        """Stage ``stage``'s spec: the loss on the last stage (on every AL layer: their local
        criterion), and with auxiliary heads stage k's head and their loss."""
        module = self.build_stage(stage, n_stages)
        local = isinstance(module, ALLayer)
        loss = self.loss_fn() if local or stage == n_stages - 1 else None
        heads = self.heads(n_stages)
        head = heads[stage] if heads is not None and stage < n_stages - 1 else None
        aux_loss = self.aux_loss_fn() if heads is not None else None
        return StageSpec(module, self.optimizer_factory(), loss, self.scheduler_factory(), head, aux_loss,
                         self.lr_scheduler_interval or "step")

    def seed_for(self, stage: int) -> int:
        return self.seed * 1009 + stage + 1

    def describe(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "sys_path"}


_MEASURED_ON_ONE_NODE = (
    "balance = {by!r} is measured once, by the launching process (node 0), when the run starts, and "
    "the other nodes of a multi-host run build from their own job file: write the counts into the job "
    "instead (balance = [3, 2, 1]; pipeq.balance(model, n_stages, sample, by={by!r}) measures them)")


@dataclass
class Job:
    recipe: Recipe
    data: str
    eval_data: str | None = None
    schedule: "str | schedules.ScheduleFn" = "1f1b"  # a name, or a schedule object with its options
    microbatches: int = 8
    steps: int | None = None
    epochs: int | None = None
    out: str = "pipeq-run"
    checkpoint_every: int = 0
    keep_checkpoints: int = 0
    eval_every: int = 0
    log_every: int = 10
    placement: list[list[int]] | None = None
    threads_per_stage: int | None = None
    heartbeat_timeout: float = 15.0
    step_timeout: float | None = 300.0  # seconds one compute action may take; 0 in a job file: off
    start_timeout: float = 120.0
    trace: str | None = None
    data_parallel: int = 1
    tensor_parallel: int = 1  # shards per stage (PipelineRunner's tensor_parallel, pipeq.tensorpar)
    tp_plan: list[dict[str, str]] | None = None  # one table per stage: submodule -> "colwise" / "rowwise"
    tcp_security: str = "encrypt"  # multi-host: "encrypt" or "authenticate" (pipeq.wire.security)
    max_message_mb: int = 256
    shm_slots: int = 4  # one host: shared-memory slots per data channel (PipelineRunner's shm_slots)
    data_args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of data(epoch)
    eval_data_args: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)  # name -> "pkg.mod:fn", (output, target) -> float
    lr_scheduler_monitor: str | None = None  # what a ReduceLROnPlateau is fed (see monitor())
    # how the stages compute (pipeq.numerics; PipelineRunner's arguments of the same names)
    precision: str = "fp32"
    clip_grad_norm: float | None = None
    clip_norm_type: float = 2.0
    check_finite: bool | str = False
    recompute: bool | list[bool] = False
    path: str = ""

    def data_fn(self) -> Callable[..., Iterable]:
        self.recipe._imports()
        fn = resolve(self.data, "data")
        check_args(fn, self.data_args, "data", self.data)
        return fn

    def batches(self, epoch: int) -> Iterable:
        fn = self.data_fn()
        args = self.data_args
        return fn(epoch, **args) if _required_positional(fn, args) >= 1 else fn(**args)

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
        got = self._eval_source()
        if got is None:
            return None
        got = got(**self.eval_data_args) if callable(got) else got
        if isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], torch.Tensor):
            return [got]
        return list(got)

    def metric_fns(self) -> dict[str, Callable]:
        """The job's evaluation metrics, by name (see :mod:`pipeq.evaluation`)."""
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

    def numerics_args(self) -> dict[str, Any]:
        """The runner's precision, clipping, check_finite and recompute arguments."""
        return {"precision": self.precision, "clip_grad_norm": self.clip_grad_norm,
                "clip_norm_type": self.clip_norm_type, "check_finite": self.check_finite,
                "recompute": self.recompute}

    def check(self) -> None:
        """Resolve what the driver calls (data, eval_data, metrics) and check their arguments,
        before any stage process starts: a ``ValueError`` names the key."""
        self.data_fn()
        self._eval_source()
        self.metric_fns()



#: The options a job file's schedule table may set, per schedule name (the others take none).
SCHEDULE_OPTIONS: dict[str, tuple[str, ...]] = {
    **{name: () for name in schedules.SCHEDULES},
    "nwise": ("distance",),
    "async": ("warmup", "weight_stashing"),
    "al": ("first_loss", "inference_layer"),
}


def parse_schedule(value: "str | Mapping[str, Any]") -> "str | schedules.ScheduleFn":
    """A job file's ``schedule``: a name (``"pairwise"``), or a table of the name and the
    schedule's options (``{ name = "nwise", distance = 2 }``), as the runner takes it."""
    options = {"name": value} if isinstance(value, str) else dict(value)
    name = options.pop("name", None)
    if not isinstance(name, str) or name not in SCHEDULE_OPTIONS:
        what = "a table without a name" if name is None else f"unknown name {name!r}"
        close = difflib.get_close_matches(name, list(SCHEDULE_OPTIONS), n=1) if isinstance(name, str) else []
        raise ValueError(f"schedule: {what}; " + (f"did you mean {close[0]!r}? " if close else "")
                         + f"choose one of {', '.join(sorted(SCHEDULE_OPTIONS))}, "
                         'e.g. schedule = "1f1b" or schedule = { name = "nwise", distance = 2 }')
    allowed = SCHEDULE_OPTIONS[name]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"schedule {name!r}: unknown option(s) {unknown}; "
                         + (did_you_mean(unknown, allowed, "allowed") if allowed else "it takes none"))
    if name == "nwise" and "distance" not in options:
        raise ValueError('schedule "nwise" needs its distance: schedule = { name = "nwise", distance = 2 }')
    if not options:
        return name
    if name in schedules.INTERLOCK:
        return schedules.Interlock(name, **options)
    if name == "async":
        return schedules.AsyncOneFOneB(**options)
    return schedules.AssociatedLearning(**options)


# key -> (type(s), where it goes); types are checked so a typo or a wrong value fails loudly
_RECIPE_KEYS = {
    "stages": str, "loss": str, "optimizer": str, "optimizer_args": dict, "lr_scheduler": str,
    "lr_scheduler_args": dict, "n_stages": int, "seed": int, "aux_heads": str, "aux_loss": str,
    "stages_args": dict, "loss_args": dict, "aux_heads_args": dict, "aux_loss_args": dict,
    "lr_scheduler_interval": str,
    "model": str, "balance": (list, str), "balance_sample": str, "model_args": dict, "balance_sample_args": dict,
}
_JOB_KEYS = {
    "data": str, "eval_data": str, "schedule": (str, dict), "microbatches": int, "steps": int, "epochs": int,
    "out": str, "checkpoint_every": int, "keep_checkpoints": int, "eval_every": int,
    "log_every": int, "placement": dict,
    "threads_per_stage": int, "heartbeat_timeout": (int, float), "start_timeout": (int, float),
    "step_timeout": (int, float),
    "trace": str, "data_parallel": int, "tensor_parallel": int, "tp_plan": list, "tcp_security": str, "max_message_mb": int, "shm_slots": int,
    "data_args": dict, "eval_data_args": dict, "metrics": dict, "lr_scheduler_monitor": str,
    "precision": str, "clip_grad_norm": (int, float), "clip_norm_type": (int, float), "check_finite": (bool, str),
    "recompute": (bool, list),
}
#: a factory's arguments -> the key naming the factory
_ARGS_OF = {f"{key}_args": key for key in ("stages", "loss", "optimizer", "lr_scheduler", "aux_heads",
                                           "aux_loss", "data", "eval_data", "model", "balance_sample")}
#: what a TOML value of each type is called, with its article
_TOML_TYPES = {str: "a string", int: "an integer", float: "a float", dict: "a table", list: "an array",
               bool: "a boolean"}
_REQUIRED = ("stages", "optimizer", "data")  # and loss, but with Associated Learning


def did_you_mean(wrong: Iterable[str], known: Iterable[str], what: str) -> str:
    """``did you mean 'x'?`` for names close to a known one, else the known names."""
    known = sorted(known)
    close = {w: difflib.get_close_matches(w, known, n=1) for w in wrong}
    if all(close.values()):
        return "did you mean " + ", ".join(repr(c[0]) for c in close.values()) + "?"
    return f"{what}: {known}"


def load_job(path: str, overrides: Mapping[str, Any] | None = None) -> Job:
    """Read ``path`` and apply ``overrides`` (command-line flags; None values are ignored)."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"job file {path!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"job file {path}: {exc}") from None
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    _check_length(path, raw, given)
    if "steps" in given or "epochs" in given:  # the command line's length replaces the file's
        raw.pop("steps", None)
        raw.pop("epochs", None)
    raw.update(given)
    known = {**_RECIPE_KEYS, **_JOB_KEYS}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"job file {path}: unknown key(s) {unknown}; {did_you_mean(unknown, known, 'known keys')}")
    for key, types in known.items():
        allowed = as_args(types)  # one type or a tuple of them, as isinstance takes them
        takes_bool = bool in allowed
        if key in raw and (not isinstance(raw[key], types) or isinstance(raw[key], bool) and not takes_bool):
            want = " or ".join(_TOML_TYPES[t] for t in allowed)
            raise ValueError(f"job file {path}: {key} must be {want}, got {raw[key]!r}")
    try:
        raw["schedule"] = parse_schedule(raw.get("schedule", "1f1b"))
    except ValueError as exc:
        raise ValueError(f"job file {path}: {exc}") from None
    _check_model_keys(path, raw)
    _check_schedule_keys(path, raw)
    _check_factory_keys(path, raw)
    _check_tp_plan(path, raw)
    for key in ("microbatches", "steps", "epochs", "n_stages", "threads_per_stage", "data_parallel",
                "tensor_parallel"):
        if key in raw and raw[key] < 1:
            raise ValueError(f"job file {path}: {key} must be at least 1, got {raw[key]}")
    for key in ("checkpoint_every", "keep_checkpoints", "eval_every", "log_every"):
        if key in raw and raw[key] < 0:
            raise ValueError(f"job file {path}: {key} must be 0 or more, got {raw[key]}")
    if "steps" not in raw and "epochs" not in raw:
        raise ValueError(f"job file {path}: set steps or epochs (or pass --steps / --epochs)")
    placement = raw.pop("placement", None)
    nodes = None
    if placement is not None:
        nodes = placement.get("nodes")
        if not isinstance(nodes, list) or not all(
            isinstance(n, list) and all(type(k) is int for k in n) for n in nodes
        ):
            raise ValueError(f"job file {path}: [placement] nodes must be a list of lists of stage indices")
    base = os.path.dirname(os.path.abspath(path))
    # the job's own directory and the current one: "examples.digits_job:stages" from the repo root
    sys_path = [os.getcwd(), base] + ([os.path.dirname(base)] if base != os.getcwd() else [])
    recipe = Recipe(**{"loss": None, "stages": None, **{k: raw.pop(k) for k in list(raw) if k in _RECIPE_KEYS}},
                    sys_path=sys_path)
    job = Job(recipe=recipe, placement=nodes, path=os.path.abspath(path), **raw)
    return job


#: How long a job trains, as ``pipeq launch --help`` and the README state it.
LENGTH_RULE = ("a job trains for steps or for epochs, never both: set one of them in the job file; "
               "--steps or --epochs on the command line replaces whichever the file sets")


def _check_tp_plan(path: str, raw: Mapping[str, Any]) -> None:
    """``tp_plan``: an array of one table per stage, submodule names to "colwise" / "rowwise"."""
    plan = raw.get("tp_plan")
    if plan is None:
        return
    for k, stage in enumerate(plan):
        if not isinstance(stage, dict) or not all(isinstance(v, str) for v in stage.values()):
            raise ValueError(f"job file {path}: tp_plan[{k}] must be a table of submodule names to "
                             f"\"colwise\" or \"rowwise\" (e.g. {{ \"0\" = \"colwise\", \"2\" = \"rowwise\" }}), "
                             f"got {stage!r}")


def _check_length(path: str, raw: Mapping[str, Any], given: Mapping[str, Any]) -> None:
    """The job's length: ``steps`` or ``epochs``, one of them (see :data:`LENGTH_RULE`); a flag
    replaces both of the file's keys, so only a file read as it is must not set both."""
    if "steps" in given and "epochs" in given:
        raise ValueError(f"--steps {given['steps']} and --epochs {given['epochs']}: give one of them "
                         f"({LENGTH_RULE})")
    if "steps" in raw and "epochs" in raw and not ("steps" in given or "epochs" in given):
        raise ValueError(f"job file {path}: sets both steps = {raw['steps']!r} and epochs = {raw['epochs']!r}; "
                         f"keep one of them ({LENGTH_RULE})")


def _check_schedule_keys(path: str, raw: Mapping[str, Any]) -> None:
    """The keys the job's schedule needs or refuses: a loss (but with Associated Learning),
    auxiliary heads only with an interlocking schedule."""
    schedule = schedules.resolve(raw["schedule"])
    al = isinstance(schedule, schedules.AssociatedLearning)
    missing = [k for k in _REQUIRED if k not in raw and not (k == "stages" and "model" in raw)]
    missing += ["loss"] if "loss" not in raw and not al else []
    if missing:
        raise ValueError(f"job file {path}: missing required key(s) {missing}")
    for key in ("aux_heads", "aux_loss"):
        if key in raw and not isinstance(schedule, schedules.Interlock):
            raise ValueError(f"job file {path}: {key} trains with the interlocking schedules "
                             f"({', '.join(schedules.INTERLOCK)}), not with {schedules.schedule_name(schedule)!r}")


def _check_plain(value: Any, where: str) -> None:
    """A TOML value that is plain data (strings, numbers, booleans, arrays, tables): what a
    recipe may carry to other hosts. TOML's dates and times are refused."""
    if isinstance(value, dict):
        for k, v in value.items():
            _check_plain(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
    elif not isinstance(value, (str, int, float, bool)):
        raise ValueError(f"{where} = {value!r}: a factory's arguments are strings, numbers, booleans, arrays "
                         f"and tables, not a {type(value).__name__}")


def _check_factory_keys(path: str, raw: Mapping[str, Any]) -> None:
    """The keys that go with a factory key: its ``*_args`` (plain data), the scheduler's interval
    and monitor, the evaluation's metrics; each refused without what it belongs to."""
    for args_key, key in _ARGS_OF.items():
        if args_key in raw:
            if key not in raw:
                raise ValueError(f"job file {path}: {args_key} is given, but {key} is not: {args_key} are the "
                                 f"keyword arguments of the factory {key} names; set {key} or drop {args_key}")
            _check_plain(raw[args_key], args_key)
    for key in ("lr_scheduler_interval", "lr_scheduler_monitor"):
        if key in raw and "lr_scheduler" not in raw:
            raise ValueError(f"job file {path}: {key} is given, but there is no lr_scheduler to step; set "
                             f"lr_scheduler or drop {key}")
    from pipeq.stage.lr_schedulers import INTERVALS

    interval = raw.get("lr_scheduler_interval")
    if interval is not None and interval not in INTERVALS:
        raise ValueError(f"job file {path}: lr_scheduler_interval = {interval!r}; use \"step\" (the stages step "
                         'the scheduler after every optimizer step) or "epoch" (pipeq launch steps it after each '
                         "pass over the data)")
    metrics = raw.get("metrics", {})
    for name, spec in metrics.items():
        if not isinstance(spec, str) or spec.count(":") != 1:
            raise ValueError(f"job file {path}: metrics.{name} = {spec!r}: expected 'package.module:name' of a "
                             "function (output, target) -> float, e.g. metrics = { top3 = \"mymod:top3\" }")
    if metrics and "eval_data" not in raw:
        raise ValueError(f"job file {path}: metrics are computed on the evaluation data, but eval_data is not "
                         "set; set eval_data or drop metrics")
    monitor = raw.get("lr_scheduler_monitor")
    if monitor is not None:
        if interval != "epoch":
            raise ValueError(f"job file {path}: lr_scheduler_monitor = {monitor!r} feeds a ReduceLROnPlateau at "
                             'the end of each epoch: set lr_scheduler_interval = "epoch"')
        evals = ["eval_loss", "eval_accuracy"] + [f"eval_{name}" for name in metrics]
        known = ["train_loss"] + (evals if "eval_data" in raw else [])
        if monitor not in known:
            hint = ("; the eval_* values need eval_data" if monitor.startswith("eval_") and "eval_data" not in raw
                    else "")
            raise ValueError(f"job file {path}: lr_scheduler_monitor = {monitor!r} is not a value the run "
                             f"measures{hint}; {did_you_mean([monitor], known, 'choose one of')}")
def _check_model_keys(path: str, raw: Mapping[str, Any]) -> None:
    """``model`` + ``balance`` (counts; or ``"time"`` / ``"memory"`` with ``balance_sample`` and
    ``n_stages``) instead of ``stages``."""
    if "model" in raw and "stages" in raw:
        raise ValueError(f"job file {path}: stages and model both name the stages: keep one (stages = 'pkg.mod:fn' "
                         "returns the stages; model = 'pkg.mod:fn' returns an nn.Sequential that balance splits)")
    for key in ("balance", "balance_sample"):
        if key in raw and "model" not in raw:
            raise ValueError(f"job file {path}: {key} splits the nn.Sequential that model names: set "
                             "model = 'pkg.mod:fn' (a function returning it) instead of stages")
    if "model" not in raw:
        return
    if isinstance(schedules.resolve(raw["schedule"]), schedules.AssociatedLearning):
        raise ValueError(f"job file {path}: schedule 'al' trains pipeq.al.ALLayer stages, and model + balance "
                         "splits an nn.Sequential into plain ones: name the AL layers with stages = 'pkg.mod:fn' "
                         "(pipeq.al.build_al)")
    balance = raw.get("balance")
    if balance is None:
        raise ValueError(f"job file {path}: model needs balance: layer counts per stage (balance = [3, 2, 1]), or "
                         'balance = "time" or "memory" with balance_sample and n_stages (measured when the run starts)')
    if isinstance(balance, str):
        _check_measured_balance(path, raw, balance)
        return
    if not balance or not all(type(c) is int and c >= 1 for c in balance):
        raise ValueError(f"job file {path}: balance must be an array of layer counts per stage, each at least 1 "
                         f"(or \"time\" / \"memory\"), got {balance!r}")
    if "balance_sample" in raw:
        raise ValueError(f"job file {path}: balance_sample is read only to measure (balance = \"time\" or "
                         "\"memory\"); balance gives the counts already: remove balance_sample")
    if "n_stages" in raw and raw["n_stages"] != len(balance):
        raise ValueError(f"job file {path}: n_stages = {raw['n_stages']}, but balance = {balance} makes "
                         f"{len(balance)} stages; drop n_stages or make them agree")


def _check_measured_balance(path: str, raw: Mapping[str, Any], by: str) -> None:
    if by not in balancing.BY:
        raise ValueError(f"job file {path}: balance = {by!r}; {did_you_mean([by], balancing.BY, 'choose one of')}, "
                         "or give layer counts per stage (balance = [3, 2, 1])")
    missing = [k for k in ("balance_sample", "n_stages") if k not in raw]
    if missing:
        raise ValueError(f"job file {path}: balance = {by!r} measures the layers on a sample when the run starts: "
                         f"set {' and '.join(missing)} (balance_sample = 'pkg.mod:fn' returns the model's input, "
                         "n_stages the number of stages)")
