"""``pipeq.PipelineRunner``: the embedding API.

    runner = pipeq.PipelineRunner(stages, loss_fn=nn.CrossEntropyLoss(),
                                  optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                  schedule="1f1b", microbatches=8)
    with runner:                          # starts one process per stage; exit stops them all
        loss = runner.step(x, target)     # one optimizer step on the whole batch -> mean loss
        out = runner.predict(x)           # forward only -> CPU tensor
        state = runner.state_dict()       # keys as in the flat model nn.Sequential(*layers)

The runner checks its arguments and the schedule (a dry run with the real stage and microbatch
counts) before anything starts, splits each batch into microbatches, and hands the work to a
backend: :class:`~pipeq.driver.ProcessBackend` (``mode="process"``, the default) or
:class:`~pipeq.simulated.SimulatedBackend` (``mode="simulated"``, every stage in this process).
"""

from __future__ import annotations

import collections
import os
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from pipeq.stage import microbatch
from pipeq.control import options
from pipeq import schedules
from pipeq.control.batching import Batcher, check_batch
from pipeq.errors import PipelineError
from pipeq.runtime.executors import StageBuilder
from pipeq.control.processes import StageSettings

if TYPE_CHECKING:
    from pipeq import checkpoint
    from pipeq.control.rendezvous import Rendezvous


class PipelineRunner:
    """Train ``stages`` (one ``nn.Module`` per pipeline stage) with a pipeline schedule.

    Args:
        stages: the model, split into stages; stage k's output is stage k+1's input: a tuple is
            spread over its arguments, anything else (a tensor, a list, a dict of tensors and
            constants) is its one argument. ``step``, ``stream`` and ``predict`` take ``x`` and
            ``target`` the same ways (see :mod:`pipeq.microbatch`). In process mode they must be picklable. Or a
            :class:`pipeq.Recipe` (importable names, as in a job file) from which each stage
            process builds its own stage; then ``loss_fn`` and ``optimizer`` are None (the
            recipe names them). Multi-host runs need a recipe.
        loss_fn: ``loss_fn(output, target)`` on the last stage; reduction 'mean' or 'sum'.
        optimizer: called with one stage's parameters, e.g. ``partial(torch.optim.SGD, lr=0.1)``.
        schedule: a name (``"1f1b"``, ``"fill-drain"`` alias ``"gpipe"``, ``"global"``,
            ``"local"``, ``"pairwise"``, ``"async"``, ``"al"``), a schedule object with its
            options (``pipeq.schedules.Interlock("nwise", distance=2)``,
            ``AsyncOneFOneB(weight_stashing=False)``, ``AssociatedLearning(first_loss="mse")``),
            or your own schedule function ``(n_stages, n_microbatches) -> per-stage lists of
            F(j), B(j), STEP`` (module level, so that stage processes can import it); it is
            validated and dry-run for deadlock here, before anything starts.
        microbatches: microbatches per step (a smaller batch uses one sample per microbatch).
        lr_scheduler: called with each stage's optimizer, e.g.
            ``partial(torch.optim.lr_scheduler.StepLR, step_size=10)``; stepped with the
            optimizer on every stage: once per training step (once per microbatch with
            ``"async"`` and ``"al"``, which update after every microbatch).
        lr_scheduler_interval: ``"step"`` (default: as above) or ``"epoch"``: the stages never
            step the scheduler themselves, :meth:`scheduler_step` steps every stage's (every
            replica's) once, e.g. at the end of each epoch, with the metric a
            ``ReduceLROnPlateau`` monitors (which needs ``"epoch"``). With a recipe, the recipe
            sets it.
        mode: ``"process"`` (one process per stage) or ``"simulated"`` (all in this process).
        devices: one device string per stage; default ``cuda:k`` round-robin when CUDA is
            available, else ``cpu`` with each stage pinned to its share of the CPU cores.
        threads_per_stage: torch threads per stage process (default: cores / stages, at least 1).
        transport: ``"ipc"`` (Unix sockets, one host) or ``"tcp"``.
        host: the address stages bind to with ``transport="tcp"``.
        tcp_security: how TCP sockets are protected: ``"encrypt"`` (default; CURVE on every
            socket: encrypted and authenticated) or ``"authenticate"`` (CURVE on the control
            channel, a Poly1305 MAC on every data message: no encryption of activations and gradients,
            2-3x the bandwidth at 4-64 MiB). Either way only holders of the job's secret get in:
            this runner makes one, a multi-host run takes it from ``rendezvous.secret``.
        max_message_mb: the largest tensor (MiB) one stage sends another; a larger frame is
            refused by the receiving stage before it is buffered, and the sender fails naming it.
        shm_slots: with ``transport="ipc"``, a message's tensors of 64 KiB or more cross to the
            next (previous) stage through shared memory: each channel has this many reusable
            slots (a sender waits while all are in use), 0 sends everything in ZeroMQ frames
            (:mod:`pipeq.shm`). Other transports ignore it.
        heartbeat_interval, heartbeat_timeout: seconds; a stage silent for longer is failed.
        step_timeout: seconds a stage may spend in one compute action (a forward, a backward, an
            optimizer step) before the run fails with a PipelineError naming the stage and the
            action (a stage alive, heartbeating, but stuck in its own computation; its waiting
            neighbours are not blamed). Judged from each stage's heartbeats, so only a stage
            that stops making progress fails, never a step that is merely long. Default None:
            off, as a library cannot know how long one action of a user's model may
            legitimately take (a first CUDA compile, huge microbatches, a starved CPU);
            ``pipeq launch`` sets 300 s. Must be longer than ``heartbeat_interval``.
            Process mode only (a simulated run has no stage processes to watch).
        start_timeout: seconds to wait for every stage to start.
        stop_timeout: seconds ``close()`` lets the stages finish what they were sent before they
            are terminated (a failure is raised then).
        spin: seconds a stage waiting for a message busy-polls (yielding its core to anything
            else runnable) before it blocks: a blocked process wakes up 0.1-0.5 ms later on a
            virtual machine, on every hop. 0 never spins (least CPU, most latency).
        start_method: ``"spawn"`` (default: every stage a fresh interpreter importing torch,
            all at once: 4-9 s for 3 stages on 2 busy cores) or ``"forkserver"`` (stages fork
            from a server that imports torch once: 2-4 s for the first runner of a process,
            ~0.1 s for later ones; the server lives on until this process exits).
            Both run the main script again in each stage: start the runner under
            ``if __name__ == "__main__":`` (it refuses otherwise).
        rendezvous: a :class:`pipeq.rendezvous.Rendezvous` for a multi-host run (this process
            is node 0; the other nodes run ``pipeq launch ... --node-rank r``); its stages bind
            to ``rendezvous.bind`` over TCP.
        placement: stages per node, e.g. ``[[0], [1, 2]]`` (default: an even, contiguous split).
        trace: a file path: every stage records each action it runs (forward, backward,
            optimizer step, send, waiting for input) and ``close()`` writes one merged Chrome
            trace-event JSON file there (Perfetto, chrome://tracing; ``pipeq report`` reads it).
        aux_heads, aux_loss: interlocking schedules: one head per stage but the last (stage k's
            reads stage k's output) and their loss (default cross-entropy).
        data_parallel: R replicas of the pipeline (R x N processes), gradients all-reduced.
        tensor_parallel, tp_plan: each stage split over T processes of one host (R x N x T
            processes), on torch's DTensor (:mod:`pipeq.tensorpar`). ``tp_plan`` has one plan per
            stage: a dict mapping submodule names (``stage.get_submodule(name)``; ``""`` is the
            stage itself) to ``"colwise"``
            or ``"rowwise"`` (torch's ``ColwiseParallel`` / ``RowwiseParallel``, or such objects),
            ``{}`` for a stage left whole, or a callable ``(stage_module, mesh) -> module``. A
            "colwise" entry with no "rowwise" after it gathers its output: a stage always hands
            on whole tensors, from its shard 0, once. With ``data_parallel``, each shard's
            gradients are summed with the same shard of the other replicas. States and
            checkpoints hold whole tensors (they load at any T). Fill-drain, 1F1B and your own
            schedules; not yet with precision, clipping, check_finite or recompute.
        precision: ``"fp32"`` (default), ``"bf16"`` (autocast to bfloat16 on CPU and CUDA: the
            forward and the loss run under ``torch.autocast``; parameters, gradients and the
            optimizer stay float32) or ``"fp16"`` (autocast to float16 with dynamic loss scaling,
            torch.amp.GradScaler's: the found-inf check is combined over every stage and replica,
            so all of them step or skip together, as one GradScaler on the whole model would).
        clip_grad_norm: clip the gradients by their global norm over every stage (after the
            replicas' all-reduce, after fp16's unscaling), as ``torch.nn.utils.clip_grad_norm_``
            on the whole model does; ``clip_norm_type`` is its p (2.0, or ``float('inf')``).
        check_finite: ``"raise"`` (or True): check the input, every stage's outputs, the losses and
            the gradients, and fail with a PipelineError naming the stage and microbatch where the
            first NaN or Inf appeared, before any optimizer step changes a weight. ``"skip"``:
            skip the optimizer step on every stage when any gradient is not finite (the step's loss
            may be anything; :meth:`stats` counts the skipped steps). Default False: no checks.
        recompute: True, or one boolean per stage: the stage keeps only its inputs between a
            microbatch's forward and backward and recomputes the forward in the backward (the same
            RNG state, so the same dropout masks): the same numbers, less activation memory.
        Precision, clipping, check_finite and recompute run with fill-drain, 1F1B and your own
        schedules (interlocking, async and AL compute their own way).
        balance: layer counts per stage (``[3, 2, 1]``, or ``pipeq.balance(model, n_stages,
            sample)``, which measures them) when ``stages`` is the whole model as one
            ``nn.Sequential``: its children are split into stages of that many layers each
            (``pipeq.balance.split``; every replica gets the same split).

    Names: :meth:`state_dict`, :meth:`load_state_dict`, :meth:`save` / :meth:`load` and
    ``pipeq launch``'s model.pt all name tensors as the flat model ``nn.Sequential(*layers)``
    does (``pipeq.checkpoint.flat_model(stages)``): a stage that is an ``nn.Sequential``
    contributes each of its children as one layer. Checkpoints hold every stage's parameters,
    optimizer and scheduler state; one loads into another split of the same layers.

    ``runner.lr_schedule`` (a :class:`pipeq.lr_schedulers.LRSchedule`) says how the lr schedulers
    are stepped: its ``interval``, and whether they take a metric (ReduceLROnPlateau).
    """

    def __init__(
        self,
        stages: "Sequence[nn.Module] | StageBuilder",
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None,
        optimizer: Callable[..., torch.optim.Optimizer] | None,
        schedule: str | schedules.ScheduleFn = "1f1b",
        microbatches: int = 8,
        *,
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        lr_scheduler_interval: str | None = None,
        mode: str = "process",
        devices: Sequence[str] | None = None,
        threads_per_stage: int | None = None,
        transport: str = "ipc",
        host: str = "127.0.0.1",
        tcp_security: str = "encrypt",
        max_message_mb: int = 256,
        shm_slots: int = 4,
        queue_capacity: int | None = None,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 15.0,
        step_timeout: float | None = None,
        start_timeout: float = 120.0,
        spin: float = 0.01,
        start_method: str = "spawn",
        stop_timeout: float = 60.0,
        rendezvous: "Rendezvous | None" = None,
        placement: Sequence[Sequence[int]] | None = None,
        trace: str | None = None,
        aux_heads: Sequence[nn.Module] | None = None,
        aux_loss: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
        data_parallel: int = 1,
        tensor_parallel: int = 1,
        tp_plan: Sequence[Any] | None = None,
        precision: str = "fp32",
        clip_grad_norm: float | None = None,
        clip_norm_type: float = 2.0,
        check_finite: "bool | str" = False,
        recompute: "bool | Sequence[bool]" = False,
        balance: Sequence[int] | None = None,
        **moved: Any,
    ) -> None:
        options.refuse_moved(moved)
        if balance is not None:  # the whole model, split here (pipeq.balance)
            from pipeq.balance import stages_for

            stages = stages_for(stages, balance)
        self.schedule = schedule = schedules.resolve(schedule)
        schedules.get_schedule(schedule)  # an unknown name is refused with the list of names
        model = options.check_model(stages, loss_fn, optimizer, lr_scheduler, schedule, aux_heads=aux_heads,
                                    aux_loss=aux_loss, data_parallel=data_parallel, mode=mode,
                                    rendezvous=rendezvous, lr_scheduler_interval=lr_scheduler_interval)
        self.lr_schedule = model.lr_schedule  # who steps the lr schedulers (pipeq.lr_schedulers)
        self._last_step_lr: float | None = None
        options.check_run(model.n_stages, microbatches, mode=mode, devices=devices,
                          threads_per_stage=threads_per_stage, transport=transport, start_method=start_method,
                          queue_capacity=queue_capacity, trace=trace, heartbeat_interval=heartbeat_interval,
                          heartbeat_timeout=heartbeat_timeout, tcp_security=tcp_security,
                          max_message_mb=max_message_mb, step_timeout=step_timeout, shm_slots=shm_slots)
        self.numerics = options.check_numerics(schedule, model.n_stages, devices, precision=precision,
                                               clip_grad_norm=clip_grad_norm, clip_norm_type=clip_norm_type,
                                               check_finite=check_finite, recompute=recompute)
        tp_plans = options.check_tensor_parallel(model, schedule, tensor_parallel, tp_plan, mode=mode,
                                                 numerics=self.numerics)
        self.tensor_parallel = tensor_parallel
        self.n_stages, self.microbatches, self.mode = model.n_stages, microbatches, mode
        self.data_parallel = data_parallel
        self._batcher = Batcher(schedule, model.n_stages, microbatches, model.loss_fn, model.aux_loss,
                                data_parallel)
        self._stage_layouts: list[Any] | None = None  # see _layouts
        self._aux_heads = model.aux_loss is not None  # heads given, or named by the recipe
        if mode == "simulated":
            from pipeq.runtime.simulated import SimulatedBackend

            self._backend: Any = SimulatedBackend(model.replicas[0], schedule, devices[0] if devices else "cpu",
                                                  self.numerics)
        else:
            from pipeq.control.driver import ProcessBackend

            settings = StageSettings(devices, threads_per_stage, queue_capacity or max(64, 4 * microbatches),
                                     heartbeat_interval, spin, trace is not None, tcp_security, max_message_mb,
                                     self.numerics, shm_slots, tensor_parallel, tp_plans)
            self._backend = ProcessBackend(
                options.process_payloads(model, schedule), schedule, settings, replicas=data_parallel,
                loss_stages=schedules.loss_stages(schedule, model.n_stages),
                output_stage=schedules.output_stage(schedule, model.n_stages), microbatches=microbatches,
                transport=transport, host=host,
                start_method=start_method, heartbeat_timeout=heartbeat_timeout, step_timeout=step_timeout,
                start_timeout=start_timeout,
                stop_timeout=stop_timeout, rendezvous=rendezvous, placement=placement,
                trace_path=os.fspath(trace) if trace is not None else None)
        self._queue_capacity = queue_capacity or max(64, 4 * microbatches)
        self._step = 0
        self._submitted: collections.deque[int] = collections.deque()  # steps whose loss is not back
        self._losses: dict[int, float] = {}  # losses collected early (settle), not yet handed out
        self._undrained = False  # a stream left work behind (see _settle)
        self._running = False
        self._used = False

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> "PipelineRunner":
        if self._running:
            return self
        if self._used:
            raise PipelineError(
                "this runner has already run and been closed; a restart would begin again from "
                "the stages' initial weights. Create a new runner (and load_state_dict the "
                "state_dict you kept) instead"
            )
        if self.mode == "process":  # each stage process runs the main script again
            options.check_main_guard()
        self._used = True
        self._backend.start()
        self._running = True
        return self

    def close(self) -> None:
        if self._running:
            self._running = False
            self._backend.close()

    def __enter__(self) -> "PipelineRunner":
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the exception in flight with a shutdown error
            try:
                self.close()
            except PipelineError:
                pass

    def __del__(self) -> None:
        try:
            if getattr(self, "_running", False):
                self.close()
        except Exception:
            pass

    def _require_running(self) -> None:
        """The pipeline runs, and every step sent so far is done (a consistent state)."""
        if not self._running:
            raise PipelineError("the pipeline is not running; use 'with runner:' or runner.start()")
        self._settle()

    # -- training and inference --------------------------------------------------------------
    def step(self, x: Any, target: Any) -> float:
        """One optimizer step on the whole batch ``(x, target)``; returns the mean loss. ``x`` and
        ``target``: tensors, or tuples / lists / dicts of them (every tensor split on dim 0)."""
        self._require_running()
        return self._hand_out(self._submit(x, target))

    def stream(self, batches: Iterable[tuple[Any, Any]], *, in_flight: int | None = None) -> Iterator[float]:
        """Train on every ``(x, target)`` of ``batches`` (any iterable; a DataLoader works) and
        yield each batch's loss, in order, while the stages work on the batches behind it.

        The pipeline is filled once and drained once: at the end of ``batches``, when the
        iterator is closed (``break``: the batches already taken are finished first), and
        before anything that needs a consistent state (``step``, ``predict``, ``state_dict``,
        ``save``...). Every stage runs its batches in order, starting the next as soon as its
        own work and update for the previous one are done, so the losses and weights are those
        of ``[runner.step(x, y) for x, y in batches]``. At most ``in_flight`` batches are sent
        ahead (default: one more than the stages, enough to keep every stage busy), so memory
        stays bounded for an endless iterable.
        """
        self._require_running()
        if in_flight is None:
            in_flight = max(1, min(self.n_stages + 1, self._queue_capacity // self.microbatches))
        elif type(in_flight) is not int or in_flight < 1:
            raise ValueError(f"in_flight must be a positive integer, got {in_flight!r}")
        elif in_flight * self.microbatches > self._queue_capacity:
            raise ValueError(
                f"in_flight={in_flight} batches of {self.microbatches} microbatches can put "
                f"{in_flight * self.microbatches} messages in a stage's queue, over queue_capacity="
                f"{self._queue_capacity}: lower in_flight or raise the runner's queue_capacity")
        return self._stream(iter(batches), in_flight)

    def _stream(self, batches: Iterator[tuple[Any, Any]], in_flight: int) -> Iterator[float]:
        mine: collections.deque[int] = collections.deque()
        exhausted = False
        try:
            while True:
                while not exhausted and len(mine) < in_flight and not self._backend.failing:
                    try:
                        x, target = next(batches)
                    except StopIteration:
                        exhausted = True
                        break
                    mine.append(self._submit(x, target, stream=True))
                if not mine:
                    break
                yield self._hand_out(mine.popleft())
        except BaseException as exc:
            # closed early (break), or the data raised: the batches already sent are finished, so
            # the runner is consistent again. A pipeline failure has already stopped everything;
            # Ctrl-C does not wait for them either (anything needing a consistent state still does).
            if not isinstance(exc, (PipelineError, KeyboardInterrupt)) and self._running:
                self._settle()
            raise
        self._settle()  # the end of the batches: drained once

    def _submit(self, x: Any, target: Any, stream: bool = False) -> int:
        x, target, n = self._batcher.training_pair(x, target)
        shards = self._batcher.shards(target, n)
        self._step += 1
        self._backend.submit(self._step, shards, x, target, stream)
        self._submitted.append(self._step)
        self._undrained |= stream and isinstance(self.schedule, schedules.AsyncOneFOneB)
        return self._step

    def _result(self, step: int) -> float:
        if step in self._losses:
            return self._losses.pop(step)
        self._submitted.remove(step)
        return self._backend.result(step)

    def _hand_out(self, step: int) -> float:
        """Step ``step``'s loss, noting the learning rate it trained with (:attr:`last_step_lr`)."""
        loss = self._result(step)
        self._last_step_lr = self._backend.step_lrs.pop(step, None)
        return loss

    def _settle(self) -> None:
        """Wait until every step sent so far is done (their losses are kept for their stream),
        and drain what a stream left (asynchronous 1F1B's last backwards)."""
        while self._submitted:
            step = self._submitted.popleft()
            self._losses[step] = self._backend.result(step)
        if self._undrained:
            self._undrained = False
            self._backend.drain()

    def predict(self, x: Any) -> Any:
        """Forward only (eval mode, no grad), microbatched; returns the output on the CPU, shaped
        as the last stage returns it (a tensor, or a tuple / list / dict: tensors are joined
        again on dim 0)."""
        self._require_running()
        x, n = check_batch("x", x)
        self._batcher.check_input(x)
        sizes = self._batcher.sizes(n)
        self._step += 1
        outs = [microbatch.unpack(microbatch.tree_of(o), o) for o in self._backend.predict(self._step, sizes, x)]
        # a stage that returns one tensor (or a 1-tuple) gives that tensor
        outs = [o[0] if isinstance(o, tuple) and len(o) == 1 and isinstance(o[0], torch.Tensor) else o
                for o in outs]
        return microbatch.cat(outs)

    def stats(self, reset_peak: bool = False) -> list[dict[str, Any]]:
        """One dict per stage: ``peak_bytes``, the stage's peak memory since the start or the
        last ``reset_peak=True`` (CUDA: allocated bytes; CPU: the stage process's peak resident
        set; ``memory`` says which), ``skipped_steps`` (steps skipped for non-finite gradients:
        ``precision="fp16"``, ``check_finite="skip"``), ``recompute`` and ``shm_waits`` (how often
        one of the stage's sends found every shared-memory slot of its channel in use: raise
        ``shm_slots`` if it grows). In simulated mode the peak is this process's; with
        ``tensor_parallel``, shard 0's (each shard holds its own part of the stage)."""
        self._require_running()
        return self._backend.stats(reset_peak)

    def evaluate(self, batches: Iterable[tuple[Any, Any]],
                 metrics: Mapping[str, Callable[[Any, torch.Tensor], Any]] | None = None,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
        """Forward only over ``batches`` (an iterable of ``(x, target)``, or one such pair) and
        each metric's sample mean over them: ``{"loss": ..., "accuracy": ..., name: ...}``.

        ``metrics``: names to callables ``(output, target) -> float`` (the batch's mean), e.g.
        ``{"top3": top3}``; each batch's value is weighted by its samples, so the result is the
        mean over every sample of the set. ``loss`` is ``loss_fn``'s (default: the runner's;
        the cross-entropy of the class scores with Associated Learning), ``accuracy`` the argmax
        accuracy when every batch is a classification one (2-d float output, 1-d integer
        target); a metric of the same name replaces either. See :mod:`pipeq.evaluation`."""
        from pipeq.control import evaluation

        self._require_running()
        if loss_fn is None:
            al = isinstance(self.schedule, schedules.AssociatedLearning)
            loss_fn = nn.CrossEntropyLoss() if al else self._batcher.loss_fn
        elif not callable(loss_fn):
            raise ValueError("loss_fn must be callable as loss_fn(output, target)")
        return evaluation.evaluate(self.predict, batches, metrics, loss_fn)

    # -- learning-rate schedule ------------------------------------------------------------------
    def scheduler_step(self, metric: float | None = None) -> None:
        """Step every stage's lr scheduler once (every replica's), with ``lr_scheduler_interval=
        "epoch"``: e.g. at the end of each epoch. ``metric`` is what a ``ReduceLROnPlateau``
        monitors (e.g. the evaluation's loss) and is required for it; other schedulers take none.
        Anything else is refused with a ``ValueError`` before any stage is told."""
        from pipeq.stage import lr_schedulers

        value = lr_schedulers.check_metric(self.lr_schedule, metric)
        self._require_running()
        self._backend.scheduler_step(value)

    def learning_rates(self) -> list[list[float]]:
        """Every stage's current learning rates, one per parameter group of its optimizer (AL
        layers: f and b's groups, then g and h's); ``[]`` for a stage without parameters."""
        self._require_running()
        return self._backend.learning_rates()

    @property
    def last_step_lr(self) -> float | None:
        """The learning rate the last step handed back (by :meth:`step` or :meth:`stream`)
        trained with: the last stage's first parameter group's, as that step began. None before
        any step, or when the last stage has no optimizer."""
        return self._last_step_lr

    # -- state ---------------------------------------------------------------------------------
    def _layouts(self) -> "list[checkpoint.StageLayout]":
        """Every stage's names, layers, shapes and dtypes (asked once; they never change)."""
        from pipeq import checkpoint

        if self._stage_layouts is None:
            self._stage_layouts = [checkpoint.StageLayout(**lay) for lay in self._backend.layouts()]
        return self._stage_layouts

    def state_dict(self) -> "collections.OrderedDict[str, torch.Tensor]":
        """The model's parameters and buffers (CPU copies) under the flat model's names: those of
        ``nn.Sequential(*layers)``, where a stage that is an ``nn.Sequential`` contributes each of
        its children as one layer and any other stage itself (stage 1's ``0.weight`` after a
        two-layer stage 0 is ``2.weight``); ``pipeq.checkpoint.flat_model(stages)`` is that model.
        Checkpoints (:meth:`save`) and ``pipeq launch``'s model.pt use the same names."""
        from pipeq import checkpoint

        self._require_running()
        return checkpoint.global_state(self._backend.get_state(), self._layouts())

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load a state under the names of :meth:`state_dict` (also one split into another number
        of stages). Every key and shape is checked before any stage changes: a ``ValueError``
        names what does not fit, and the runner goes on. For compatibility, stage-prefixed keys
        (``nn.Sequential(*stages).state_dict()``, ``state_dict()`` of earlier pipeq versions) are
        accepted too. Tensors are copied into the stages' own dtypes, as ``nn.Module`` does."""
        from pipeq import checkpoint

        self._require_running()
        self._backend.set_state(checkpoint.split_state(state, self._layouts()))

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self, directory: str, meta: Mapping[str, Any] | None = None) -> None:
        """Write a checkpoint as ``directory``: every stage's parameters, buffers, optimizer and
        lr-scheduler state and RNG, under the flat model's names (those of :meth:`state_dict`;
        see :mod:`pipeq.checkpoint`). ``meta`` (plain JSON data) is stored in the manifest.

        The new checkpoint is written beside ``directory`` and swapped in once complete, so a
        checkpoint already there stays loadable until then, even if this process is killed; a
        directory holding anything but a checkpoint is refused (it is replaced as a whole)."""
        from pipeq import checkpoint

        self._require_running()
        checkpoint.save(directory, self._backend.get_snapshots(), dict(meta or {}))

    def load(self, directory: str) -> dict[str, Any]:
        """Load a checkpoint written by :meth:`save`, also one saved with another number of
        stages (the same layers split differently); returns its ``meta``.

        Every name, shape and dtype is checked against the stages before anything is sent: a
        checkpoint that does not fit raises a ``ValueError`` (``pipeq.checkpoint.CheckpointError``)
        naming each tensor at fault, no stage changes, and the runner goes on."""
        from pipeq import checkpoint

        self._require_running()
        ckpt = checkpoint.load(directory)
        self._backend.restore(checkpoint.split(ckpt, self._layouts()))
        return dict(ckpt.meta)
