"""The Recipe: how a job's stages are built from the job file's names (once per host, or in each stage process)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from pipeq import balance as balancing
from pipeq.checkpoint.names import positional
from pipeq.launch.job.made import MadeStages
from pipeq.launch.job.keys import field_of
from pipeq.launch.job.names import check_args, importable, required_positional, resolve
from pipeq import schedules
from pipeq.stage.spec import StageBuilder, StageSpec

__all__ = ["Recipe"]

_MEASURED_ON_ONE_NODE = (
    "balance = {by!r} is measured once, by the launching process (node 0), when the run starts, and "
    "the other nodes of a multi-host run build from their own job file: write the counts into the job "
    "instead (balance = [3, 2, 1]; pipeq.balance(model, n_stages, sample, by={by!r}) measures them)")


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Build under ``torch.manual_seed(seed)`` (the same weights on every host), and leave the
    caller's RNG as it was (a stage process keeps its own stream, for dropout)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def _raised_in(key: str, spec: Any) -> Iterator[None]:
    """Call the job's ``key`` function: an exception of its own comes out as a ValueError that
    names the key and where it was raised (``pipeq launch`` says it in one line)."""
    try:
        yield
    except Exception as exc:
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if len(frames) > 1 else ""
        raise ValueError(f"{key} = {spec!r} raised {type(exc).__name__}: {exc}{where}") from exc


def _make_loss(spec: str, key: str, args: Mapping[str, Any] | None = None) -> Callable:
    """A loss named by ``spec``: a class (instantiated with ``args``), a factory taking no
    positional argument (called with ``args``), or the loss itself (a loss function with
    ``args`` bound as keywords, as ``functools.partial`` does)."""
    obj = resolve(spec, key)
    args = dict(args or {})
    if isinstance(obj, type) or (not isinstance(obj, nn.Module) and callable(obj)
                                 and required_positional(obj, args) == 0):
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
    if "reduction" in args:  # how pipeq weights the microbatches' losses (pipeq.stage.loss.loss_weight_mode)
        bound.reduction = args["reduction"]  # type: ignore[attr-defined]
    return bound


@dataclass
class Recipe(StageBuilder):
    """How a stage process builds its part of a job (plain strings: picklable, host-independent).

    Its fields are the job file's keys of the same names (their defaults and meanings:
    :data:`pipeq.launch.job.keys.KEYS`), and ``sys_path``: where the job's modules import from."""

    stages: str | None  # None: the stages are model split by balance
    loss: str | None  # None: no end-to-end loss (Associated Learning's layers default to MSE)
    optimizer: str
    optimizer_args: dict[str, Any] = field_of("optimizer_args")
    lr_scheduler: str | None = field_of("lr_scheduler")
    lr_scheduler_args: dict[str, Any] = field_of("lr_scheduler_args")
    n_stages: int | None = field_of("n_stages")
    seed: int = field_of("seed")
    aux_heads: str | None = field_of("aux_heads")
    aux_loss: str | None = field_of("aux_loss")  # None: the executors' default, cross-entropy
    stages_args: dict[str, Any] = field_of("stages_args")
    loss_args: dict[str, Any] = field_of("loss_args")
    aux_heads_args: dict[str, Any] = field_of("aux_heads_args")
    aux_loss_args: dict[str, Any] = field_of("aux_loss_args")
    lr_scheduler_interval: str | None = field_of("lr_scheduler_interval")  # None: "step" (pipeq.stage.lr_schedulers)
    model: str | None = field_of("model")
    split_modules: list[list[str]] | None = field_of("split_modules")  # model split by name (pipeq.split)
    balance: list[int] | str | None = field_of("balance")  # "time" / "memory": measured (prepared)
    balance_sample: str | None = field_of("balance_sample")
    model_args: dict[str, Any] = field_of("model_args")
    balance_sample_args: dict[str, Any] = field_of("balance_sample_args")
    sys_path: list[str] = field(default_factory=list)
    schedule: Any = None  # the run's (a name or schedule object): it says which stages get the loss
    # the stages function's stages, made once per node (stages_made): stage processes do not call it
    made: MadeStages | None = field(default=None, repr=False, compare=False)

    def _imports(self) -> None:
        """Make the job's modules importable (:func:`~pipeq.launch.job.names.importable`)."""
        importable(self.sys_path)

    def count_stages(self) -> int:
        """N: the job's ``n_stages``, or the length of the list its stages function returns (or
        of its balance)."""
        if self.made is not None:
            return len(self.made)
        if self.model is not None and self.split_modules is not None:
            if self.n_stages is not None and self.n_stages != len(self.split_modules):
                raise ValueError(f"n_stages = {self.n_stages}, but split_modules names {len(self.split_modules)} stages")
            return len(self.split_modules)
        if self.model is not None:
            counts = self._counts()
            if self.n_stages is not None and self.n_stages != len(counts):
                raise ValueError(f"n_stages = {self.n_stages}, but balance = {counts} makes {len(counts)} stages")
            return len(counts)
        fn = self._stages_fn()
        if required_positional(fn, self.stages_args) == 2:
            if self.n_stages is None:
                raise ValueError(f"stages = {self.stages!r} builds stage k of n: the job must set n_stages")
            return self.n_stages
        return len(self._all_stages(fn))

    def _stages_fn(self) -> Callable:
        """The stages function, its ``stages_args`` checked."""
        self._imports()
        fn = resolve(self.stages, "stages")
        check_args(fn, self.stages_args, "stages", self.stages)
        return fn

    def _all_stages(self, fn: Callable) -> list[nn.Module]:
        args = self.stages_args
        with _seeded(self.seed), _raised_in("stages", self.stages):
            stages = fn(**args) if required_positional(fn, args) == 0 else fn(self.n_stages, **args)
        if not isinstance(stages, (list, tuple)) or not all(isinstance(s, nn.Module) for s in stages):
            raise ValueError(f"stages = {self.stages!r} must return a list of nn.Module")
        if self.n_stages is not None and self.n_stages != len(stages):
            raise ValueError(f"n_stages = {self.n_stages}, but {self.stages} returns {len(stages)} stages")
        return stages  # (a pipeq.split Split keeps its split_points)

    def build_stage(self, k: int, n: int) -> nn.Module:
        if self.made is not None and self.made.has(k):
            if len(self.made) != n:
                raise ValueError(f"{self.stages} returned {len(self.made)} stages, the run has {n}")
            return self.made.module(k)  # made once (stages_made), not by calling the function again
        if self.model is not None and self.split_modules is not None:
            from pipeq.split import split

            if len(self.split_modules) != n:
                raise ValueError(f"split_modules names {len(self.split_modules)} stages, the run has {n}")
            return split(self._model(sequential=False), modules=self.split_modules)[k]
        if self.model is not None:
            counts = self._counts()
            if len(counts) != n:
                raise ValueError(f"balance = {counts} makes {len(counts)} stages, the run has {n}")
            return balancing.split(self._model(), counts)[k]
        fn = self._stages_fn()
        if required_positional(fn, self.stages_args) == 2:
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
        """This recipe with what is decided once decided: its stages made (:meth:`stages_made`),
        or its balance as layer counts, checked against the model: measured here (``balance =
        "time"`` / ``"memory"``), once, so every stage process gets the same counts."""
        if self.model is None:
            return self.stages_made()
        if self.split_modules is not None:
            if self.balance is not None:
                raise ValueError("split_modules names each stage's modules: drop balance")
            return self
        if isinstance(self.balance, str):
            if multi_host:
                raise ValueError(_MEASURED_ON_ONE_NODE.format(by=self.balance))
            return dataclasses.replace(self, balance=self._measure(self.balance))
        balancing.check_counts(self._counts(), len(self._model()))  # here, not in a stage process
        return self

    def stages_made(self) -> "Recipe":
        """This recipe holding its stages made here (:class:`~pipeq.launch.job.made.MadeStages`):
        a stages function returning every stage is called once, and each stage process is handed
        its stage (:meth:`for_stage`) instead of calling it again. The recipe itself when they are
        made already, and with ``stages(k, n)`` or a ``model`` (built in each stage process)."""
        if self.made is not None or self.model is not None:
            return self
        fn = self._stages_fn()
        if required_positional(fn, self.stages_args) == 2:
            return self
        return dataclasses.replace(self, made=MadeStages.of(self._all_stages(fn)))

    def _counts(self) -> list[int]:
        if isinstance(self.balance, str):
            raise ValueError(_MEASURED_ON_ONE_NODE.format(by=self.balance))
        if not self.balance:
            raise ValueError(f"model = {self.model!r} needs balance: layer counts per stage, or 'time' / 'memory'")
        return list(self.balance)

    def _model(self, sequential: bool = True) -> nn.Module:
        """The job's model, built under its seed (the same weights in every process); an
        nn.Sequential of layers unless it is split by name (``sequential=False``)."""
        self._imports()
        fn = resolve(self.model, "model")
        if not callable(fn) or required_positional(fn, self.model_args) > 0:
            raise ValueError(f"model = {self.model!r} must be a function returning the model, called with "
                             "model_args (none by default)")
        check_args(fn, self.model_args, "model", self.model)
        with _seeded(self.seed), _raised_in("model", self.model):
            model = fn(**self.model_args)
        if sequential:
            balancing.layers_of(model, f"the model of model = {self.model!r}")
        elif not isinstance(model, nn.Module):
            raise ValueError(f"model = {self.model!r} returned a {type(model).__name__}, not an nn.Module")
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
            heads = fn(**args) if required_positional(fn, args) == 0 else fn(n_stages, **args)
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
        """Stage ``stage``'s spec: the loss on the stages the schedule computes it on (the last;
        every AL layer, their local criterion), and with auxiliary heads stage k's head and their loss."""
        module = positional(self.build_stage(stage, n_stages))  # model[2:4] named as the model
        policy = schedules.resolve("1f1b" if self.schedule is None else self.schedule)
        loss = self.loss_fn() if policy.computes_loss(stage, n_stages) else None
        heads = self.heads(n_stages)
        head = heads[stage] if heads is not None and stage < n_stages - 1 else None
        aux_loss = self.aux_loss_fn() if heads is not None else None
        return StageSpec(module, self.optimizer_factory(), loss, self.scheduler_factory(), head, aux_loss,
                         self.lr_scheduler_interval or "step")

    def seed_for(self, stage: int) -> int:
        return self.seed * 1009 + stage + 1

    def describe(self) -> dict[str, Any]:
        out = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)
               if f.name not in ("sys_path", "schedule", "made")}
        if self.made is not None:  # the stages made: what another node must have made too
            out["made"] = self.made.describe()
        return out

    def for_stage(self, stage: int) -> "Recipe":
        """What stage ``stage``'s process is handed: this recipe, holding that stage only when made."""
        return self if self.made is None else dataclasses.replace(self, made=self.made.only(stage))

    def for_schedule(self, schedule: Any) -> "Recipe":
        return self if self.schedule is not None else dataclasses.replace(self, schedule=schedule)
