"""Job files: what ``pipeq launch JOB.toml`` trains, as importable names and settings.

A job file (TOML, read with the standard library's tomllib)::

    stages = "examples.digits_job:stages"        # () -> [stage modules], or (k, n) -> stage k
    n_stages = 3                                 # needed with the (k, n) form
    loss = "torch.nn:CrossEntropyLoss"           # a class, a zero-argument factory, or the loss
    optimizer = "torch.optim:SGD"                # called with a stage's parameters (+ the args)
    optimizer_args = { lr = 0.1, momentum = 0.9 }
    lr_scheduler = "torch.optim.lr_scheduler:StepLR"   # optional, called with the optimizer
    lr_scheduler_args = { step_size = 20, gamma = 0.5 }
    data = "examples.digits_job:train_batches"   # (epoch) -> iterable of (x, target) batches
    eval_data = "examples.digits_job:heldout"    # optional: () -> (x, target) or batches
    schedule = "1f1b"
    microbatches = 4
    steps = 60                                   # or epochs = 3 (steps then caps them)
    out = "runs/digits"
    checkpoint_every = 20                        # 0: only the final state
    keep_checkpoints = 3                         # the newest 3 (0: keep all)
    seed = 0
    data_parallel = 1                            # R replicas of the pipeline (R x N processes)
    [placement]                                  # optional, multi-host: processes per node
    nodes = [[0], [1, 2]]                        # (process r * n_stages + k: replica r's stage k)

Stage processes build their stage from these names themselves (``Recipe.build``), on whichever
host they run: nothing but plain data crosses hosts, and every host builds the same weights
(the stages function runs under ``torch.manual_seed(seed)``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import sys
import tomllib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from .executors import StageBuilder, StageSpec


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


def _required_positional(fn: Callable) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return -1
    return sum(1 for p in params if p.default is p.empty
               and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


@dataclass
class Recipe(StageBuilder):
    """How a stage process builds its part of a job (plain strings: picklable, host-independent)."""

    stages: str
    loss: str
    optimizer: str
    optimizer_args: dict[str, Any] = field(default_factory=dict)
    lr_scheduler: str | None = None
    lr_scheduler_args: dict[str, Any] = field(default_factory=dict)
    n_stages: int | None = None
    seed: int = 0
    sys_path: list[str] = field(default_factory=list)

    def _imports(self) -> None:
        for p in reversed(self.sys_path):
            if p not in sys.path:
                sys.path.insert(0, p)

    def count_stages(self) -> int:
        """N: the job's ``n_stages``, or the length of the list its stages function returns."""
        self._imports()
        fn = resolve(self.stages, "stages")
        if _required_positional(fn) == 2:
            if self.n_stages is None:
                raise ValueError(f"stages = {self.stages!r} builds stage k of n: the job must set n_stages")
            return self.n_stages
        n = len(self._all_stages(fn))
        if self.n_stages is not None and self.n_stages != n:
            raise ValueError(f"n_stages = {self.n_stages}, but {self.stages} returns {n} stages")
        return n

    def _all_stages(self, fn: Callable) -> list[nn.Module]:
        torch.manual_seed(self.seed)
        stages = fn() if _required_positional(fn) == 0 else fn(self.n_stages)
        if not isinstance(stages, (list, tuple)) or not all(isinstance(s, nn.Module) for s in stages):
            raise ValueError(f"stages = {self.stages!r} must return a list of nn.Module")
        return list(stages)

    def build_stage(self, k: int, n: int) -> nn.Module:
        self._imports()
        fn = resolve(self.stages, "stages")
        if _required_positional(fn) == 2:
            torch.manual_seed(self.seed + k)
            module = fn(k, n)
        else:
            stages = self._all_stages(fn)
            if len(stages) != n:
                raise ValueError(f"{self.stages} returned {len(stages)} stages, the run has {n}")
            module = stages[k]
        if not isinstance(module, nn.Module):
            raise ValueError(f"stages = {self.stages!r} gave stage {k} as a {type(module).__name__}")
        return module

    def loss_fn(self) -> Callable:
        self._imports()
        obj = resolve(self.loss, "loss")
        if isinstance(obj, type):
            return obj()
        if not isinstance(obj, nn.Module) and callable(obj) and _required_positional(obj) == 0:
            return obj()  # a factory
        if not callable(obj):
            raise ValueError(f"loss = {self.loss!r} is not callable")
        return obj

    def optimizer_factory(self) -> Callable:
        self._imports()
        fn = resolve(self.optimizer, "optimizer")
        return functools.partial(fn, **self.optimizer_args) if self.optimizer_args else fn

    def scheduler_factory(self) -> Callable | None:
        if self.lr_scheduler is None:
            return None
        self._imports()
        fn = resolve(self.lr_scheduler, "lr_scheduler")
        return functools.partial(fn, **self.lr_scheduler_args) if self.lr_scheduler_args else fn

    def build(self, stage: int, n_stages: int) -> StageSpec:
        module = self.build_stage(stage, n_stages)
        loss = self.loss_fn() if stage == n_stages - 1 else None
        return StageSpec(module, self.optimizer_factory(), loss, self.scheduler_factory())

    def seed_for(self, stage: int) -> int:
        return self.seed * 1009 + stage + 1

    def describe(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "sys_path"}


@dataclass
class Job:
    recipe: Recipe
    data: str
    eval_data: str | None = None
    schedule: str = "1f1b"
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
    start_timeout: float = 120.0
    trace: str | None = None
    data_parallel: int = 1
    path: str = ""

    def data_fn(self) -> Callable[..., Iterable]:
        self.recipe._imports()
        return resolve(self.data, "data")

    def batches(self, epoch: int) -> Iterable:
        fn = self.data_fn()
        return fn(epoch) if _required_positional(fn) >= 1 else fn()

    def eval_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        if self.eval_data is None:
            return None
        self.recipe._imports()
        got = resolve(self.eval_data, "eval_data")
        got = got() if callable(got) else got
        if isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], torch.Tensor):
            return [got]
        return list(got)


# key -> (type(s), where it goes); types are checked so a typo or a wrong value fails loudly
_RECIPE_KEYS = {
    "stages": str, "loss": str, "optimizer": str, "optimizer_args": dict, "lr_scheduler": str,
    "lr_scheduler_args": dict, "n_stages": int, "seed": int,
}
_JOB_KEYS = {
    "data": str, "eval_data": str, "schedule": str, "microbatches": int, "steps": int, "epochs": int,
    "out": str, "checkpoint_every": int, "keep_checkpoints": int, "eval_every": int,
    "log_every": int, "placement": dict,
    "threads_per_stage": int, "heartbeat_timeout": (int, float), "start_timeout": (int, float),
    "trace": str, "data_parallel": int,
}
_REQUIRED = ("stages", "loss", "optimizer", "data")


def load_job(path: str, overrides: Mapping[str, Any] | None = None) -> Job:
    """Read ``path`` and apply ``overrides`` (command-line flags; None values are ignored)."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"job file {path!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"job file {path}: {exc}") from None
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    known = {**_RECIPE_KEYS, **_JOB_KEYS}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"job file {path}: unknown key(s) {unknown}; known keys: {sorted(known)}")
    for key, types in known.items():
        if key in raw and (not isinstance(raw[key], types) or isinstance(raw[key], bool)):
            want = types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)
            raise ValueError(f"job file {path}: {key} must be a {want}, got {raw[key]!r}")
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise ValueError(f"job file {path}: missing required key(s) {missing}")
    for key in ("microbatches", "steps", "epochs", "n_stages", "threads_per_stage", "data_parallel"):
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
    recipe = Recipe(**{k: raw.pop(k) for k in list(raw) if k in _RECIPE_KEYS}, sys_path=sys_path)
    job = Job(recipe=recipe, placement=nodes, path=os.path.abspath(path), **raw)
    return dataclasses.replace(job)
