"""``pipeq.PipelineRunner``: the embedding API.

    runner = pipeq.PipelineRunner(stages, loss_fn=nn.CrossEntropyLoss(),
                                  optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                  schedule="1f1b", microbatches=8)
    with runner:                          # starts one process per stage; exit stops them all
        loss = runner.step(x, target)     # one optimizer step on the whole batch -> mean loss
        out = runner.predict(x)           # forward only -> CPU tensor
        state = runner.state_dict()       # keys as in nn.Sequential(*stages).state_dict()

The runner checks its arguments and the schedule (a dry run with the real stage and microbatch
counts) before anything starts, splits each batch into microbatches, and hands the work to a
backend: :class:`~pipeq.driver.ProcessBackend` (``mode="process"``, the default) or
:class:`~pipeq.simulated.SimulatedBackend` (``mode="simulated"``, every stage in this process).
"""

from __future__ import annotations

import collections
import os
import pickle
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
from torch import nn

from . import schedules
from .errors import PipelineError
from .stage import loss_weight_mode, microbatch_weights
from .worker import StageBuilder

if TYPE_CHECKING:
    from .rendezvous import Rendezvous

MODES = ("process", "simulated")
TRANSPORTS = ("ipc", "tcp")


def split_sizes(batch: int, microbatches: int) -> list[int]:
    """Sizes of ``min(microbatches, batch)`` near-equal microbatches (larger ones first)."""
    m = min(microbatches, batch)
    base, rem = divmod(batch, m)
    return [base + 1] * rem + [base] * (m - rem)


class PipelineRunner:
    """Train ``stages`` (one ``nn.Module`` per pipeline stage) with a pipeline schedule.

    Args:
        stages: the model, split into stages; stage k's output is stage k+1's input (a tensor
            or a tuple of tensors). In process mode they must be picklable. Or a
            :class:`pipeq.Recipe` (importable names, as in a job file) from which each stage
            process builds its own stage; then ``loss_fn`` and ``optimizer`` are None (the
            recipe names them). Multi-host runs need a recipe.
        loss_fn: ``loss_fn(output, target)`` on the last stage; reduction 'mean' or 'sum'.
        optimizer: called with one stage's parameters, e.g. ``partial(torch.optim.SGD, lr=0.1)``.
        schedule: ``"1f1b"`` or ``"fill-drain"`` (alias ``"gpipe"``), or your own schedule
            function ``(n_stages, n_microbatches) -> per-stage lists of F(j), B(j), STEP``
            (module level, so that stage processes can import it); it is validated and
            dry-run for deadlock here, before anything starts.
        microbatches: microbatches per step (a smaller batch uses one sample per microbatch).
        lr_scheduler: called with each stage's optimizer, e.g.
            ``partial(torch.optim.lr_scheduler.StepLR, step_size=10)``; stepped with the
            optimizer on every stage: once per training step (once per microbatch with
            ``"async"`` and ``"al"``, which update after every microbatch).
        mode: ``"process"`` (one process per stage) or ``"simulated"`` (all in this process).
        devices: one device string per stage; default ``cuda:k`` round-robin when CUDA is
            available, else ``cpu`` with each stage pinned to its share of the CPU cores.
        threads_per_stage: torch threads per stage process (default: cores / stages, at least 1).
        transport: ``"ipc"`` (Unix sockets, one host) or ``"tcp"``.
        host: the address stages bind to with ``transport="tcp"``.
        heartbeat_interval, heartbeat_timeout: seconds; a stage silent for longer is failed.
        start_timeout: seconds to wait for every stage to start.
        stop_timeout: seconds ``close()`` lets the stages finish what they were sent before they
            are terminated (a failure is raised then).
        spin: seconds a stage waiting for a message busy-polls (yielding its core to anything
            else runnable) before it blocks: a blocked process wakes up 0.1-0.5 ms later on a
            virtual machine, on every hop. 0 never spins (least CPU, most latency).
        start_method: ``"spawn"`` (default: a fresh interpreter per stage, ~2 s to start) or
            ``"forkserver"`` (stages fork from a server that has torch imported: ~50 ms; the
            server process lives on until this process exits).
        rendezvous: a :class:`pipeq.rendezvous.Rendezvous` for a multi-host run (this process
            is node 0; the other nodes run ``pipeq launch ... --node-rank r``); its stages bind
            to ``rendezvous.bind`` over TCP.
        placement: stages per node, e.g. ``[[0], [1, 2]]`` (default: an even, contiguous split).
        trace: a file path: every stage records each action it runs (forward, backward,
            optimizer step, send, waiting for input) and ``close()`` writes one merged Chrome
            trace-event JSON file there (Perfetto, chrome://tracing; ``pipeq report`` reads it).

    Checkpoints: :meth:`save` / :meth:`load` write and read every stage's parameters, optimizer
    and scheduler state under the flat model's names (see :mod:`pipeq.checkpoint`); a
    checkpoint loads into another split of the same layers.
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
        mode: str = "process",
        devices: Sequence[str] | None = None,
        threads_per_stage: int | None = None,
        transport: str = "ipc",
        host: str = "127.0.0.1",
        queue_capacity: int | None = None,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 15.0,
        start_timeout: float = 120.0,
        spin: float = 0.01,
        start_method: str = "spawn",
        stop_timeout: float = 60.0,
        rendezvous: "Rendezvous | None" = None,
        placement: Sequence[Sequence[int]] | None = None,
        trace: str | None = None,
        aux_heads: Sequence[nn.Module] | None = None,
        aux_loss: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
        interlock_distance: int | None = None,
        weight_stashing: bool = True,
        data_parallel: int = 1,
        al_first_loss: str = "ce",
        al_inference_layer: int | None = None,
    ) -> None:
        if al_inference_layer is not None and (
            schedule == "al" or isinstance(schedule, schedules.AssociatedLearning)
        ):
            schedule = schedules.AssociatedLearning(al_inference_layer)
        schedule = schedules.resolve(schedule, interlock_distance)
        is_al = isinstance(schedule, schedules.AssociatedLearning)
        if not is_al and (al_first_loss != "ce" or al_inference_layer is not None):
            raise ValueError(f"al_first_loss / al_inference_layer apply to schedule 'al' only, not "
                             f"{schedules.schedule_name(schedule)!r}")
        if type(data_parallel) is not int or data_parallel < 1:
            raise ValueError(f"data_parallel must be a positive integer, got {data_parallel!r}")
        replica_stages = None
        if data_parallel > 1:
            if mode != "process":
                raise ValueError("data_parallel > 1 runs R x N stage processes: use mode='process'")
            if is_al or isinstance(schedule, schedules.AsyncOneFOneB):
                raise ValueError(
                    f"schedule {schedules.schedule_name(schedule)!r} updates after every microbatch; "
                    "replicas would have to all-reduce every microbatch: data_parallel is not "
                    "supported with it (use fill-drain, 1f1b or an interlocking schedule)"
                )
            if isinstance(stages, (list, tuple)) and stages and all(isinstance(s, (list, tuple)) for s in stages):
                if len(stages) != data_parallel:
                    raise ValueError(f"{len(stages)} replica stage lists for data_parallel={data_parallel}")
                replica_stages = [list(s) for s in stages]
                stages = replica_stages[0]
        builder: StageBuilder | None = None
        if isinstance(stages, StageBuilder):  # a job's recipe (pipeq launch, multi-host)
            if is_al or isinstance(schedule, schedules.Interlock):
                raise ValueError(
                    f"schedule {schedules.schedule_name(schedule)!r} is not available from job recipes "
                    "yet; embed PipelineRunner with modules (and aux_heads / pipeq.al layers)"
                )
            builder = stages
            if loss_fn is not None or optimizer is not None or lr_scheduler is not None:
                raise ValueError("with a stage recipe, the loss, optimizer and scheduler come from it: "
                                 "pass loss_fn=None, optimizer=None")
            n = builder.count_stages()  # type: ignore[attr-defined]
            loss_fn = builder.loss_fn()  # type: ignore[attr-defined]
            optimizer = builder.optimizer_factory()  # type: ignore[attr-defined]
            lr_scheduler = builder.scheduler_factory()  # type: ignore[attr-defined]
            if mode == "simulated":  # build them here, as the stage processes would
                stages = [builder.build(k, n)[0] for k in range(n)]
                builder = None
            else:
                stages = [nn.Module()] * n  # placeholders: the stage processes build the real ones
        elif rendezvous is not None:
            raise ValueError(
                "a multi-host run builds each stage on its own host from importable names: pass "
                "a job recipe (pipeq.job.Recipe, or use pipeq launch) instead of modules"
            )
        if is_al and loss_fn is None:
            loss_fn = nn.MSELoss()  # the associated and autoencoder losses' criterion
        if isinstance(stages, nn.Module) or not isinstance(stages, (list, tuple)) or not stages:
            raise ValueError("stages must be a non-empty list of nn.Module, one per pipeline stage")
        for k, s in enumerate(stages):
            if not isinstance(s, nn.Module):
                raise ValueError(f"stage {k} is a {type(s).__name__}, not an nn.Module")
        if not callable(loss_fn):
            raise ValueError("loss_fn must be callable as loss_fn(output, target)")
        if lr_scheduler is not None and not callable(lr_scheduler):
            raise ValueError(
                "lr_scheduler must be a factory called with one stage's optimizer, e.g. "
                "functools.partial(torch.optim.lr_scheduler.StepLR, step_size=10)"
            )
        loss_weight_mode(loss_fn)
        if not callable(optimizer):
            raise ValueError(
                "optimizer must be a factory called with one stage's parameters, e.g. "
                "functools.partial(torch.optim.SGD, lr=0.1)"
            )
        schedules.get_schedule(schedule)
        if type(microbatches) is not int or microbatches < 1:
            raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if devices is not None and len(devices) != len(stages):
            raise ValueError(f"devices names {len(devices)} device(s) for {len(stages)} stages")
        if threads_per_stage is not None and (type(threads_per_stage) is not int or threads_per_stage < 1):
            raise ValueError(f"threads_per_stage must be a positive integer, got {threads_per_stage!r}")
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
        if queue_capacity is not None and (type(queue_capacity) is not int or queue_capacity < microbatches):
            raise ValueError(
                f"queue_capacity={queue_capacity!r} is too small: a stage may hold every "
                f"microbatch of a step, so it must be an integer >= microbatches ({microbatches})"
            )
        if devices is not None:
            for k, d in enumerate(devices):
                try:
                    dev = torch.device(d)
                except (RuntimeError, TypeError) as exc:
                    raise ValueError(f"devices[{k}] = {d!r} is not a device: {exc}") from None
                if dev.type == "cuda" and not torch.cuda.is_available():
                    raise ValueError(f"devices[{k}] = {d!r}, but CUDA is not available here")
                if dev.type not in ("cpu", "cuda"):
                    raise ValueError(f"devices[{k}] = {d!r}: pipeq runs stages on 'cpu' or 'cuda'")
        interlocking = isinstance(schedule, schedules.Interlock)
        if aux_heads is not None or aux_loss is not None:
            if not interlocking:
                raise ValueError(
                    f"aux_heads/aux_loss train with the interlocking schedules ({', '.join(schedules.INTERLOCK)}), "
                    f"not with {schedules.schedule_name(schedule)!r}"
                )
            if aux_heads is None or len(aux_heads) != len(stages) - 1 or not all(
                isinstance(h, nn.Module) for h in aux_heads
            ):
                raise ValueError(
                    f"aux_heads must be a list of {len(stages) - 1} nn.Module (one per stage but the "
                    f"last, stage k's head reading stage k's output), got {aux_heads!r}"
                )
            if aux_loss is not None and not callable(aux_loss):
                raise ValueError("aux_loss must be callable as aux_loss(head_output, target)")
        if interlocking and aux_heads is None and schedule.distance(len(stages)) < len(stages) - 1:
            raise ValueError(
                f"schedule {schedules.schedule_name(schedule)!r} trains with auxiliary heads: pass "
                f"aux_heads=[head_0, ..., head_{len(stages) - 2}] (one per stage but the last)"
            )
        if al_first_loss not in ("ce", "mse"):
            raise ValueError(f"al_first_loss must be 'ce' or 'mse', got {al_first_loss!r}")
        if is_al and builder is None:
            from .al import ALLayer

            if schedule.inference_layer is not None and schedule.inference_layer >= len(stages):
                raise ValueError(f"al_inference_layer={schedule.inference_layer} but there are only "
                                 f"{len(stages)} AL layers (stages 0..{len(stages) - 1})")
            for k, st in enumerate(stages):
                if not isinstance(st, ALLayer):
                    raise ValueError(
                        f"stage {k} is a {type(st).__name__}: schedule 'al' trains pipeq.al.ALLayer "
                        "stages (f, b, g, h); build them with pipeq.al.build_al"
                    )
        if type(weight_stashing) is not bool:
            raise ValueError(f"weight_stashing must be True or False, got {weight_stashing!r}")
        if builder is None:
            self._check_untied(stages)
        if trace is not None and (not isinstance(trace, (str, os.PathLike)) or mode != "process"):
            raise ValueError(
                f"trace={trace!r}: give a file path, in process mode (a simulated run has no "
                "timeline worth tracing: every stage runs in this one process)"
            )
        if heartbeat_timeout <= heartbeat_interval:
            raise ValueError("heartbeat_timeout must be longer than heartbeat_interval")
        # Refuse a schedule that cannot run before any process starts.
        schedules.build(schedule, len(stages), microbatches)
        self._checked_counts = {microbatches}

        self.n_stages = len(stages)
        self.data_parallel = data_parallel
        self._loss_fn = loss_fn
        self.schedule = schedule
        self.microbatches = microbatches
        self.mode = mode
        self._stage_shapes: list[dict[str, tuple[int, ...]]] | None = None
        if builder is None:
            self._stage_shapes = [
                {name: tuple(t.shape) for name, t in s.state_dict().items()} for s in stages
            ]
        if mode == "process":
            from .driver import ProcessBackend

            if builder is None:
                self._check_picklable(stages, loss_fn, optimizer, schedule, lr_scheduler,
                                      {f"aux_heads[{k}]": h for k, h in enumerate(aux_heads or [])}
                                      | ({"aux_loss": aux_loss} if aux_loss is not None else {}))
                payloads: list[Any] = [
                    pickle.dumps((s, loss_fn if k == len(stages) - 1 else None, optimizer, lr_scheduler,
                                  self._extras(k, aux_heads, aux_loss, weight_stashing, al_first_loss,
                                              loss_fn if is_al else None)))
                    for copy in (replica_stages or [stages] * data_parallel)  # replica r's stages
                    for k, s in enumerate(copy)
                ]
                if replica_stages is not None:
                    self._check_replicas(replica_stages)
            else:
                self._check_picklable([], None, None, schedule, None)
                payloads = [builder] * (len(stages) * data_parallel)
            self._backend: Any = ProcessBackend(
                payloads, schedule,
                devices=devices, threads_per_stage=threads_per_stage, transport=transport,
                host=host, queue_capacity=queue_capacity or max(64, 4 * microbatches),
                heartbeat_interval=heartbeat_interval, heartbeat_timeout=heartbeat_timeout,
                start_timeout=start_timeout, spin_s=spin, start_method=start_method,
                stop_timeout=stop_timeout, rendezvous=rendezvous, placement=placement,
                trace=os.fspath(trace) if trace is not None else None, microbatches=microbatches,
                target_stages=(list(range(len(stages))) if interlocking else [0] if is_al
                               else [len(stages) - 1]),
                output_stage=0 if is_al else None, replicas=data_parallel,
            )
        else:
            from .simulated import SimulatedBackend

            self._backend = SimulatedBackend(
                stages, loss_fn, optimizer, schedule, devices[0] if devices else "cpu",
                lr_scheduler=lr_scheduler,
                extras=[self._extras(k, aux_heads, aux_loss, weight_stashing, al_first_loss,
                                     loss_fn if is_al else None) for k in range(len(stages))],
            )
        self._aux_heads = aux_heads is not None
        self._aux_loss = aux_loss if aux_loss is not None else nn.CrossEntropyLoss()
        self._step = 0
        self._running = False
        self._used = False

    @staticmethod
    def _extras(
        k: int, aux_heads: Sequence[nn.Module] | None, aux_loss: Any, weight_stashing: bool,
        al_first_loss: str, al_criterion: Any = None,
    ) -> dict[str, Any]:
        """What stage k needs besides its module: its auxiliary head and loss (interlocking),
        whether it stashes weights (asynchronous 1F1B), layer 1's label loss (AL)."""
        out: dict[str, Any] = {"weight_stashing": weight_stashing, "al_first_loss": al_first_loss,
                               "al_criterion": al_criterion}
        if aux_heads is not None:
            out.update(aux_head=aux_heads[k] if k < len(aux_heads) else None, aux_loss=aux_loss)
        return out

    @staticmethod
    def _check_replicas(replica_stages: Sequence[Sequence[nn.Module]]) -> None:
        """Every replica's copy of the model has the same stages, names and shapes."""
        ref = [{n: tuple(t.shape) for n, t in s.state_dict().items()} for s in replica_stages[0]]
        for r, copy in enumerate(replica_stages[1:], start=1):
            got = [{n: tuple(t.shape) for n, t in s.state_dict().items()} for s in copy]
            if got != ref:
                raise ValueError(f"replica {r}'s stages differ from replica 0's (names or shapes)")

    @staticmethod
    def _check_untied(stages: Sequence[nn.Module]) -> None:
        """Each stage process owns its tensors: a parameter shared by two stages would untie."""
        owner: dict[int, tuple[int, str]] = {}
        for k, s in enumerate(stages):
            for name, t in list(s.named_parameters()) + list(s.named_buffers()):
                first = owner.setdefault(id(t), (k, name))
                if first[0] != k:
                    raise ValueError(
                        f"stage {k}'s {name!r} is the same tensor as stage {first[0]}'s "
                        f"{first[1]!r}; tensors shared between stages (tied weights) would be "
                        "trained apart, one copy per stage process: keep them in one stage"
                    )

    @staticmethod
    def _check_picklable(
        stages: Sequence[nn.Module], loss_fn: Any, optimizer: Any, schedule: Any, lr_scheduler: Any,
        more: Mapping[str, Any] | None = None,
    ) -> None:
        items = [(f"stage {k} ({type(s).__name__})", s) for k, s in enumerate(stages)]
        items += [("loss_fn", loss_fn), ("optimizer", optimizer), ("schedule", schedule),
                  ("lr_scheduler", lr_scheduler), *(more or {}).items()]
        for what, obj in items:
            try:
                pickle.dumps(obj)
            except Exception as exc:
                raise ValueError(
                    f"{what} cannot be pickled to start its stage process ({exc}); define classes "
                    "and functions at module level (no lambdas or local classes), or use "
                    "mode='simulated'"
                ) from exc

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
        if not self._running:
            raise PipelineError("the pipeline is not running; use 'with runner:' or runner.start()")

    # -- training and inference --------------------------------------------------------------
    @staticmethod
    def _batch(name: str, t: Any) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() == 0 or t.shape[0] == 0:
            raise ValueError(f"{name} must have a non-empty batch dimension, got shape {tuple(t.shape)}")
        return t.detach().cpu()

    def _sizes(self, batch: int) -> list[int]:
        sizes = split_sizes(batch, self.microbatches)
        if len(sizes) not in self._checked_counts:  # a small batch: dry-run that count too
            schedules.build(self.schedule, self.n_stages, len(sizes))
            self._checked_counts.add(len(sizes))
        return sizes

    def step(self, x: torch.Tensor, target: torch.Tensor) -> float:
        """One optimizer step on the whole batch ``(x, target)``; returns the mean loss."""
        self._require_running()
        x = self._batch("x", x)
        target = self._batch("target", target)
        if x.shape[0] != target.shape[0]:
            raise ValueError(
                f"x has {x.shape[0]} samples (shape {tuple(x.shape)}) but target has "
                f"{target.shape[0]} (shape {tuple(target.shape)})"
            )
        if isinstance(self.schedule, schedules.AssociatedLearning) and (
            target.is_floating_point() or target.is_complex() or target.dim() != 1
        ):
            raise ValueError(
                f"schedule 'al' encodes class indices as one-hot labels: target must be a 1-d integer "
                f"tensor, got {tuple(target.shape)} {target.dtype}"
            )
        if self.data_parallel > 1:
            return self._step_replicated(x, target)
        sizes = self._sizes(x.shape[0])
        weights = microbatch_weights(self._loss_fn, target, sizes)
        self._step += 1
        return self._backend.step(self._step, sizes, weights, x, target)

    def _step_replicated(self, x: torch.Tensor, target: torch.Tensor) -> float:
        """Replica r trains on the r-th shard; every microbatch's loss weight is its share of the
        whole batch's, so the replicas' summed gradients are the full batch's."""
        R = self.data_parallel
        if x.shape[0] < R:
            raise ValueError(f"a batch of {x.shape[0]} samples cannot be split over data_parallel={R} replicas")
        shard_sizes = split_sizes(x.shape[0], R)
        per = [self._sizes(n) for n in shard_sizes]
        flat = [s for sizes in per for s in sizes]
        weights = microbatch_weights(self._loss_fn, target, flat)
        aux = microbatch_weights(self._aux_loss, target, flat) if self._aux_heads else None
        shards: list[tuple] = []
        i = 0
        for sizes in per:
            part = slice(i, i + len(sizes))
            shards.append((sizes, weights[part]) + ((aux[part],) if aux is not None else ()))
            i += len(sizes)
        self._step += 1
        return self._backend.step_replicated(self._step, shards, x, target)

    def predict(self, x: torch.Tensor) -> Any:
        """Forward only (eval mode, no grad), microbatched; returns the output on the CPU."""
        self._require_running()
        x = self._batch("x", x)
        sizes = self._sizes(x.shape[0])
        self._step += 1
        outs = self._backend.predict(self._step, sizes, x)
        cat = tuple(torch.cat([o[i] for o in outs]) for i in range(len(outs[0])))
        return cat[0] if len(cat) == 1 else cat

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> "collections.OrderedDict[str, torch.Tensor]":
        """The model's state, keyed as ``nn.Sequential(*stages).state_dict()`` would be."""
        self._require_running()
        out: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
        for k, (names, tensors) in enumerate(self._backend.get_state()):
            for name, t in zip(names, tensors):
                out[f"{k}.{name}"] = t
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load a state saved by :meth:`state_dict` (or from ``nn.Sequential(*stages)``)."""
        self._require_running()
        if self._stage_shapes is None:  # stages built in their own processes: ask them
            self._stage_shapes = [{n: tuple(t.shape) for n, t in zip(names, tensors)}
                                  for names, tensors in self._backend.get_state()]
        per_stage: list[tuple[list[str], list[torch.Tensor]]] = []
        expected = {f"{k}.{n}" for k, shapes in enumerate(self._stage_shapes) for n in shapes}
        unexpected = sorted(set(state) - expected)
        missing = sorted(expected - set(state))
        if unexpected or missing:
            raise ValueError(
                f"state_dict does not fit these {self.n_stages} stages: missing keys {missing}, "
                f"unexpected keys {unexpected}"
            )
        for k, shapes in enumerate(self._stage_shapes):
            names, tensors = [], []
            for name, shape in shapes.items():
                t = state[f"{k}.{name}"]
                if not isinstance(t, torch.Tensor):
                    raise ValueError(f"state_dict['{k}.{name}'] is a {type(t).__name__}, not a tensor")
                if tuple(t.shape) != shape:
                    raise ValueError(
                        f"state_dict['{k}.{name}'] has shape {tuple(t.shape)}, stage {k} expects {shape}"
                    )
                names.append(name)
                tensors.append(t.detach().cpu())
            per_stage.append((names, tensors))
        self._backend.set_state(per_stage)

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self, directory: str, meta: Mapping[str, Any] | None = None) -> None:
        """Write a checkpoint to ``directory``: every stage's parameters, buffers, optimizer and
        lr-scheduler state and RNG, under the flat model's global names (see
        :mod:`pipeq.checkpoint`), each file written then renamed, the manifest last.
        ``meta`` (plain JSON data) is stored in the manifest."""
        from . import checkpoint

        self._require_running()
        self._check_checkpointable()
        checkpoint.save(directory, self._backend.get_snapshots(), dict(meta or {}))

    def load(self, directory: str) -> dict[str, Any]:
        """Load a checkpoint written by :meth:`save`, also one saved with another number of
        stages (the same layers split differently); returns its ``meta``."""
        from . import checkpoint

        self._require_running()
        self._check_checkpointable()
        ckpt = checkpoint.load(directory)
        layouts = [checkpoint.StageLayout(**lay) for lay in self._backend.layouts()]
        self._backend.restore(checkpoint.split(ckpt, layouts))
        return dict(ckpt.meta)

    def _check_checkpointable(self) -> None:
        if isinstance(self.schedule, schedules.AssociatedLearning):
            raise ValueError("checkpoints of Associated Learning runs are not supported yet (two "
                             "optimizers per layer); use state_dict() for the parameters")
        if self._aux_heads:
            raise ValueError(
                "checkpoints of runs with aux_heads are not supported yet: the auxiliary heads have no "
                "place among the flat model's names; use state_dict() for the main path"
            )
