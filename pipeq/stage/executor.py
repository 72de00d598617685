"""One stage's compute: forward and backward of its microbatches, with gradient accumulation.

A :class:`StageExecutor` knows nothing of sockets or processes. The worker event loop (process mode)
and the simulated engine (one process) both drive it with the same actions, so both give the same
numbers. Boundaries detach: stage k+1 receives stage k's output as fresh leaves that require grad,
and sends their gradients back. Each microbatch's loss is weighted by its share of the batch (see
:mod:`pipeq.stage.loss`), so the gradients accumulated over a step are the full batch's.

The executor runs the forward and keeps what each microbatch's backward needs. Three
collaborators, each with one job, do the rest, and the executor's public methods forward to them:

- ``stepper``, a :class:`~pipeq.stage.step.Stepper`: the optimizers, lr schedulers, loss scaler,
  clipping and the replicas' sync (``optimizer_step``, ``step_stats``, ``apply_step``...);
- ``backprop``, a :class:`~pipeq.stage.backprop.Backprop`: the backward, whole or split into input
  and weight gradients, and the weight gradients' graphs kept between the two;
- ``state_io``, a :class:`~pipeq.stage.state.StateIO`: the state tensors, checkpoint layout,
  snapshots and restores.

An executor that holds more (an auxiliary head, a sharded module) holds its own kind of
collaborator. What an executor is built from is a :class:`~pipeq.stage.spec.StageSpec`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from pipeq.errors import StageComputeError, error_line
from pipeq.stage import microbatch
from pipeq.stage.backprop import Backprop
from pipeq.stage.compiled import NO_COMPILE_FIGURES, CompileWatch
from pipeq.stage.loss import step_weights, weighted_loss
from pipeq.stage.memory import MemoryMeter, device_peak
from pipeq.stage.microbatch import describe
from pipeq.stage.numerics import Numerics, StepStats, all_finite
from pipeq.stage.spec import StageSpec
from pipeq.stage.state import StateIO
from pipeq.stage.step import Stepper
from pipeq.stage.ties import TiedGrads
from pipeq.stage.transfer import to_host
from pipeq.tree import as_args, tensors_of

__all__ = ["StageExecutor", "Tensors", "as_tuple", "describe", "forward_error", "rng_state", "rng_replayed"]

Tensors = tuple[torch.Tensor, ...]
RngState = tuple[torch.Tensor, "torch.Tensor | None"]  # the CPU's, and a CUDA device's


def as_tuple(value: Any) -> Tensors:
    """A stage's output as a tuple of tensors: a list's items, else :func:`pipeq.tree.as_args`."""
    return tuple(value) if isinstance(value, list) else as_args(value)


def forward_error(j: int, step: int, value: Any, kwargs: dict[str, Any] | None, exc: Exception) -> StageComputeError:
    """The error of a forward of microbatch ``j`` (step ``step``) that failed with ``exc`` on
    ``value`` (its input) and ``kwargs`` (its stage inputs, if any)."""
    shapes = describe(tensors_of(value)) or f"(no tensor: {type(value).__name__})"
    if kwargs is not None:
        shapes += "".join(f", {name}={describe(tensors_of(v)) or f'{v!r:.40}'}" for name, v in kwargs.items())
    return StageComputeError(f"forward of microbatch {j} (step {step}) failed on input of shape {shapes}: "
                             f"{error_line(exc)}")


def rng_state(device: torch.device) -> RngState:
    """The RNG state a forward on ``device`` starts from: the CPU's, and the CUDA device's."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state: RngState, device: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


@contextlib.contextmanager
def rng_replayed(state: RngState, device: torch.device) -> Iterator[None]:
    """Within: the RNG at ``state`` (a forward's :func:`rng_state`: a recompute draws that
    forward's dropout masks). After: the RNG as it was, as if the forward had run once."""
    now = rng_state(device)
    _set_rng_state(state, device)
    try:
        yield
    finally:
        _set_rng_state(now, device)


class StageExecutor:
    """Runs stage ``index`` of ``n_stages``: the module, its optimizer and (last stage) the loss.

    The same class whatever the stage's parallel layers (tensor parallelism, FSDP, replicas: its
    ``parallel``) or compile; research schedules' executors subclass it with their own compute.
    """

    def __init__(self, index: int, n_stages: int, spec: StageSpec, device: torch.device, *,
                 trains: nn.Module | None = None, parallel: Any = None) -> None:
        """``trains``: what the optimizer covers (default: the module). ``parallel``: the stage's
        parallel layers (a :class:`~pipeq.parallel.layers.StageParallel`: tensor parallelism,
        FSDP, the replicas' sums), None for a stage of one process."""
        self.index = index
        self.n_stages = n_stages
        self.is_first = index == 0
        self.is_last = index == n_stages - 1
        self.device = device
        self.parallel = parallel
        self.module = parallel.prepare(spec.module, device) if parallel is not None else spec.module.to(device)
        params = [p for p in (trains or self.module).parameters() if p.requires_grad]
        self.needs_target = self.is_last  # which stages get the batch's target
        self.tied = TiedGrads.of(self.module, index)  # tied weights (pipeq.stage.ties), or None
        self.stepper = Stepper(index, self.module, device, spec, params, self.tied)
        self.stepper.parallel = parallel
        self.memory = MemoryMeter(self.module, self.stepper.optimizers)  # its bytes, activations (pipeq.stage.memory)
        self.backprop = Backprop(index, n_stages, self.module, device, self.memory)
        self.state_io = StateIO(index, self.module, device, self.stepper, parallel)
        self.loss_fn = spec.loss_fn
        self._cpu = device.type == "cpu"  # received tensors are on the stage's device already (no .to())
        # train() would switch on submodules the user put in eval mode (frozen BatchNorm...):
        # training restores the modes the module came with instead.
        self._train_modes = [(m, m.training) for m in self.module.modules()]
        self.set_numerics(Numerics())
        # per step
        self.step_index = 0
        self.training = True
        self.weights: list[float] = []
        self.aux_weights: list[float] = []
        self.inputs: list[Any] = []  # stage 0: microbatches of x
        self.targets: list[Any] = []  # last stage: microbatches of the target
        self.kwargs: list[dict[str, Any]] | None = None  # microbatches of its stage inputs (forward's keywords)
        # microbatch -> (input leaves, outputs / scaled loss, what a recompute needs or None)
        self.stash: dict[int, tuple[Tensors, Any, Any]] = {}
        self.loss_sum: torch.Tensor | None = None

    def adopt(self, parallel: Any) -> None:
        """Take ``parallel`` after the fact (a research schedule's executor, built by its schedule):
        its replicas' sums only, since such an executor holds its stage whole."""
        if parallel.tp or parallel.sharded:
            raise ValueError(f"stage {self.index}: {type(self).__name__} computes its own way and holds its stage "
                             "whole: it runs without tensor parallelism or sharding")
        self.parallel = self.stepper.parallel = self.state_io.parallel = parallel

    def set_numerics(self, numerics: Numerics) -> None:
        """Precision, loss scaling, clipping, checks and recomputation (see :mod:`pipeq.stage.numerics`)."""
        self.numerics = numerics
        self.autocast = lambda: numerics.autocast(self.device)
        self.recompute = numerics.recomputes(self.index)
        self._check = numerics.check_finite == "raise"
        self.stepper.set_numerics(numerics)

    # -- step boundaries -------------------------------------------------------------------
    def begin(self, step: int, sizes: Sequence[int], training: bool, x: Any = None, target: Any = None,
              weights: Sequence[float] | None = None, aux_weights: Sequence[float] | None = None,
              inputs: dict[str, Any] | None = None) -> None:
        """Start a step: ``weights`` scale the microbatch losses (see :func:`~pipeq.stage.loss.step_weights`),
        ``aux_weights`` the auxiliary heads' losses (interlocking). ``x``, ``target`` and ``inputs``
        (the stage's keyword arguments, ``stage_inputs``) are trees (see :mod:`pipeq.stage.microbatch`),
        split into microbatches here."""
        self.step_index = step
        self.training = training
        self.weights = step_weights(sizes, weights)
        self.aux_weights = list(aux_weights) if aux_weights is not None else []
        if x is not None:
            self.inputs = microbatch.split(microbatch.to_device(x, self.device), sizes)
        if target is not None:
            self.targets = microbatch.split(microbatch.to_device(target, self.device), sizes)
        self.kwargs = microbatch.split(microbatch.to_device(inputs, self.device), sizes) if inputs else None
        self.stash.clear()
        self.backprop.begin(step)
        self.memory.begin(step, len(self.weights), training, (self.inputs, self.targets, self.kwargs))
        self.loss_sum = None
        if training:
            for m, mode in self._train_modes:
                m.training = mode
        else:
            self.module.eval()
        self.stepper.begin(training, len(self.weights))
        if self.parallel is not None:
            self.parallel.begin(step, training)

    def mean_loss(self) -> float:
        """The step's loss: the sum of the weighted microbatch losses (NaN without any)."""
        return float(self.loss_sum) if self.loss_sum is not None else float("nan")

    # -- forward -----------------------------------------------------------------------------
    def _inputs(self, j: int, received: Tensors | None) -> tuple[Tensors, Tensors, Any]:
        """Microbatch ``j``'s (input leaves, the tensors the module gets, their tree)."""
        if self.is_first:
            return (), (), None
        assert received is not None
        tree = microbatch.spec_of(received)
        args = tuple(received) if self._cpu else tuple(t.to(self.device, non_blocking=True) for t in received)
        if not self.training:
            return args, args, tree
        leaves = tuple(t.requires_grad_() if t.is_floating_point() or t.is_complex() else t for t in args)
        # The module gets a non-leaf copy: an in-place first op (ReLU(inplace=True)) is then
        # fine, as it is in one process; the gradient collects on the leaf.
        return leaves, tuple(t.clone() if t.requires_grad else t for t in leaves), tree

    def _call(self, j: int, args: Tensors, tree: Any, grad: bool,
              buffers: dict[str, torch.Tensor] | None = None) -> Any:
        """The module on microbatch ``j`` (stage 0: its x; else ``args`` shaped by ``tree``);
        ``buffers``: used instead of the module's own (a recompute's scratch copies)."""
        value = self.inputs[j] if self.is_first else microbatch.unpack(tree, args)
        call = as_args(value)
        kwargs = self.kwargs[j] if self.kwargs is not None else None
        try:
            with self.autocast(), torch.set_grad_enabled(grad):
                if buffers:
                    out = torch.func.functional_call(self.module, buffers, call, kwargs, strict=False)
                else:
                    out = self.module(*call, **kwargs) if kwargs else self.module(*call)
                return out if self.parallel is None else self.parallel.output(out)
        except Exception as exc:
            raise forward_error(j, self.step_index, value, kwargs, exc) from exc

    def _loss(self, j: int, out: Any) -> torch.Tensor | None:
        """The last stage's weighted loss of microbatch ``j`` (None: it weighs nothing)."""
        return weighted_loss(self.loss_fn, out, self.targets[j], self.weights[j],  # type: ignore[arg-type]
                             self.autocast(), f"microbatch {j}, step {self.step_index}")

    def _nonfinite(self, what: str, j: int, tensors: Sequence[torch.Tensor]) -> None:
        if self._check and not all_finite(tensors):
            raise FloatingPointError(
                f"stage {self.index}: {what} of microbatch {j} (step {self.step_index}) holds NaN or Inf "
                f"({describe(tensors)}); check_finite='raise' stopped the run before any optimizer step")

    def forward(self, j: int, received: Tensors | None) -> Tensors | None:
        """Forward of microbatch ``j``; returns the tensors to send on (None on the last stage)."""
        if self.parallel is not None:
            return self.parallel.around(self._measured, j, received)
        return self._measured(j, received)

    def _measured(self, j: int, received: Tensors | None) -> Tensors | None:
        if self.memory.hooked:  # a measured step, or a split backward's (pipeq.stage.memory)
            return self.memory.forward(self._forward, j, received, self.stash)
        return self._forward(j, received)

    def _forward(self, j: int, received: Tensors | None) -> Tensors | None:
        leaves, args, tree = self._inputs(j, received)
        if self._check and self.training and self.is_first:
            self._nonfinite("the input x", j, tensors_of(self.inputs[j]))
        redo = self.training and self.recompute
        keep = (tree, rng_state(self.device)) if redo else None  # what the recompute needs
        out = self._call(j, args, tree, grad=self.training and not redo)
        if out is None:  # named here: the next stage would fail on it, and be blamed
            raise ValueError(f"its forward returned None (microbatch {j}, step {self.step_index}); a stage returns "
                             "what the next stage takes (or the loss_fn, on the last stage): a tensor, or a "
                             "tuple / list / dict of tensors")
        outs, out_tree = microbatch.pack_output(out)
        if self.is_last:
            if not self.training:
                return microbatch.Packed.of(outs, out_tree)
            self._nonfinite("the output", j, outs)
            scaled = self._loss(j, out)
            if scaled is None:
                self.stash[j] = (leaves, None, None)
                return None
            d = scaled.detach()
            self._nonfinite("the loss", j, (d,))
            self.loss_sum = d if self.loss_sum is None else self.loss_sum + d
            self.stash[j] = (leaves, None if redo else self.stepper.scaled(scaled), keep)
            return None
        if self.training:
            self._nonfinite("the output", j, outs)
            self.stash[j] = (leaves, None if redo else outs, keep)
        return microbatch.Packed.of(tuple(t.detach() for t in outs), out_tree)

    def _recompute(self, j: int, leaves: Tensors, keep: Any) -> Any:
        """Microbatch ``j``'s forward again, with grad, under the RNG state of its first forward
        (the same dropout masks) and without touching the module's buffers twice (BatchNorm's
        running statistics are updated once, by the first forward): its outputs, or the scaled
        loss on the last stage."""
        tree, rng = keep
        args = tuple(t.clone() if t.requires_grad else t for t in leaves)
        scratch = {n: b.clone() for n, b in self.module.named_buffers()}
        with rng_replayed(rng, self.device):
            out = self._call(j, args, tree, grad=True, buffers=scratch)
        if self.is_last:
            return self.stepper.scaled(self._loss(j, out))  # type: ignore[arg-type]
        return microbatch.pack_output(out)[0]

    def early_input_grads(self, j: int) -> Tensors:
        """Input gradients computed in the forward (interlocking); plain backprop has none."""
        raise RuntimeError(f"stage {self.index}: the schedule sends a gradient after a forward")

    # -- backward (pipeq.stage.backprop) ----------------------------------------------------------
    def _stashed(self, j: int) -> tuple[Tensors, Any]:
        """Microbatch ``j``'s input leaves and what its backward starts from (its outputs, or the
        last stage's scaled loss), its forward's stash spent (a recompute runs now)."""
        leaves, outs, keep = self.stash.pop(j)
        return leaves, (self.memory.recompute(self._recompute, j, leaves, keep) if keep is not None else outs)

    def _checked(self, j: int, grads: Tensors | None) -> Tensors | None:
        """``grads``, the input gradients of microbatch ``j``, checked (check_finite='raise';
        not under fp16 loss scaling, whose overflows skip the step instead)."""
        if grads is not None and self.stepper.scaler is None:
            self._nonfinite("the input gradient", j, grads)
        return grads

    def backward(self, j: int, grads: Tensors | None) -> Tensors | None:
        """Backward of microbatch ``j``; returns the input gradients to send back (None on stage 0)."""
        self.stepper.before_backward()
        if self.parallel is not None:
            return self.parallel.around(self._backward, j, grads)
        return self._backward(j, grads)

    def _backward(self, j: int, grads: Tensors | None) -> Tensors | None:
        return self._checked(j, self.backprop.whole(j, *self._stashed(j), grads))

    def input_grad(self, j: int, grads: Tensors | None) -> Tensors | None:
        """``I j``: the gradient of microbatch ``j`` with respect to the stage's input (None on
        stage 0), keeping what its :meth:`weight_grad` needs."""
        if j not in self.stash:
            raise ValueError(f"stage {self.index}, step {self.step_index}: action I{j} has no forward of "
                             f"microbatch {j} to differentiate (or its backward ran already)")
        if self.parallel is not None:
            return self.parallel.around(self._input_grad, j, grads)
        return self._input_grad(j, grads)

    def _input_grad(self, j: int, grads: Tensors | None) -> Tensors | None:
        return self._checked(j, self.backprop.input_grad(j, *self._stashed(j), grads))

    def weight_grad(self, j: int) -> None:
        """``W j``: microbatch ``j``'s parameter gradients, accumulated; frees its graph."""
        self.stepper.before_backward()
        if self.parallel is not None:
            self.parallel.around(self.backprop.weight_grad, j)
        else:
            self.backprop.weight_grad(j)

    def backward_done(self) -> None:
        """Called after each backward (B, or W): after the step's last, the replicas' all-reduce starts."""
        self.stepper.backward_done()

    #: the stage's compiled functions and their compile figures (pipeq.stage.compiled), None: eager
    compile_watch: CompileWatch | None = None

    def stats(self, reset: bool = False) -> dict[str, Any]:
        """Peak memory since the last reset (see :func:`pipeq.stage.memory.device_peak`), the
        optimizer steps skipped for non-finite gradients, whether the stage recomputes, and what
        compiling it cost (:meth:`pipeq.stage.compiled.CompileWatch.figures`)."""
        watch = self.compile_watch
        return {**device_peak(self.device, reset), "skipped_steps": self.stepper.skipped_steps,
                "recompute": self.recompute, **(watch.figures() if watch is not None else NO_COMPILE_FIGURES),
                **(self.parallel.figures() if self.parallel is not None else {})}

    # -- transfer to the CPU ---------------------------------------------------------------
    #: the transport takes device tensors as they are (CUDA IPC on one host: pipeq.wire.shm)
    keep_on_device = False

    def for_peer(self, tensors: Tensors) -> Tensors:
        """What goes to a neighbour stage: the tensors themselves when the transport moves
        device tensors (:attr:`keep_on_device`), else CPU copies (:meth:`to_host`)."""
        return tensors if self.keep_on_device else self.to_host(tensors)

    def to_host(self, tensors: Tensors) -> Tensors:
        """CPU copies for sending (see :func:`pipeq.stage.transfer.to_host`)."""
        return to_host(tensors, self.device)  # type: ignore[return-value]

    # -- the optimizer step (pipeq.stage.step) ----------------------------------------------------
    def optimizer_params(self) -> list[torch.Tensor]:
        """The parameters the optimizer updates, in its groups' order (what the replicas all-reduce)."""
        return self.stepper.params()

    def sync_replicas(self) -> None:
        """Reduce this step's gradients over the stage's shards and replicas, once per step."""
        self.stepper.sync_replicas()

    def optimizer_step(self) -> None:
        """The step of a run whose stages need not agree first (see :meth:`step_stats`)."""
        self.stepper.step()

    def step_stats(self) -> StepStats:
        """This stage's part of the step's global statistics, once its gradients are final."""
        return self.stepper.stats()

    def apply_step(self, total: StepStats) -> None:
        """The optimizer step (or its skip) that every stage decides alike from ``total``."""
        self.stepper.apply(total, self.step_index)

    def scheduler_step(self, metric: float | None) -> None:
        """Step every lr scheduler of this stage once (``runner.scheduler_step``)."""
        self.stepper.scheduler_step(metric)

    def learning_rates(self) -> list[float]:
        """The learning rate of every parameter group of every optimizer of this stage, in order."""
        return self.stepper.learning_rates()

    def learning_rate(self) -> float | None:
        """The first parameter group's learning rate (reported with each step's loss), None
        for a stage without an optimizer."""
        return self.stepper.learning_rate()

    # -- state (pipeq.stage.state) ----------------------------------------------------------------
    def state_tensors(self) -> tuple[list[str], list[torch.Tensor]]:
        """The module's state dict as (names, CPU tensors)."""
        return self.state_io.tensors()

    def load_state(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
        """Load (names, tensors) as :meth:`state_tensors` gave them."""
        self.state_io.load(names, tensors)

    def layout(self) -> dict[str, Any]:
        """What a checkpoint needs to know of this stage to hand it its part (local names)."""
        return self.state_io.layout()

    def snapshot(self) -> dict[str, Any]:
        """Parameters and buffers, every optimizer's and scheduler's state and the RNG, as CPU copies."""
        return self.state_io.snapshot()

    def restore(self, snap: dict[str, Any]) -> None:
        """Load a :meth:`snapshot` (possibly re-split from another stage count)."""
        self.state_io.restore(snap)
