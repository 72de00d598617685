"""``pipeq.PipelineRunner``: the embedding API.

    runner = pipeq.PipelineRunner(stages, loss_fn=nn.CrossEntropyLoss(),
                                  optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                  schedule="1f1b", microbatches=8)
    with runner:                          # starts the stage processes; exit stops them all
        loss = runner.step(x, target)     # one optimizer step on the whole batch -> mean loss
        loss = runner.step(x, target, stage_inputs={"mask": m})  # m straight to the stages taking it
        out = runner.predict(x)           # forward only -> CPU tensor
        state = runner.state_dict()       # keys as in the flat model nn.Sequential(*layers)

The runner checks its arguments (a :class:`~pipeq.RunConfig`, built once) and the
schedule (a dry run with the real stage and microbatch counts) before anything starts. Its jobs are
its collaborators': :class:`~pipeq.control.pipeline.Pipeline` holds the backend that runs the stages
and hands it to the others (``control/``: lifecycle, feed, streaming, state, snapshots); the stages run on
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
from pipeq.control import evaluation
from pipeq.control.assembly import BackendPlan, configure, signature, uncompiled
from pipeq.control.config import RunConfig
from pipeq.control.exclusive import CallGuard, exclusive
from pipeq.control.pipeline import Pipeline
from pipeq.control.reports import StageMemory
from pipeq.control.snapshots import MemorySnapshot
from pipeq.errors import PipelineError
from pipeq.stage.spec import StageBuilder

if TYPE_CHECKING:
    from pipeq.control.rendezvous import Rendezvous

__all__ = ["PipelineRunner"]


class PipelineRunner:
    """Train ``stages`` (one ``nn.Module`` per pipeline stage) with a pipeline schedule.

    Args: Model and training
        stages: the model, split into stages; stage k's output is stage k+1's input: a tuple is spread over its
            arguments, anything else (a tensor, a list, a dict of tensors and constants) is its one argument.
            ``step``, ``stream`` and ``predict`` take ``x`` and ``target`` the same ways (see
            :mod:`pipeq.stage.microbatch`). In process mode they must be picklable. Or a :class:`pipeq.Recipe`
            (importable names, as in a job file) from which each stage process builds its own stage; then
            ``loss_fn`` and ``optimizer`` are None (the recipe names them). Multi-host runs need a recipe.
        loss_fn: ``loss_fn(output, target)`` on the last stage; reduction 'mean' or 'sum'.
        optimizer: called with one stage's parameters, e.g. ``partial(torch.optim.SGD, lr=0.1)``.
        lr_scheduler: called with each stage's optimizer, e.g. ``partial(torch.optim.lr_scheduler.StepLR,
            step_size=10)``; stepped with the optimizer on every stage: once per training step (once per
            microbatch with ``"async"`` and ``"al"``, which update after every microbatch).
        lr_scheduler_interval: ``"step"`` (default: as above) or ``"epoch"``: the stages never step the
            scheduler themselves, :meth:`scheduler_step` steps every stage's (every replica's) once, e.g. at the
            end of each epoch, with the metric a ``ReduceLROnPlateau`` monitors (which needs ``"epoch"``). With
            a recipe, the recipe sets it. ``runner.lr_schedule`` (a :class:`pipeq.LRSchedule`) says how the
            schedulers are stepped: its ``interval``, and whether they take a metric.
        balance: layer counts per stage (``[3, 2, 1]``, or ``pipeq.balance(model, n_stages, sample)``, which
            measures them) when ``stages`` is the whole model as one ``nn.Sequential``: its children are split
            into stages of that many layers each (``pipeq.balance.split``; every replica gets the same split).
        ties: parameters several stages use (a tied embedding and LM head), as groups of their :meth:`state_dict`
            names, ``[["0.weight", "5.weight"]]``: each stage keeps a copy, the copies' gradients are summed before
            every step (bitwise-equal copies, one process's numbers), and :meth:`state_dict` and checkpoints hold
            the tensor once, under the first name. Sharing between stages that is not tied is refused.

    Args: Schedule
        schedule: a name (``"1f1b"``, ``"zb-h1"``, ``"zbv"``, ``"interleaved-1f1b"``...: ``pipeq.SCHEDULES``
            has them all), a schedule object with its options (``pipeq.research.Interlock("nwise",
            distance=2)``), ``"auto"`` (chosen at the first ``step`` from two profiled steps on copies of the
            stages, see :mod:`pipeq.control.auto_schedule`; the ranking is printed and kept as
            ``auto_choice``), or your own schedule function ``(n_stages, n_microbatches) -> per-stage lists of
            F(j), B(j) (or I(j) then W(j)), STEP`` (module level, so that stage processes can import it); it is
            validated and dry-run for deadlock here, before anything starts.
        microbatches: microbatches per step (a smaller batch uses one sample per microbatch).
        aux_heads: interlocking schedules: one head per stage but the last (stage k's reads stage k's output).
        aux_loss: interlocking schedules: the auxiliary heads' loss (default cross-entropy).

    Keyword Args: Multi-host and configuration
        rendezvous: a :class:`pipeq.Rendezvous` for a multi-host run (this process is node 0; the others run
            ``pipeq launch ... --node-rank r``); its stages bind to ``rendezvous.bind`` over TCP.
        config: a :class:`~pipeq.RunConfig` holding the schedule, microbatches and every setting below,
            instead of keyword arguments (not both).

    Settings: every other keyword argument builds the run's :class:`~pipeq.RunConfig` (checked once, before
    anything starts); its default is in the signature, its meaning in the RunConfig part that holds it:

    - :class:`~pipeq.NumericsConfig`: precision, clip_grad_norm, clip_norm_type, check_finite, recompute, loss_weighting,
      compile
    - :class:`~pipeq.WireConfig`: transport, host, tcp_security, max_message_mb, shm_slots, queue_capacity, spin,
      trusted_network
    - :class:`~pipeq.FaultConfig`: heartbeat_interval, heartbeat_timeout, step_timeout, start_timeout,
      stop_timeout, fault_tolerance
    - :class:`~pipeq.PlacementConfig`: mode, devices, threads_per_stage, start_method, placement,
      data_parallel, tensor_parallel, tp_plan, stages_per_process, sharding, shard_size, fsdp_reshard
    - :class:`~pipeq.RunConfig`: trace, auto_memory_limit

    Threads: one at a time. A call while another thread is inside the runner (a ``step``; a ``stream``
    between two batches is not) raises a :class:`~pipeq.PipelineError` at once and changes nothing.

    Stage inputs: ``step``, ``predict`` (and ``stream`` / ``evaluate``, with ``(x, target, stage_inputs)``
    batches) take ``stage_inputs``, values the driver hands straight to the stages that use them (an attention
    mask, position ids), split into microbatches like x: stage k is called as ``module(*what_it_receives,
    **its_inputs)``. ``{"mask": m}`` goes to every stage whose ``pipeq_stage`` declares ``"mask"``
    (:class:`pipeq.StageInfo`; ``pipeq.split`` sets it), ``{2: {"mask": m}}`` to stage 2.
    """

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
        stages, cfg = uncompiled(stages, configure(config, schedule, microbatches, settings))
        self.config = cfg
        plan = BackendPlan.of(stages, loss_fn, optimizer, cfg, lr_scheduler=lr_scheduler, aux_heads=aux_heads,
                              lr_scheduler_interval=lr_scheduler_interval, aux_loss=aux_loss, balance=balance,
                              ties=ties, rendezvous=rendezvous)
        place = cfg.placement
        self.numerics, self.lr_schedule = plan.numerics, plan.model.lr_schedule  # lr: see pipeq.stage.lr_schedulers
        self.schedule, self.n_stages, self.microbatches = cfg.schedule, plan.model.n_stages, cfg.microbatches
        self.mode, self.data_parallel, self.tensor_parallel = place.mode, place.data_parallel, place.tensor_parallel
        self.auto_choice: Any = None  # schedule="auto": the ranking that settled it (see _settled)
        self._pipeline = Pipeline(plan, cfg, self._guard, self._settled)  # the stages' backend and its users

    def _settled(self, choice: Any, cfg: RunConfig) -> None:
        """``schedule="auto"`` settled at the first batch: the schedule chosen, and the run's configuration."""
        self.auto_choice, self.config, self.schedule = choice, cfg, cfg.schedule

    # -- starting and stopping ------------------------------------------------------------------
    @exclusive
    def start(self) -> Any:
        """Start the stages (one process per stage in process mode) and return the runner; ``with runner:`` calls it.
        A runner starts once: one that ran and was closed refuses (build a new one and load the ``state_dict`` you
        kept). In process mode the runner must be started under the main script's ``if __name__ == "__main__":``."""
        self._pipeline.start()
        return self

    @exclusive
    def close(self, *, failed: bool = False) -> None:
        """Stop every stage (letting them finish what they were sent, up to ``stop_timeout``), as a ``with``
        block's end does; ``failed`` (it raised): other nodes exit non-zero. A closed runner cannot start again."""
        self._pipeline.close(failed)

    __enter__ = start  # (returns the runner)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        with contextlib.suppress(*(() if exc_type is None else (PipelineError,))):  # not masking the one in flight
            self.close(failed=exc_type is not None and issubclass(exc_type, Exception))  # (not Ctrl-C)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if self._pipeline.life.running:
                self.close()

    # -- training and inference, and what the steps handed back trained with ------------------
    @exclusive
    def step(self, x: Any, target: Any = None, stage_inputs: Mapping[Any, Any] | None = None) -> float:
        """One optimizer step on the whole batch ``(x, target)``; returns the mean loss. ``x``, ``target``:
        tensors, or tuples / lists / dicts of them (split on dim 0), or :class:`pipeq.Microbatches` (lengths
        may differ; of pairs, no target); ``stage_inputs``: handed straight to the stages that take them (see
        the class). A dict ``x`` (a ``BatchEncoding``) is matched to the stages' inputs, or refused first."""
        return self._pipeline.train(x, target, stage_inputs)

    @exclusive
    def predict(self, x: Any, stage_inputs: Mapping[Any, Any] | None = None) -> Any:
        """Forward only (eval mode, no grad), microbatched; returns the output on the CPU, shaped as the last stage
        returns it (a tensor, or a tuple / list / dict: tensors are joined again on dim 0; of
        :class:`pipeq.Microbatches`, one per microbatch; a Hugging Face ``ModelOutput`` of :func:`pipeq.split`'s
        stages as its class). ``x``, ``stage_inputs``: see :meth:`step`."""
        return self._pipeline.predict(x, stage_inputs)

    @exclusive
    def evaluate(self, batches: Iterable[tuple[Any, ...]],
                 metrics: Mapping[str, Callable[[Any, torch.Tensor], Any]] | None = None,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
        """Forward only over ``batches`` (an iterable of ``(x, target)`` or ``(x, target, stage_inputs)``, or one)
        and each metric's sample mean over them (the loss's: ``loss_weighting``'s): ``{"loss": ..., name: ...}``.

        ``metrics``: names to callables ``(output, target) -> float`` (the batch's mean), e.g. ``{"top3": top3}``;
        each batch's value is weighted by its samples, so the result is the mean over every sample of the set.
        ``loss`` is ``loss_fn``'s (default: the runner's; the cross-entropy of the class scores with Associated
        Learning), ``accuracy`` the argmax accuracy when every batch is a classification one (2-d float output, 1-d
        integer target); a metric of the same name replaces either. See :mod:`pipeq.control.evaluation`."""
        return evaluation.evaluate(self.predict, batches, metrics, *self._pipeline.eval_loss(loss_fn))

    @exclusive
    def stream(self, batches: Iterable[tuple[Any, ...]], *, in_flight: int | None = None) -> Iterator[float]:
        """Train on every ``(x, target)`` of ``batches`` (any iterable; a DataLoader works), or ``(x, target,
        stage_inputs)`` (see :meth:`step`), and yield each batch's loss, in order, while the stages work on the
        batches behind it.

        The pipeline is filled once and drained once: at the end of ``batches``, when the iterator is closed
        (``break``: the batches already taken are finished first), and before anything that needs a consistent state
        (``step``, ``predict``, ``state_dict``, ``save``...). Every stage runs its batches in order, starting the
        next as soon as its own work and update for the previous one are done, so the losses and weights are those
        of ``[runner.step(x, y) for x, y in batches]``. At most ``in_flight`` batches are sent ahead (default: one
        more than the stages, enough to keep every stage busy), so memory stays bounded for an endless iterable."""
        return self._pipeline.stream(batches, in_flight)

    @property
    def last_step_lr(self) -> float | None:
        """The learning rate the last step handed back (by :meth:`step` or :meth:`stream`)
        trained with: the last stage's first parameter group's, as that step began. None before
        any step, or when the last stage has no optimizer."""
        return self._pipeline.flight.last_lr

    @property
    def degraded_steps(self) -> dict[int, int]:
        """``fault_tolerance="replicas"``: the training steps some replica did not complete (it failed), each
        with how many did, e.g. ``{5: 1}``; steps count from 1 as their losses were handed back."""
        self._pipeline.flight.sweep()
        return dict(self._pipeline.flight.degraded)

    @property
    def degraded_stages(self) -> dict[int, dict[int, list[int]]]:
        """The same steps -> stage -> the replicas it summed, for the stages that summed fewer than all."""
        self._pipeline.flight.sweep()
        return {step: dict(row) for step, row in self._pipeline.flight.degraded_stages.items()}

    steps_sent = property(lambda self: self._pipeline.feed.sent, doc="Steps sent, training and predict: stages name 1 to it.")
    last_step_replicas = property(lambda self: self._pipeline.flight.last_replicas,
                                  doc="How many replicas completed the last step handed back, when fewer than all; else None.")

    @property
    def replica_failures(self) -> list[PipelineError]:
        """The failures the run carried on after, in order (each names its stage and replica, rebuilt)."""
        return self._pipeline.replica_failures()

    @property
    def stage_processes(self) -> list[dict[str, Any]]:
        """One dict per stage (per shard), as its process reported it once started (``[]`` before ``start``
        and in simulated mode; a process's stages share its ``pid``): ``pid``, ``host``, ``device``,
        ``threads`` and ``cores`` (those it is pinned to), ``replica``, ``stage``, ``shard``, and the addresses
        its peers reach it at (``forward``, ``backward``; ``tie_link``: None without such
        peers). Each stage's shard 0 first, numbered ``replica * n_stages + stage``, then the other shards.
        It reads no stage: a monitor may read it from another thread."""
        return self._pipeline.stage_processes()

    # -- state (pipeq.control.state) -------------------------------------------------------------
    @exclusive
    def state_dict(self) -> "collections.OrderedDict[str, torch.Tensor]":
        """The model's parameters and buffers (CPU copies) under the flat model's names: those of
        ``nn.Sequential(*layers)``, where a stage that is an ``nn.Sequential`` contributes each of
        its children as one layer and any other stage itself (stage 1's ``0.weight`` after a
        two-layer stage 0 is ``2.weight``); ``pipeq.checkpoint.flat_model(stages)`` is that model.
        Checkpoints (:meth:`save`) and ``pipeq launch``'s model.pt use the same names."""
        return self._pipeline.state().state_dict()

    @exclusive
    def model_state_dict(self) -> "dict[str, torch.Tensor]":
        """:meth:`state_dict` with each tied parameter also under its other names (one tensor),
        as the unsplit model's own ``state_dict()`` has it: ``model.load_state_dict(
        runner.model_state_dict())`` loads a run of :func:`pipeq.split`'s stages into the model."""
        return self._pipeline.state().model_state_dict()

    @exclusive
    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load a state under the names of :meth:`state_dict` (also one split into another number
        of stages). Every key and shape is checked before any stage changes: a ``ValueError``
        names what does not fit, and the runner goes on. For compatibility, stage-prefixed keys
        (``nn.Sequential(*stages).state_dict()``, ``state_dict()`` of earlier pipeq versions) are
        accepted too. Tensors are copied into the stages' own dtypes, as ``nn.Module`` does."""
        self._pipeline.state().load_state_dict(state)

    @exclusive
    def save(self, directory: str, meta: Mapping[str, Any] | None = None) -> None:
        """Write a checkpoint as ``directory``: every stage's parameters, buffers, optimizer and
        lr-scheduler state and RNG, under the flat model's names (those of :meth:`state_dict`;
        see :mod:`pipeq.checkpoint`). ``meta`` (plain JSON data) is stored in the manifest.

        The new checkpoint is written beside ``directory`` and swapped in once complete, so a
        checkpoint already there stays loadable until then, even if this process is killed; a
        directory holding anything but a checkpoint is refused (it is replaced as a whole)."""
        self._pipeline.state().save(directory, meta)

    @exclusive
    def load(self, directory: str) -> dict[str, Any]:
        """Load a checkpoint written by :meth:`save`, also one saved with another number of
        stages (the same layers split differently); returns its ``meta``.

        Every name, shape and dtype is checked against the stages before anything is sent: a
        checkpoint that does not fit raises a ``ValueError`` (``pipeq.checkpoint.CheckpointError``)
        naming each tensor at fault, no stage changes, and the runner goes on."""
        return self._pipeline.state().load(directory)

    @exclusive
    def stats(self, reset_peak: bool = False) -> list[dict[str, Any]]:
        """One dict per stage: ``peak_bytes``, the stage's peak memory since the start or the
        last ``reset_peak=True`` (CUDA: allocated bytes; CPU: the stage process's peak resident set;
        ``memory`` says which), ``skipped_steps`` (``precision="fp16"``, ``check_finite="skip"``), ``recompute``,
        ``shm_waits`` (sends that found every shared-memory slot in use: raise ``shm_slots``) and, with ``compile``,
        ``compile_s``, ``compiles``, ``recompiles``, ``graph_breaks``, ``compile_cache_hits`` (pipeq.stage.compiled),
        ``backward_split`` ("I+W", "whole: <why>", None: pipeq.stage.split_backward).
        In simulated mode the peak is this process's; with ``tensor_parallel``, shard 0's (each holds its part)."""
        return self._pipeline.reports().stats(reset_peak)

    @exclusive
    def memory(self) -> list[StageMemory]:
        """Every byte each stage of each replica holds (:class:`pipeq.StageMemory`): parameters, gradients, optimizer
        state, and the activations' peak in the last measured training step beside the schedule's prediction."""
        return self._pipeline.reports().memory()

    @exclusive
    def scheduler_step(self, metric: float | None = None) -> None:
        """Step every stage's lr scheduler once (every replica's), with ``lr_scheduler_interval="epoch"``: e.g.
        at the end of each epoch. ``metric`` is what a ``ReduceLROnPlateau`` monitors (e.g. the evaluation's
        loss), required for it; other schedulers take none. Else a ``ValueError``, before any stage is told."""
        self._pipeline.reports().scheduler_step(metric)

    @exclusive
    def learning_rates(self) -> list[list[float]]:
        """Every stage's current learning rates, one per parameter group of its optimizer (AL
        layers: f and b's groups, then g and h's); ``[]`` for a stage without parameters."""
        return self._pipeline.reports().learning_rates()

    # -- in-memory snapshots (pipeq.control.snapshots) -------------------------------------------
    def keep_snapshots(self, every: int, first_step: int = 0) -> None:
        """Take an in-memory snapshot after every ``every``-th training step (0: none), counting steps from
        ``first_step`` (a resumed run's step: the runner's own count starts at 0; ``predict`` and ``evaluate`` do
        not count), so that a snapshot's :attr:`MemorySnapshot.step` is the caller's step number."""
        self._pipeline.snapshots.keep(every, first_step)

    @property
    @exclusive
    def snapshot(self) -> MemorySnapshot | None:
        """The newest complete in-memory snapshot (None: none yet); never waits. It stays
        readable after a failure has closed the runner."""
        return self._pipeline.snapshots.newest()

    @exclusive
    def restore_snapshot(self, snap: MemorySnapshot) -> None:
        """Load ``snap`` (of a runner with the same stages) into every stage and replica: the
        state it was taken in, without touching the disk."""
        self._pipeline.state().restore(snap)


# help() and IDEs show every setting by name, with its default (the constructor takes them as **settings)
PipelineRunner.__signature__ = signature(PipelineRunner.__init__)  # type: ignore[attr-defined]
