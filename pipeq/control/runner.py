"""``pipeq.PipelineRunner``: the embedding API.

    runner = pipeq.PipelineRunner(stages, loss_fn=nn.CrossEntropyLoss(),
                                  optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                  schedule="1f1b", microbatches=8)
    with runner:                          # starts one process per stage; exit stops them all
        loss = runner.step(x, target)     # one optimizer step on the whole batch -> mean loss
        loss = runner.step(x, target, stage_inputs={"mask": m})  # m straight to the stages taking it
        out = runner.predict(x)           # forward only -> CPU tensor
        state = runner.state_dict()       # keys as in the flat model nn.Sequential(*layers)

The runner checks its arguments (a :class:`~pipeq.RunConfig`, built once) and the
schedule (a dry run with the real stage and microbatch counts) before anything starts. Its jobs are
its collaborators' (``control/``: lifecycle, feed, streaming, state, snapshots); the stages run on
a :class:`~pipeq.runtime.backend.Backend`: :class:`~pipeq.control.driver.ProcessBackend`
(``mode="process"``, the default) or :class:`~pipeq.runtime.simulated.SimulatedBackend`.
"""

from __future__ import annotations

import collections
import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from pipeq import schedules
from pipeq.control import evaluation, streaming
from pipeq.control.assembly import BackendPlan, configure, processes_of, signature
from pipeq.control.config import RunConfig
from pipeq.control.exclusive import CallGuard, exclusive
from pipeq.control.feed import Feed
from pipeq.control.lifecycle import Lifecycle
from pipeq.control.shape_check import FirstBatchCheck, warm_up
from pipeq.control.snapshots import MemorySnapshot, SnapshotSchedule
from pipeq.control.state import StateAccess
from pipeq.control.streaming import InFlight
from pipeq.errors import PipelineError
from pipeq.stage import lr_schedulers
from pipeq.stage.spec import StageBuilder

if TYPE_CHECKING:
    from pipeq.control.batching import Batcher
    from pipeq.control.driver import ProcessBackend
    from pipeq.control.rendezvous import Rendezvous
    from pipeq.runtime.backend import Backend

__all__ = ["PipelineRunner"]


class PipelineRunner:
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

    _state: StateAccess  # the stages' state (pipeq.control.state), once the backend is built

    def __init__(self, stages: Sequence[nn.Module] | StageBuilder,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None,
                 optimizer: Callable[..., torch.optim.Optimizer] | None,
                 schedule: str | schedules.ScheduleFn | schedules.SchedulePolicy | None = None,
                 microbatches: int | None = None, *, config: RunConfig | None = None,
                 lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
                 lr_scheduler_interval: str | None = None, aux_heads: Sequence[nn.Module] | None = None,
                 aux_loss: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
                 balance: Sequence[int] | None = None, ties: Sequence[Sequence[str]] | None = None,
                 rendezvous: Rendezvous | None = None, **settings: Any) -> None:
        self._guard = CallGuard()  # one thread at a time (pipeq.control.exclusive)
        self.config = cfg = configure(config, schedule, microbatches, settings)
        plan = BackendPlan.of(stages, loss_fn, optimizer, cfg, lr_scheduler=lr_scheduler, aux_heads=aux_heads,
                              lr_scheduler_interval=lr_scheduler_interval, aux_loss=aux_loss, balance=balance,
                              ties=ties, rendezvous=rendezvous)
        place = cfg.placement
        self.numerics, self.lr_schedule = plan.numerics, plan.model.lr_schedule  # lr: see pipeq.stage.lr_schedulers
        self.schedule, self.n_stages, self.microbatches = cfg.schedule, plan.model.n_stages, cfg.microbatches
        self.mode, self.data_parallel, self.tensor_parallel = place.mode, place.data_parallel, place.tensor_parallel
        self.auto_choice: Any = None  # schedule="auto": the ranking that settled it (see _settle_auto)
        self._auto = plan if cfg.auto else None  # "auto": no backend until the first batch settles the schedule
        self._shapes = FirstBatchCheck.of(plan.model, cfg)  # at the first batch (pipeq.control.shape_check)
        self._feed = Feed(plan.batcher(cfg))  # batches -> steps (pipeq.control.feed)
        self._snapshots = SnapshotSchedule()  # in-memory snapshots (pipeq.control.snapshots)
        self._flight = InFlight(self._guard, self._snapshots)  # the steps in flight (pipeq.control.streaming)
        self._backend: Backend | None = None  # what runs the stages (pipeq.runtime.backend), once built
        self._processes: ProcessBackend | None = None  # the backend in process mode: what only it has
        self._life = Lifecycle(self.mode)  # built, running, closed (pipeq.control.lifecycle)
        if not cfg.auto:
            self._use(plan.backend(cfg), self._feed.batcher)

    def _use(self, backend: Backend, batcher: Batcher) -> None:
        """Run the stages on ``backend``, built for the run's schedule: each collaborator uses it."""
        self._backend, self._processes = backend, processes_of(backend, self.mode)
        self._feed.attach(backend, batcher)
        self._state = StateAccess(backend, self.n_stages)
        self._snapshots.backend = backend
        self._flight.attach(backend, self.schedule, self._processes.degraded if self._processes else None)

    def _live(self) -> Backend:
        """The backend, settled (``schedule="auto"``) and running, every step sent so far done."""
        if self._auto is not None and self._life.running:
            self._settle_auto(None)
        self._life.check()
        assert self._backend is not None, "a running runner's backend is settled"
        self._flight.settle()
        return self._backend

    # -- starting and stopping ------------------------------------------------------------------
    @exclusive
    def start(self) -> Any:
        """Start the stages (one process per stage in process mode) and return the runner;
        ``with runner:`` calls it. A runner starts once: one that ran and was closed refuses
        (build a new one and load the ``state_dict`` you kept). In process mode the runner
        must be started under the main script's ``if __name__ == "__main__":``."""
        self._life.start(self._backend, warm_up if self._shapes.pending else lambda: None)
        return self

    @exclusive
    def close(self) -> None:
        """Stop every stage (letting them finish what they were sent, up to ``stop_timeout``);
        the end of a ``with runner:`` block calls it. A closed runner cannot start again."""
        self._life.close(self._backend)

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.close()
        except PipelineError:
            if exc_type is None:  # else: do not mask the exception in flight with a shutdown error
                raise

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if self._life.running:
                self.close()

    # -- training and inference --------------------------------------------------------------
    @exclusive
    def step(self, x: Any, target: Any, stage_inputs: Mapping[Any, Any] | None = None) -> float:
        """One optimizer step on the whole batch ``(x, target)``; returns the mean loss. ``x`` and
        ``target``: tensors, or tuples / lists / dicts of them (every tensor split on dim 0);
        ``stage_inputs``: values handed straight to the stages that take them (see the class)."""
        self._first_batch(x, target, stage_inputs)
        self._live()
        return self._flight.hand_out(self._submit(x, target, stage_inputs))

    def _submit(self, x: Any, target: Any, given: Any = None, stream: bool = False) -> int:
        return self._flight.send(self._feed.training(x, target, given), stream)

    def _first_batch(self, x: Any, target: Any, stage_inputs: Any) -> None:
        """The first training batch (once running): the shapes between the stages checked, before
        any is sent (:mod:`pipeq.control.shape_check`); with ``schedule="auto"`` the schedule settled."""
        if self._life.running and self._shapes.pending:
            self._shapes.check(self._feed.batcher, x, target, stage_inputs)
        if self._life.running and self._auto is not None:
            self._settle_auto((x, target, stage_inputs))

    def _settle_auto(self, batch: tuple[Any, Any, Any] | None) -> None:
        """``schedule="auto"``: choose the schedule (profiled with ``batch``, the first step's, when
        there is one), print the ranking once, build and start the backend (:meth:`BackendPlan.settle`)."""
        plan = self._auto
        assert plan is not None
        choice, cfg = plan.settle(self.config, self._feed.batcher, batch)
        backend = plan.backend(cfg)  # (until here nothing changed: a bad batch raises, and the next one settles)
        self._auto, self.auto_choice, self.config, self.schedule = None, choice, cfg, cfg.schedule
        self._use(backend, plan.batcher(cfg))
        if self._life.running:
            backend.start()

    @exclusive
    def predict(self, x: Any, stage_inputs: Mapping[Any, Any] | None = None) -> Any:
        """Forward only (eval mode, no grad), microbatched; returns the output on the CPU, shaped
        as the last stage returns it (a tensor, or a tuple / list / dict: tensors are joined
        again on dim 0). ``stage_inputs`` as in :meth:`step`."""
        self._live()
        return self._feed.predict(x, stage_inputs)

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
        self._live()
        loss_fn = self.schedule.eval_loss(self._feed.batcher.loss_fn) if loss_fn is None else loss_fn
        return evaluation.evaluate(self.predict, batches, metrics, loss_fn)

    @exclusive
    def stream(self, batches: Iterable[tuple[Any, ...]], *, in_flight: int | None = None) -> Iterator[float]:
        """Train on every ``(x, target)`` of ``batches`` (any iterable; a DataLoader works), or
        ``(x, target, stage_inputs)`` (see :meth:`step`), and yield each batch's loss, in order,
        while the stages work on the batches behind it.

        The pipeline is filled once and drained once: at the end of ``batches``, when the
        iterator is closed (``break``: the batches already taken are finished first), and
        before anything that needs a consistent state (``step``, ``predict``, ``state_dict``,
        ``save``...). Every stage runs its batches in order, starting the next as soon as its
        own work and update for the previous one are done, so the losses and weights are those
        of ``[runner.step(x, y) for x, y in batches]``. At most ``in_flight`` batches are sent
        ahead (default: one more than the stages, enough to keep every stage busy), so memory
        stays bounded for an endless iterable.
        """
        if self._life.running and (self._auto is not None or self._shapes.pending):
            first, batches = streaming.peek(batches)  # the first batch checks the shapes, settles "auto"
            if isinstance(first, (tuple, list)) and len(first) in (2, 3):  # else: the stream says what is wrong
                self._first_batch(first[0], first[1], first[2] if len(first) > 2 else None)
        self._live()
        depth = streaming.depth(in_flight, self.n_stages, self.microbatches, self.config.queue_capacity)
        return self._flight.stream(iter(batches), depth, self._submit, lambda: self._life.running)

    # -- what the steps handed back trained with ----------------------------------------------
    @property
    def last_step_lr(self) -> float | None:
        """The learning rate the last step handed back (by :meth:`step` or :meth:`stream`)
        trained with: the last stage's first parameter group's, as that step began. None before
        any step, or when the last stage has no optimizer."""
        return self._flight.last_lr

    @property
    def degraded_steps(self) -> dict[int, int]:
        """``fault_tolerance="replicas"``: the training steps some replica did not complete (it
        failed), each with how many replicas did, e.g. ``{5: 1}``. Steps count from 1, in the
        order this runner handed their losses back (``step`` calls and stream batches alike)."""
        return dict(self._flight.degraded)

    @property
    def last_step_replicas(self) -> int | None:
        """How many replicas completed the last step handed back, when fewer than all (a replica
        failed in it, ``fault_tolerance="replicas"``); None when every replica did."""
        return self._flight.last_replicas

    @property
    def replica_failures(self) -> list[PipelineError]:
        """``fault_tolerance="replicas"``: the failures the run carried on after, in order (each
        names the stage and replica; the replica was rebuilt)."""
        loss = self._processes.replica_loss if self._processes is not None else None
        return list(loss.failures) if loss is not None else []

    @property
    def stage_processes(self) -> list[dict[str, Any]]:
        """One dict per stage (per shard), as its process reported it once started (process mode;
        ``[]`` before ``start`` and in simulated mode; the stages of a process that holds several,
        with virtual stages, share its ``pid``): ``pid``, ``host``, ``device``, ``threads`` and
        ``cores`` (those it is pinned to), ``replica``, ``stage`` and ``shard``, and the addresses
        its peers reach it at (``forward``, ``backward``; ``replica_link``, ``tie_link``: None
        without such peers). Each stage's shard 0 first, numbered ``replica * n_stages + stage``,
        then the other shards. It reads no stage: a monitor may read it from another thread."""
        every = self._processes.worker_info if self._processes is not None else []
        return [{k: v for k, v in info.items() if k not in ("layout", "inputs")} for info in every]

    # -- state (pipeq.control.state) -------------------------------------------------------------
    @exclusive
    def state_dict(self) -> "collections.OrderedDict[str, torch.Tensor]":
        """The model's parameters and buffers (CPU copies) under the flat model's names: those of
        ``nn.Sequential(*layers)``, where a stage that is an ``nn.Sequential`` contributes each of
        its children as one layer and any other stage itself (stage 1's ``0.weight`` after a
        two-layer stage 0 is ``2.weight``); ``pipeq.checkpoint.flat_model(stages)`` is that model.
        Checkpoints (:meth:`save`) and ``pipeq launch``'s model.pt use the same names."""
        self._live()
        return self._state.state_dict()

    @exclusive
    def model_state_dict(self) -> "dict[str, torch.Tensor]":
        """:meth:`state_dict` with each tied parameter also under its other names (one tensor),
        as the unsplit model's own ``state_dict()`` has it: ``model.load_state_dict(
        runner.model_state_dict())`` loads a run of :func:`pipeq.split`'s stages into the model."""
        self._live()
        return self._state.model_state_dict()

    @exclusive
    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load a state under the names of :meth:`state_dict` (also one split into another number
        of stages). Every key and shape is checked before any stage changes: a ``ValueError``
        names what does not fit, and the runner goes on. For compatibility, stage-prefixed keys
        (``nn.Sequential(*stages).state_dict()``, ``state_dict()`` of earlier pipeq versions) are
        accepted too. Tensors are copied into the stages' own dtypes, as ``nn.Module`` does."""
        self._live()
        self._state.load_state_dict(state)

    @exclusive
    def save(self, directory: str, meta: Mapping[str, Any] | None = None) -> None:
        """Write a checkpoint as ``directory``: every stage's parameters, buffers, optimizer and
        lr-scheduler state and RNG, under the flat model's names (those of :meth:`state_dict`;
        see :mod:`pipeq.checkpoint`). ``meta`` (plain JSON data) is stored in the manifest.

        The new checkpoint is written beside ``directory`` and swapped in once complete, so a
        checkpoint already there stays loadable until then, even if this process is killed; a
        directory holding anything but a checkpoint is refused (it is replaced as a whole)."""
        self._live()
        self._state.save(directory, meta)

    @exclusive
    def load(self, directory: str) -> dict[str, Any]:
        """Load a checkpoint written by :meth:`save`, also one saved with another number of
        stages (the same layers split differently); returns its ``meta``.

        Every name, shape and dtype is checked against the stages before anything is sent: a
        checkpoint that does not fit raises a ``ValueError`` (``pipeq.checkpoint.CheckpointError``)
        naming each tensor at fault, no stage changes, and the runner goes on."""
        self._live()
        return self._state.load(directory)

    @exclusive
    def stats(self, reset_peak: bool = False) -> list[dict[str, Any]]:
        """One dict per stage: ``peak_bytes``, the stage's peak memory since the start or the
        last ``reset_peak=True`` (CUDA: allocated bytes; CPU: the stage process's peak resident
        set; ``memory`` says which), ``skipped_steps`` (steps skipped for non-finite gradients:
        ``precision="fp16"``, ``check_finite="skip"``), ``recompute`` and ``shm_waits`` (how often
        one of the stage's sends found every shared-memory slot of its channel in use: raise
        ``shm_slots`` if it grows). In simulated mode the peak is this process's; with
        ``tensor_parallel``, shard 0's (each shard holds its own part of the stage)."""
        return self._live().stats(reset_peak)

    @exclusive
    def scheduler_step(self, metric: float | None = None) -> None:
        """Step every stage's lr scheduler once (every replica's), with ``lr_scheduler_interval=
        "epoch"``: e.g. at the end of each epoch. ``metric`` is what a ``ReduceLROnPlateau``
        monitors (e.g. the evaluation's loss) and is required for it; other schedulers take none.
        Anything else is refused with a ``ValueError`` before any stage is told."""
        value = lr_schedulers.check_metric(self.lr_schedule, metric)
        self._live().scheduler_step(value)

    @exclusive
    def learning_rates(self) -> list[list[float]]:
        """Every stage's current learning rates, one per parameter group of its optimizer (AL
        layers: f and b's groups, then g and h's); ``[]`` for a stage without parameters."""
        return self._live().learning_rates()

    # -- in-memory snapshots (pipeq.control.snapshots) -------------------------------------------
    def keep_snapshots(self, every: int, first_step: int = 0) -> None:
        """Take an in-memory snapshot after every ``every``-th training step (0: none), counting
        steps from ``first_step`` (a resumed run's step: the runner's own count starts at 0;
        ``predict`` and ``evaluate`` do not count), so that a snapshot's
        :attr:`MemorySnapshot.step` is the caller's step number."""
        self._snapshots.keep(every, first_step)

    @property
    @exclusive
    def snapshot(self) -> MemorySnapshot | None:
        """The newest complete in-memory snapshot (None: none yet); never waits. It stays
        readable after a failure has closed the runner."""
        return self._snapshots.newest()

    @exclusive
    def restore_snapshot(self, snap: MemorySnapshot) -> None:
        """Load ``snap`` (of a runner with the same stages) into every stage and replica: the
        state it was taken in, without touching the disk."""
        self._live()
        self._state.restore(snap)


# help() and IDEs show every setting by name, with its default (the constructor takes them as **settings)
PipelineRunner.__signature__ = signature(PipelineRunner.__init__)  # type: ignore[attr-defined]
