"""What a runner is assembled from: its configuration, and the backend that runs its stages.

:func:`configure` makes the run's :class:`~pipeq.control.config.RunConfig` (``config=``, or the
keyword arguments). A :class:`BackendPlan` holds what the backend is built from (the checked
model, the tensor-parallel plans, the rendezvous) and builds it: a
:class:`~pipeq.runtime.simulated.SimulatedBackend` (``mode="simulated"``) or a
:class:`~pipeq.control.driver.ProcessBackend`, both a :class:`~pipeq.runtime.backend.Backend`.
With ``schedule="auto"`` the runner keeps the plan until its first batch, whose profile
(:mod:`pipeq.control.auto_schedule`) settles the schedule the backend is built for
(:meth:`BackendPlan.settle`).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import warnings
from typing import TYPE_CHECKING, Any, Sequence

from torch import nn

from pipeq import compat, schedules
from pipeq.control import checks, memory_limit
from pipeq.control.batching import Batcher
from pipeq.control.config import RunConfig, setting_default, setting_fields
from pipeq.control.processes import RunSetup, plan_devices
from pipeq.control.stage_inputs import route, route_each
from pipeq.stage import compiled
from pipeq.stage.info import info_of
from pipeq.stage.microbatch import Microbatches
from pipeq.stage.numerics import Numerics

if TYPE_CHECKING:
    from pipeq.control.driver import ProcessBackend
    from pipeq.control.rendezvous import Rendezvous
    from pipeq.runtime.backend import Backend
    from pipeq.schedules.choose import Choice

__all__ = ["BackendPlan", "configure", "processes_of", "signature"]


def configure(config: RunConfig | None, schedule: Any, microbatches: int | None,
              settings: dict[str, Any]) -> RunConfig:
    """The run's configuration: ``config``, or the one the keyword arguments name."""
    if config is None:
        return RunConfig.from_kwargs(schedule, microbatches, **settings)
    if not isinstance(config, RunConfig):
        raise ValueError(f"config must be a pipeq.RunConfig, got {type(config).__name__}")
    if settings:
        raise ValueError(f"pass the run's settings in config or as keyword arguments, not both: got config and "
                         f"{', '.join(sorted(settings))}")
    given = {k: v for k, v in (("schedule", schedule), ("microbatches", microbatches)) if v is not None}
    return dataclasses.replace(config, **given) if given else config


def signature(init: Any) -> inspect.Signature:
    """The runner's signature as ``help()`` and IDEs show it, from its ``__init__``: every setting
    by name, with its default as its :class:`RunConfig` part declares it (the constructor takes
    them as ``**settings``, which build a RunConfig; ``schedule`` and ``microbatches``, None there
    when not given, show the RunConfig's defaults too)."""
    own = [p.replace(default=setting_default(p.name)) if p.name in ("schedule", "microbatches") else p
           for p in list(inspect.signature(init).parameters.values())[1:] if p.kind is not inspect.Parameter.VAR_KEYWORD]
    settings = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=setting_default(f.name),
                                  annotation=f.type) for f in setting_fields()]
    return inspect.Signature(own + settings)


def uncompiled(stages: Any, cfg: RunConfig) -> tuple[Any, RunConfig]:
    """``stages`` with any compiled in this process (``torch.compile(stage)``, an ``OptimizedModule``
    whose names gain ``_orig_mod.``; ``stage.compile()``, which pickling drops) as their own modules,
    and the run's configuration: such a stage is compiled in its stage process by the run's
    ``compile`` setting, turned on (with a warning) when it is off."""
    if isinstance(stages, nn.Module):
        one, found = compiled.unwrap(stages)
        out, at = one, [0] if found else []
    elif isinstance(stages, (list, tuple)):
        pairs = [compiled.unwrap(s) if isinstance(s, nn.Module) else (s, False) for s in stages]
        at = [k for k, (_, found) in enumerate(pairs) if found]
        out = [s for s, _ in pairs] if at else stages
    else:
        return stages, cfg
    if at and cfg.numerics.compile in (False, None):
        warnings.warn(f"stage(s) {at} were compiled in this process (torch.compile or .compile()), which does not "
                      "reach a stage process: pipeq runs their own modules and compiles each in its stage process, "
                      "as compile=True does (pass compile=True, or a dict of torch.compile's arguments, to say so)",
                      stacklevel=3)
        cfg = dataclasses.replace(cfg, numerics=dataclasses.replace(cfg.numerics, compile=True))
    return out, cfg


@dataclasses.dataclass
class BackendPlan:
    """What a runner's backend is built from: the checked ``model``, its ``numerics``, each
    stage's tensor-parallel plan (``tp_plans``), and the ``rendezvous`` of a multi-host run."""

    model: checks.Model
    numerics: Numerics
    tp_plans: list[Any] | None
    rendezvous: Rendezvous | None

    @classmethod
    def of(cls, stages: Any, loss_fn: Any, optimizer: Any, cfg: RunConfig, *, lr_scheduler: Any,
           lr_scheduler_interval: str | None, aux_heads: Any, aux_loss: Any, balance: Sequence[int] | None,
           ties: Any, rendezvous: Rendezvous | None) -> BackendPlan:
        """The runner's arguments checked against each other and ``cfg`` (a ValueError or TypeError
        names what does not fit; see :mod:`pipeq.control.checks`), with ``balance``: the whole
        model split here first (:mod:`pipeq.balance`)."""
        if balance is not None:
            from pipeq.balance import stages_for

            stages = stages_for(stages, balance)
        place = cfg.placement
        model = checks.check_model(stages, loss_fn, optimizer, lr_scheduler, cfg.schedule, aux_heads=aux_heads,
                                   aux_loss=aux_loss, data_parallel=place.data_parallel, mode=place.mode,
                                   rendezvous=rendezvous, lr_scheduler_interval=lr_scheduler_interval, ties=ties)
        cfg.check_stages(model.n_stages)
        numerics = cfg.numerics_for(model.n_stages)
        compat.check(cfg, multi_host=rendezvous is not None, ties=model.ties, numerics=numerics != Numerics())
        tp_plans = checks.check_tensor_parallel(model, place.tensor_parallel, place.tp_plan)
        return cls(model, numerics, tp_plans, rendezvous)

    def batcher(self, cfg: RunConfig) -> Batcher:
        """What splits the run's batches into microbatches (and replica shards), for ``cfg``'s schedule."""
        model, place = self.model, cfg.placement
        even = ("fsdp_reshard='microbatch' gathers each stage's parameters around every microbatch's forward and "
                "backward, a collective of its replicas" if place.sharding != "none" and place.fsdp_reshard == "microbatch"
                else None)
        return Batcher(cfg.schedule, model.n_stages, cfg.microbatches, model.loss_fn, model.aux_loss,
                       place.data_parallel, cfg.numerics.loss_weighting, even)

    def backend(self, cfg: RunConfig) -> Backend:
        """The backend that runs the stages: this process's (simulated) or one process per stage."""
        place, schedule, model = cfg.placement, cfg.schedule, self.model
        if place.mode == "simulated":
            from pipeq.runtime.simulated import SimulatedBackend

            return SimulatedBackend(model.replicas[0], schedule, place.devices[0] if place.devices else "cpu",
                                    self.numerics, compiled.options(cfg.numerics.compile))
        from pipeq.control.driver import ProcessBackend

        return ProcessBackend(checks.process_payloads(model, schedule), RunSetup(cfg, self.numerics, self.tp_plans),
                              rendezvous=self.rendezvous)

    def settle(self, cfg: RunConfig, batcher: Batcher, batch: tuple[Any, Any, Any] | None) -> tuple[Choice, RunConfig]:
        """``schedule="auto"``: the schedule chosen (profiled with ``batch``, the first step's
        ``(x, target, stage_inputs)``, when there is one and the run allows it; see
        :mod:`pipeq.control.auto_schedule`), its ranking printed, and the run's configuration
        with it; ``batcher`` splits ``batch`` as the auto run's does."""
        from pipeq.control import auto_schedule
        from pipeq.schedules.choose import format_choice

        model, place = self.model, cfg.placement
        n, m, v = model.n_stages, cfg.microbatches, place.stages_per_process or 1
        can = place.data_parallel == 1 and place.tensor_parallel == 1 and self.rendezvous is None
        args = None
        if batch is not None and can:
            x, target, size = batcher.training_pair(batch[0], batch[1])
            declared = [] if model.builder is not None else [info_of(s.module).inputs for s in model.replicas[0]]
            inputs = None
            if declared and (batch[2] is not None or any(declared)):
                inputs = (route_each(batch[2], declared, batcher.given_sizes(x), cfg.schedule)
                          if isinstance(x, Microbatches) else route(batch[2], declared, size, cfg.schedule))
            args = (batcher.shards(target, size), x, target, inputs)
        device = place.devices[0] if place.devices else "cpu"
        limit = self._byte_limit(cfg, measured=args is not None)
        try:
            choice = auto_schedule.decide(model, self.numerics, n, m, args, device=device, can_profile=can,
                                          stages_per_process=v, byte_limit=limit)
        except memory_limit.MemoryLimitError:
            raise
        except Exception as exc:  # a profile that fails is no reason not to train: ZB-H1, said so
            why = str(exc).splitlines()[0] if str(exc) else ""
            print(f"pipeq: schedule='auto' could not profile the stages ({type(exc).__name__}: {why}); "
                  "choosing at equal costs", file=sys.stderr)
            choice = auto_schedule.decide(model, self.numerics, n, m, None, can_profile=False, stages_per_process=v)
        print(format_choice(choice), file=sys.stderr)
        # settled: the schedule named (the limit has chosen it; the choice keeps it, as choice.budget)
        return choice, dataclasses.replace(cfg, schedule=choice.schedule, auto=False, auto_memory_limit=None)

    def _byte_limit(self, cfg: RunConfig, measured: bool) -> float | None:
        """``auto_memory_limit`` in bytes for the least of the run's stage processes (None: not
        given, or nothing to measure: the pipeline was needed before a first step, said so)."""
        if cfg.auto_memory_limit is None:
            return None
        if self.rendezvous is not None:
            raise memory_limit.MemoryLimitError(
                "auto_memory_limit: a multi-host run is not profiled, so nothing would measure what its stages "
                "hold: name the schedule instead")
        if not measured:
            print(f"pipeq: auto_memory_limit={cfg.auto_memory_limit!r} not applied: the pipeline was needed before "
                  "a first step (predict, state_dict...), so nothing was measured; choosing within 1F1B's "
                  "activation memory", file=sys.stderr)
            return None
        place = cfg.placement
        where = schedules.process_stages(cfg.schedule, self.model.n_stages)
        devices = None if place.devices is None else [place.devices[stages[0]] for stages in where]
        on = [d for d, _, _ in plan_devices(len(where), devices)]
        return min(memory_limit.per_process(memory_limit.parse(cfg.auto_memory_limit), on))


def processes_of(backend: Backend, mode: str) -> ProcessBackend | None:
    """``backend`` in process mode (for what only a process backend has: the processes' pids, the
    replicas' failures), None in simulated mode."""
    if mode != "process":
        return None
    from pipeq.control.driver import ProcessBackend

    assert isinstance(backend, ProcessBackend), backend
    return backend
