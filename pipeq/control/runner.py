"""``pipeq.PipelineRunner``: the embedding API.

    runner = pipeq.PipelineRunner(stages, loss_fn=nn.CrossEntropyLoss(),
                                  optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                  schedule="1f1b", microbatches=8)
    with runner:                          # starts one process per stage; exit stops them all
        loss = runner.step(x, target)     # one optimizer step on the whole batch -> mean loss
        loss = runner.step(x, target, stage_inputs={"mask": m})  # m straight to the stages taking it
        out = runner.predict(x)           # forward only -> CPU tensor
        state = runner.state_dict()       # keys as in the flat model nn.Sequential(*layers)

The runner checks its arguments (a :class:`~pipeq.RunConfig`, built once) and the schedule (a dry run with the real stage and microbatch
counts) before anything starts, splits each batch into microbatches, and hands the work to a
backend: :class:`~pipeq.control.driver.ProcessBackend` (``mode="process"``, the default) or
:class:`~pipeq.runtime.simulated.SimulatedBackend` (``mode="simulated"``, every stage in this process).
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import itertools
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from pipeq import schedules
from pipeq.control import checks, shape_check
from pipeq.control.batching import Batcher, check_batch
from pipeq.control.config import RunConfig, setting_fields
from pipeq.control.exclusive import CallGuard, exclusive
from pipeq.control.lifecycle import RunnerLifecycle
from pipeq.control.processes import RunSetup
from pipeq.control.stage_inputs import StageInputs, route
from pipeq.control.snapshots import RunnerSnapshots
from pipeq.control.state import RunnerState
from pipeq.control.streaming import RunnerStream
from pipeq.errors import PipelineError
from pipeq.stage import microbatch
from pipeq.stage.info import info_of
from pipeq.stage.numerics import Numerics
from pipeq.stage.spec import StageBuilder

if TYPE_CHECKING:
    from pipeq.control.rendezvous import Rendezvous

__all__ = ["PipelineRunner"]


class PipelineRunner(RunnerLifecycle, RunnerStream, RunnerState, RunnerSnapshots):
    """Train ``stages`` (one ``nn.Module`` per pipeline stage) with a pipeline schedule.

    The settings (keyword arguments, grouped below) build a :class:`~pipeq.RunConfig`,
    whose parts' classes document them in full; ``config=`` gives one whole.

    Args: Model and training
        stages: the model, split into stages; stage k's output is stage k+1's input: a tuple is
            spread over its arguments, anything else (a tensor, a list, a dict of tensors and
            constants) is its one argument. ``step``, ``stream`` and ``predict`` take ``x`` and
            ``target`` the same ways (see :mod:`pipeq.stage.microbatch`). In process mode they must be picklable. Or a
            :class:`pipeq.Recipe` (importable names, as in a job file) from which each stage
            process builds its own stage; then ``loss_fn`` and ``optimizer`` are None (the
            recipe names them). Multi-host runs need a recipe.
        loss_fn: ``loss_fn(output, target)`` on the last stage; reduction 'mean' or 'sum'.
        optimizer: called with one stage's parameters, e.g. ``partial(torch.optim.SGD, lr=0.1)``.
        lr_scheduler: called with each stage's optimizer, e.g.
            ``partial(torch.optim.lr_scheduler.StepLR, step_size=10)``; stepped with the
            optimizer on every stage: once per training step (once per microbatch with
            ``"async"`` and ``"al"``, which update after every microbatch).
        lr_scheduler_interval: ``"step"`` (default: as above) or ``"epoch"``: the stages never
            step the scheduler themselves, :meth:`scheduler_step` steps every stage's (every
            replica's) once, e.g. at the end of each epoch, with the metric a
            ``ReduceLROnPlateau`` monitors (which needs ``"epoch"``). With a recipe, the recipe
            sets it.
        balance: layer counts per stage (``[3, 2, 1]``, or ``pipeq.balance(model, n_stages,
            sample)``, which measures them) when ``stages`` is the whole model as one
            ``nn.Sequential``: its children are split into stages of that many layers each
            (``pipeq.balance.split``; every replica gets the same split).
        ties: parameters several stages use (a tied embedding and LM head), as groups of their
            :meth:`state_dict` names, ``[["0.weight", "5.weight"]]``: each stage keeps a copy, the
            copies' gradients are summed before every step (bitwise-equal copies, one process's
            numbers), and :meth:`state_dict` and checkpoints hold the tensor once, under the first
            name (see :mod:`pipeq.control.ties`). Sharing between stages that is not tied is refused.

    Args: Schedule
        schedule: a name (``"1f1b"``, the default; ``"fill-drain"`` alias ``"gpipe"``, ``"zb-h1"`` alias
            ``"zb1p"`` (split backward), ``"global"``, ``"local"``, ``"pairwise"``, ``"async"``,
            ``"al"``; ``pipeq.SCHEDULES`` has them all), a schedule object with its
            options (``pipeq.research.Interlock("nwise", distance=2)``,
            ``AsyncOneFOneB(weight_stashing=False)``, ``AssociatedLearning(first_loss="mse")``),
            ``"auto"`` (chosen at the first ``step`` from two profiled steps on copies of the stages,
            see :mod:`pipeq.control.auto_schedule`; the ranking is printed and kept as ``auto_choice``),
            or your own schedule function ``(n_stages, n_microbatches) -> per-stage lists of
            F(j), B(j) (or I(j) then W(j)), STEP`` (module level, so that stage processes can import it); it is
            validated and dry-run for deadlock here, before anything starts.
        microbatches: microbatches per step (default 8; a smaller batch uses one sample per microbatch).
        aux_heads: interlocking schedules: one head per stage but the last (stage k's reads stage
            k's output).
        aux_loss: interlocking schedules: the auxiliary heads' loss (default cross-entropy).

    Keyword Args: Numerics
        precision (str): ``"fp32"`` (default), ``"bf16"`` (autocast to bfloat16; parameters,
            gradients and the optimizer stay float32) or ``"fp16"`` (autocast with dynamic loss
            scaling, every stage and replica stepping or skipping together).
        clip_grad_norm (float | None): clip the gradients by their global norm over every stage,
            as ``torch.nn.utils.clip_grad_norm_`` on the whole model does. Default None: no clipping.
        clip_norm_type (float): the p of ``clip_grad_norm``'s norm (default 2.0, or ``float('inf')``).
        check_finite (bool | str): ``"raise"`` (or True): fail naming the stage and microbatch
            where the first NaN or Inf appeared, before any weight changes; ``"skip"``: skip the
            step on every stage when a gradient is not finite. Default False: no checks.
        recompute (bool | Sequence[bool]): True, or one boolean per stage: recompute the forward
            in the backward (the same numbers, less activation memory). Default False.

    Keyword Args: Wire and transport
        transport (str): ``"ipc"`` (default: Unix sockets, one host) or ``"tcp"``.
        host (str): the address stages bind to with ``transport="tcp"`` (default ``"127.0.0.1"``).
        tcp_security (str): ``"encrypt"`` (default: CURVE on every socket) or ``"authenticate"``
            (a Poly1305 MAC on every data message, not encrypted); only holders of the job's
            secret get in either way.
        max_message_mb (int): the largest tensor (MiB) one stage sends another (default 256).
        shm_slots (int): one host (``"ipc"``): shared-memory slots per channel for tensors of 64 KiB
            or more (default 4; 0: every tensor in ZeroMQ frames).
        queue_capacity (int | None): messages a stage's queue holds, at least ``microbatches``
            (default None: four steps' worth, at least 64).
        spin (float): seconds a waiting stage busy-polls before it blocks (default 0.01; 0 never spins).

    Keyword Args: Faults and timeouts
        heartbeat_interval (float): seconds between a stage's heartbeats (default 1.0).
        heartbeat_timeout (float): seconds of silence before a stage is failed (default 15.0).
        step_timeout (float | None): seconds one compute action (a forward, a backward, an
            optimizer step) may take before the run fails naming the stage and the action;
            longer than ``heartbeat_interval``; process mode only. Default None: off
            (``pipeq launch`` sets 300).
        start_timeout (float): seconds to wait for every stage to start (default 120.0).
        stop_timeout (float): seconds ``close()`` lets the stages finish what they were sent
            before they are terminated (default 60.0).
        fault_tolerance (str | None): None (default: any stage failure ends the run) or
            ``"replicas"``: with ``data_parallel >= 2``, a replica whose stage fails in a
            training step is dropped for that step, whose update and loss are then the mean over
            the other replicas' samples, and rebuilt from a healthy replica's state for the next;
            see :mod:`pipeq.control.replica_loss`, :attr:`degraded_steps`.

    Keyword Args: Placement and parallelism
        mode (str): ``"process"`` (the default: one process per stage) or ``"simulated"`` (all in this one).
        devices (Sequence[str] | None): one device string per stage (default: ``cuda:k``
            round-robin when CUDA is available, else ``cpu`` with each stage pinned to its share
            of the cores).
        threads_per_stage (int | None): torch threads per stage process (default: cores / stages).
        start_method (str): ``"spawn"`` (default) or ``"forkserver"`` (stages fork from a server
            that imports torch once); the environment variable ``PIPEQ_START_METHOD`` sets the
            default. Either way, start the runner under ``if __name__ == "__main__":``.
        placement (Sequence[Sequence[int]] | None): stages per node in a multi-host run, e.g.
            ``[[0], [1, 2]]`` (default: an even, contiguous split).
        rendezvous: a :class:`pipeq.Rendezvous` for a multi-host run (this process is node 0;
            the others run ``pipeq launch ... --node-rank r``); its stages bind to ``rendezvous.bind`` over TCP.
        data_parallel (int): R replicas of the pipeline (R x N processes), gradients all-reduced (default 1).
        tensor_parallel (int): each stage split over T processes of one host (default 1), as
            ``tp_plan`` says (:mod:`pipeq.parallel.tensor`).
        tp_plan (Sequence[Any] | None): one plan per stage: submodule names to ``"colwise"`` or
            ``"rowwise"``, ``{}`` for a stage left whole, or a callable ``(stage_module, mesh) -> module``.
        stages_per_process (int | None): v model stages per process (virtual stages):
            interleaved-1f1b and looped-bfs take any v >= 2, zbv and dualpipev hold 2
            (default: as the schedule says).

    Keyword Args: Observability and configuration
        trace (str | os.PathLike[str] | None): a file path: every stage records each action it
            runs (forward, backward, optimizer step, send, waiting for input) and ``close()``
            writes one merged Chrome trace-event JSON file there (Perfetto, chrome://tracing;
            ``pipeq report`` reads it). Process mode only.
        config: a :class:`~pipeq.RunConfig` holding the schedule, microbatches
            and every setting above, instead of keyword arguments (not both).

    Names: :meth:`state_dict`, :meth:`save` / :meth:`load` (every stage's parameters, optimizer and
    scheduler state; into another split of the same layers too) and ``pipeq launch``'s model.pt name
    tensors as the flat model ``nn.Sequential(*layers)`` does (see :meth:`state_dict`).
    ``runner.lr_schedule`` (a :class:`pipeq.LRSchedule`) says how the lr schedulers
    are stepped: its ``interval``, and whether they take a metric (ReduceLROnPlateau).

    Threads: a runner is used from one thread at a time. A call from a second thread while
    another is inside the runner (a ``step``, a ``stream`` between two batches is not) raises a
    :class:`~pipeq.PipelineError` at once and changes nothing; guard a shared runner with a lock.

    Stage inputs: ``step``, ``predict`` (and ``stream`` / ``evaluate``, with ``(x, target,
    stage_inputs)`` batches) take ``stage_inputs``, values the driver hands straight to the stages
    that use them (an attention mask, position ids), split into microbatches like x: stage k is
    called as ``module(*what_it_receives, **its_inputs)``. ``{"mask": m}`` goes to every stage
    whose ``pipeq_stage`` declares ``"mask"`` (:class:`pipeq.StageInfo`; ``pipeq.split``
    sets it), ``{2: {"mask": m}}`` to stage 2 (see :mod:`pipeq.control.stage_inputs`).
    """

    _declared: "list[tuple[str, ...]] | None" = None  # each stage's declared inputs, asked once

    def __init__(
        self,
        stages: Sequence[nn.Module] | StageBuilder,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None,
        optimizer: Callable[..., torch.optim.Optimizer] | None,
        schedule: str | schedules.ScheduleFn | schedules.SchedulePolicy | None = None,
        microbatches: int | None = None,
        *,
        config: RunConfig | None = None,
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        lr_scheduler_interval: str | None = None,
        aux_heads: Sequence[nn.Module] | None = None,
        aux_loss: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
        balance: Sequence[int] | None = None,
        ties: Sequence[Sequence[str]] | None = None,
        rendezvous: Rendezvous | None = None,
        **settings: Any,
    ) -> None:
        self._guard = CallGuard()  # one thread at a time (pipeq.control.exclusive)
        self.config = cfg = _configure(config, schedule, microbatches, settings)
        if balance is not None:  # the whole model, split here (pipeq.balance)
            from pipeq.balance import stages_for

            stages = stages_for(stages, balance)
        place = cfg.placement
        model = checks.check_model(stages, loss_fn, optimizer, lr_scheduler, cfg.schedule, aux_heads=aux_heads,
                                   aux_loss=aux_loss, data_parallel=place.data_parallel, mode=place.mode,
                                   rendezvous=rendezvous, lr_scheduler_interval=lr_scheduler_interval, ties=ties)
        cfg.check_stages(model.n_stages)
        self.numerics = cfg.numerics_for(model.n_stages)
        tp_plans = checks.check_tensor_parallel(model, cfg.schedule, place.tensor_parallel, place.tp_plan,
                                                mode=place.mode, numerics=self.numerics)
        self.schedule, self.lr_schedule = cfg.schedule, model.lr_schedule  # lr: see pipeq.stage.lr_schedulers
        self.n_stages, self.microbatches, self.mode = model.n_stages, cfg.microbatches, place.mode
        self.data_parallel, self.tensor_parallel = place.data_parallel, place.tensor_parallel
        self._batcher = Batcher(cfg.schedule, model.n_stages, cfg.microbatches, model.loss_fn, model.aux_loss,
                                place.data_parallel)
        self._aux_heads = model.aux_loss is not None  # heads given, or named by the recipe
        self.auto_choice: Any = None  # schedule="auto": the ranking that settled it (see _settle_auto)
        self._auto = (model, tp_plans, rendezvous) if cfg.auto else None  # "auto": no backend until settled
        # the first training batch checks the shapes between the stages (pipeq.control.shape_check)
        self._shape_model = shape_check.candidate(model, cfg.auto or cfg.schedule.plain_backprop, place.tensor_parallel)
        self._backend = None if cfg.auto else _backend(cfg, model, self.numerics, tp_plans, rendezvous)
        self._queue_capacity, self._last_step_lr, self._step = cfg.queue_capacity, None, 0
        self._sent_training = 0  # training steps submitted (self._step counts predict's batches too)
        self._submitted: collections.deque[int] = collections.deque()  # steps whose loss is not back
        self._losses: dict[int, float] = {}  # losses collected early (settle), not yet handed out
        self._undrained = False  # a stream left work behind (see _settle)
        self._running = False
        self._used = False

    def _require_running(self) -> None:
        """The pipeline runs, and every step sent so far is done (a consistent state)."""
        if self._auto is not None and self._running:
            self._settle_auto(None)
        if not self._running and self._used:  # start() would refuse: say what works
            raise PipelineError("this runner is closed (after a failure, or by close()) and cannot start "
                                "again: build a new runner and load_state_dict the state_dict you kept "
                                "(or load a checkpoint)")
        if not self._running:
            raise PipelineError("the pipeline is not running; use 'with runner:' or runner.start()")
        self._settle()

    # -- training and inference --------------------------------------------------------------
    @exclusive
    def step(self, x: Any, target: Any, stage_inputs: Mapping[Any, Any] | None = None) -> float:
        """One optimizer step on the whole batch ``(x, target)``; returns the mean loss. ``x`` and
        ``target``: tensors, or tuples / lists / dicts of them (every tensor split on dim 0);
        ``stage_inputs``: values handed straight to the stages that take them (see the class)."""
        _first_batch(self, x, target, stage_inputs)
        self._require_running()
        return self._hand_out(self._submit(x, target, stage_inputs))

    def _settle_auto(self, batch: tuple[Any, Any, Any] | None) -> None:
        """``schedule="auto"``: choose the schedule (profiled with ``batch``, the first step's, when
        there is one), print the ranking once, build and start the backend (:func:`_settle`)."""
        _settle(self, batch)

    def _before_stream(self, batches: Iterable[tuple[Any, ...]]) -> Iterable[tuple[Any, ...]]:
        """The stream's first batch checks the shapes, and profiles the stages with "auto" (see :meth:`step`)."""
        if (self._auto is None and self._shape_model is None) or not self._running:
            return batches
        rest = iter(batches)
        first = next(rest, None)
        if isinstance(first, (tuple, list)) and len(first) in (2, 3):  # else: the stream says what is wrong
            _first_batch(self, first[0], first[1], first[2] if len(first) > 2 else None)
        return rest if first is None else itertools.chain([first], rest)

    def _submit(self, x: Any, target: Any, given: Any = None, stream: bool = False) -> int:
        x, target, n = self._batcher.training_pair(x, target)
        inputs = self._route(given, n)
        shards = self._batcher.shards(target, n)
        self._step += 1
        self._backend.submit(self._step, shards, x, target, stream, inputs)
        self._submitted.append(self._step)
        self._sent_training += 1
        self._snapshot_after_submit(stream)
        self._undrained |= stream and self.schedule.streams_across_batches
        return self._step

    def _route(self, given: Any, batch: int) -> StageInputs | None:
        """``stage_inputs`` as each stage's keyword arguments (None: none), checked against what
        the stages declare (:mod:`pipeq.control.stage_inputs`)."""
        if self._declared is None:
            self._declared = self._backend.declared_inputs()
        if given is None and not any(self._declared):  # the common case: nothing to route
            return None
        return route(given, self._declared, batch, self.schedule)

    @exclusive
    def predict(self, x: Any, stage_inputs: Mapping[Any, Any] | None = None) -> Any:
        """Forward only (eval mode, no grad), microbatched; returns the output on the CPU, shaped
        as the last stage returns it (a tensor, or a tuple / list / dict: tensors are joined
        again on dim 0). ``stage_inputs`` as in :meth:`step`."""
        self._require_running()
        x, n = check_batch("x", x)
        self._batcher.check_input(x)
        inputs = self._route(stage_inputs, n)
        sizes = self._batcher.sizes(n)
        self._step += 1
        outs = [microbatch.unpack(microbatch.spec_of(o), o) for o in self._backend.predict(self._step, sizes, x, inputs)]
        # a stage that returns one tensor (or a 1-tuple) gives that tensor
        outs = [o[0] if isinstance(o, tuple) and len(o) == 1 and isinstance(o[0], torch.Tensor) else o
                for o in outs]
        return microbatch.cat(outs)

    @exclusive
    def evaluate(self, batches: Iterable[tuple[Any, ...]],
                 metrics: Mapping[str, Callable[[Any, torch.Tensor], Any]] | None = None,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
        """Forward only over ``batches`` (an iterable of ``(x, target)`` or ``(x, target, stage_inputs)``, or one) and
        each metric's sample mean over them: ``{"loss": ..., "accuracy": ..., name: ...}``.

        ``metrics``: names to callables ``(output, target) -> float`` (the batch's mean), e.g.
        ``{"top3": top3}``; each batch's value is weighted by its samples, so the result is the
        mean over every sample of the set. ``loss`` is ``loss_fn``'s (default: the runner's;
        the cross-entropy of the class scores with Associated Learning), ``accuracy`` the argmax
        accuracy when every batch is a classification one (2-d float output, 1-d integer
        target); a metric of the same name replaces either. See :mod:`pipeq.control.evaluation`."""
        from pipeq.control import evaluation

        self._require_running()
        if loss_fn is None:
            loss_fn = self.schedule.eval_loss(self._batcher.loss_fn)
        elif not callable(loss_fn):
            raise ValueError("loss_fn must be callable as loss_fn(output, target)")
        return evaluation.evaluate(self.predict, batches, metrics, loss_fn)

    @property
    def last_step_lr(self) -> float | None:
        """The learning rate the last step handed back (by :meth:`step` or :meth:`stream`)
        trained with: the last stage's first parameter group's, as that step began. None before
        any step, or when the last stage has no optimizer."""
        return self._last_step_lr


def _first_batch(runner: PipelineRunner, x: Any, target: Any, stage_inputs: Any) -> None:
    """The first training batch (once running): the shapes between the stages checked, before any
    is sent (:mod:`pipeq.control.shape_check`); with ``schedule="auto"`` the schedule settled."""
    if not runner._running:
        return
    if runner._shape_model is not None:
        checked, _, n = runner._batcher.training_pair(x, target)  # a bad batch: said here as by _submit
        shape_check.check_first_batch(runner, checked, n, stage_inputs)
    if runner._auto is not None:
        runner._settle_auto((x, target, stage_inputs))


def _signature() -> inspect.Signature:
    """The runner's signature as ``help()`` and IDEs show it: every setting by name, with its
    default (the constructor takes them as ``**settings``, which build a RunConfig)."""
    own = [p for p in list(inspect.signature(PipelineRunner.__init__).parameters.values())[1:]
           if p.kind is not inspect.Parameter.VAR_KEYWORD]
    settings = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
                for f in setting_fields()]
    return inspect.Signature(own + settings)


PipelineRunner.__signature__ = _signature()  # type: ignore[attr-defined]


def _configure(config: RunConfig | None, schedule: Any, microbatches: int | None,
               settings: dict[str, Any]) -> RunConfig:
    """The run's configuration: ``config``, or the one the keyword arguments name."""
    if config is None:
        return RunConfig.from_kwargs("1f1b" if schedule is None else schedule,
                                     8 if microbatches is None else microbatches, **settings)
    if not isinstance(config, RunConfig):
        raise ValueError(f"config must be a pipeq.RunConfig, got {type(config).__name__}")
    if settings:
        raise ValueError(f"pass the run's settings in config or as keyword arguments, not both: got config and "
                         f"{', '.join(sorted(settings))}")
    given = {k: v for k, v in (("schedule", schedule), ("microbatches", microbatches)) if v is not None}
    return dataclasses.replace(config, **given) if given else config


def _backend(cfg: RunConfig, model: checks.Model, numerics: Numerics, tp_plans: list[Any] | None,
             rendezvous: Rendezvous | None) -> Any:
    """The backend that runs the stages: this process's (simulated) or one process per stage."""
    from pipeq.control.replica_loss import check_replicas_mode

    check_replicas_mode(cfg, multi_host=rendezvous is not None)
    place, schedule = cfg.placement, cfg.schedule
    if place.mode == "simulated":
        from pipeq.runtime.simulated import SimulatedBackend

        return SimulatedBackend(model.replicas[0], schedule, place.devices[0] if place.devices else "cpu", numerics)
    from pipeq.control.driver import ProcessBackend

    return ProcessBackend(checks.process_payloads(model, schedule), RunSetup(cfg, numerics, tp_plans),
                          rendezvous=rendezvous)


def _settle(runner: PipelineRunner, batch: tuple[Any, Any, Any] | None) -> None:
    """``schedule="auto"`` settled: the schedule chosen (profiled with ``batch``, the first step's,
    when there is one; see :mod:`pipeq.control.auto_schedule`), the ranking printed once, the
    backend built and started."""
    from pipeq.control import auto_schedule
    from pipeq.schedules.choose import format_choice

    assert runner._auto is not None
    (model, tp_plans, rendezvous), runner._auto = runner._auto, None
    place, n, m = runner.config.placement, runner.n_stages, runner.microbatches
    can = place.data_parallel == 1 and place.tensor_parallel == 1 and rendezvous is None
    args = None
    if batch is not None and can:
        x, target, size = runner._batcher.training_pair(batch[0], batch[1])
        declared = [] if model.builder is not None else [info_of(s.module).inputs for s in model.replicas[0]]
        inputs = (route(batch[2], declared, size, runner.schedule)
                  if declared and (batch[2] is not None or any(declared)) else None)
        args = (runner._batcher.shards(target, size), x, target, inputs)
    device = place.devices[0] if place.devices else "cpu"
    try:
        choice = auto_schedule.decide(model, runner.numerics, n, m, args, device=device, can_profile=can,
                                      stages_per_process=place.stages_per_process or 1)
    except Exception as exc:  # a profile that fails is no reason not to train: ZB-H1, said so
        why = str(exc).splitlines()[0] if str(exc) else ""
        print(f"pipeq: schedule='auto' could not profile the stages ({type(exc).__name__}: {why}); "
              "choosing at equal costs", file=sys.stderr)
        choice = auto_schedule.decide(model, runner.numerics, n, m, None, can_profile=False,
                                      stages_per_process=place.stages_per_process or 1)
    runner.auto_choice = choice
    print(format_choice(choice), file=sys.stderr)
    runner.config = cfg = dataclasses.replace(runner.config, schedule=choice.schedule, auto=False)
    runner.schedule = cfg.schedule
    runner._batcher = Batcher(cfg.schedule, n, m, model.loss_fn, model.aux_loss, place.data_parallel)
    runner._backend = _backend(cfg, model, runner.numerics, tp_plans, rendezvous)
    if runner._running:
        runner._backend.start()
