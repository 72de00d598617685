"""One stage's compute: forward and backward of its microbatches, with gradient accumulation.

A :class:`StageExecutor` knows nothing of sockets or processes. The worker event loop (process mode)
and the simulated engine (one process) both drive it with the same actions, so both give the same
numbers. Boundaries detach: stage k+1 receives stage k's output as fresh leaves that require grad,
and sends their gradients back. Each microbatch's loss is weighted by its share of the batch (see
:mod:`pipeq.stage.loss`), so the gradients accumulated over a step are the full batch's.

Its other parts: the optimizer step (:mod:`pipeq.stage.step`) and its state, snapshots and
restores (:mod:`pipeq.stage.state`); the backward split into input and weight gradients
(:mod:`pipeq.stage.split_backward`); what it is built from is a :class:`~pipeq.stage.spec.StageSpec`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch import nn

from pipeq.errors import StageComputeError, error_line
from pipeq.stage import microbatch
from pipeq.stage.grad_graph import engine_backward
from pipeq.stage.loss import step_weights
from pipeq.stage.numerics import LossScaler, Numerics, all_finite, peak_memory
from pipeq.stage.spec import StageSpec
from pipeq.stage.split_backward import SplitBackward
from pipeq.stage.state import StageState
from pipeq.stage.step import OptimizerStep
from pipeq.stage.ties import TiedGrads
from pipeq.stage.transfer import pinned_copies
from pipeq.tree import as_args, tensors_of

__all__ = ["StageExecutor", "Tensors", "as_tuple", "describe"]

Tensors = tuple[torch.Tensor, ...]


def as_tuple(value: Any) -> Tensors:
    """A stage's output as a tuple of tensors: a list's items, else :func:`pipeq.tree.as_args`."""
    return tuple(value) if isinstance(value, list) else as_args(value)


def describe(tensors: Sequence[torch.Tensor]) -> str:
    """Shapes and dtypes of ``tensors`` for an error message: ``"(4, 8) float32, (4,) int64"``."""
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in tensors)


class StageExecutor(StageState, OptimizerStep, SplitBackward):
    """Runs stage ``index`` of ``n_stages``: the module, its optimizer and (last stage) the loss.

    Subclasses for other schedules take the same arguments plus the schedule object they run.
    """

    def __init__(self, index: int, n_stages: int, spec: StageSpec, device: torch.device, *,
                 trains: nn.Module | None = None) -> None:
        """``trains``: what the optimizer covers (default: the module)."""
        self.index = index
        self.n_stages = n_stages
        self.is_first = index == 0
        self.is_last = index == n_stages - 1
        self.device = device
        self.module = spec.module.to(device)
        params = [p for p in (trains or self.module).parameters() if p.requires_grad]
        self.needs_target = self.is_last  # which stages get the batch's target
        self.grad_sync: Any = None  # data parallelism: a pipeq.parallel.data.GradSync
        self.tied = TiedGrads.of(self.module, index)  # tied weights (pipeq.stage.ties), or None
        self._backwards = 0
        self._synced = False
        self.optimizer = self.make_optimizer(spec, params)
        # stepped once per training step, right after the optimizer (every stage alike), or
        # (interval "epoch") by scheduler_step only
        self.scheduler = self.make_scheduler(spec, self.optimizer)
        self.scheduler_interval = spec.lr_scheduler_interval
        self.loss_fn = spec.loss_fn
        self._cuda = device.type == "cuda"
        self._cpu = device.type == "cpu"  # received tensors are on the stage's device already (no .to())
        # train() would switch on submodules the user put in eval mode (frozen BatchNorm...):
        # training restores the modes the module came with instead.
        self._train_modes = [(m, m.training) for m in self.module.modules()]
        self.skipped_steps = 0  # steps skipped for non-finite gradients (fp16, check_finite='skip')
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
        self.pending_w: dict[int, Any] = {}  # a split backward's, between I and W (pipeq.stage.split_backward)
        self._grad_params: list[torch.Tensor] | None = None
        self.loss_sum: torch.Tensor | None = None

    def set_numerics(self, numerics: Numerics) -> None:
        """Precision, loss scaling, clipping, checks and recomputation (see :mod:`pipeq.stage.numerics`)."""
        self.numerics = numerics
        self.autocast = lambda: numerics.autocast(self.device)
        self.recompute = numerics.recomputes(self.index)
        self.scaler = LossScaler(self.device) if numerics.scales_loss else None
        self._check = numerics.check_finite == "raise"

    # -- step boundaries -------------------------------------------------------------------
    def begin(
        self,
        step: int,
        sizes: Sequence[int],
        training: bool,
        x: Any = None,
        target: Any = None,
        weights: Sequence[float] | None = None,
        aux_weights: Sequence[float] | None = None,
        inputs: dict[str, Any] | None = None,
    ) -> None:
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
        self.pending_w.clear()
        self._grad_params = None  # looked up again (pipeq.stage.split_backward)
        self.loss_sum = None
        if training:
            for m, mode in self._train_modes:
                m.training = mode
        else:
            self.module.eval()
        if training and self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self._backwards = 0
        self._synced = False

    def mean_loss(self) -> float:
        """The step's loss: the sum of the weighted microbatch losses (NaN without any)."""
        return float(self.loss_sum) if self.loss_sum is not None else float("nan")
    # -- compute -----------------------------------------------------------------------------
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
                    return torch.func.functional_call(self.module, buffers, call, kwargs, strict=False)
                return self.module(*call, **kwargs) if kwargs else self.module(*call)
        except Exception as exc:
            raise self._forward_error(j, value, exc) from exc

    def _forward_error(self, j: int, value: Any, exc: Exception) -> StageComputeError:
        """The error of a forward of microbatch ``j`` that failed on ``value`` (its input) with ``exc``."""
        shapes = describe(tensors_of(value)) or f"(no tensor: {type(value).__name__})"
        if self.kwargs is not None and j < len(self.kwargs):
            shapes += "".join(f", {name}={describe(tensors_of(v)) or f'{v!r:.40}'}" for name, v in self.kwargs[j].items())
        return StageComputeError(f"forward of microbatch {j} (step {self.step_index}) failed on input of shape "
                                 f"{shapes}: {error_line(exc)}")

    def _loss(self, j: int, out: Any) -> torch.Tensor | None:
        """The last stage's weighted loss of microbatch ``j`` (None: it weighs nothing)."""
        target = self.targets[j]
        try:
            with self.autocast():
                loss = self.loss_fn(out, target)  # type: ignore[misc]
        except Exception as exc:
            raise StageComputeError(
                f"loss_fn failed on output {describe(tensors_of(out))} and target "
                f"{describe(tensors_of(target))} (microbatch {j}, step {self.step_index}): {error_line(exc)}"
            ) from exc
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(
                f"loss_fn must return a scalar tensor, got "
                f"{describe((loss,)) if isinstance(loss, torch.Tensor) else type(loss).__name__}"
            )
        w = self.weights[j]
        if w == 0.0:  # nothing counts in this microbatch (all targets ignored): no gradient
            return None
        return loss.reshape(()) * w

    def _nonfinite(self, what: str, j: int, tensors: Sequence[torch.Tensor]) -> None:
        if self._check and not all_finite(tensors):
            raise FloatingPointError(
                f"stage {self.index}: {what} of microbatch {j} (step {self.step_index}) holds NaN or Inf "
                f"({describe(tensors)}); check_finite='raise' stopped the run before any optimizer step")

    def forward(self, j: int, received: Tensors | None) -> Tensors | None:
        """Forward of microbatch ``j``; returns the tensors to send on (None on the last stage)."""
        leaves, args, tree = self._inputs(j, received)
        if self._check and self.training and self.is_first:
            self._nonfinite("the input x", j, tensors_of(self.inputs[j]))
        redo = self.training and self.recompute
        keep = (tree, self._rng_state()) if redo else None  # what the recompute needs
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
            self.stash[j] = (leaves, None if redo else self._scaled(scaled), keep)
            return None
        if self.training:
            self._nonfinite("the output", j, outs)
            self.stash[j] = (leaves, None if redo else outs, keep)
        return microbatch.Packed.of(tuple(t.detach() for t in outs), out_tree)

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler is not None else loss

    def _rng_state(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The RNG state a forward starts from: the CPU's, and the stage's CUDA device's."""
        return torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if self._cuda else None

    def _set_rng_state(self, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        cpu, cuda = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.device)

    @contextlib.contextmanager
    def _rng_replayed(self, state: tuple[torch.Tensor, torch.Tensor | None]) -> Iterator[None]:
        """Within: the RNG at ``state`` (a forward's :meth:`_rng_state`: a recompute draws that
        forward's dropout masks). After: the RNG as it was, as if the forward had run once."""
        now = self._rng_state()
        self._set_rng_state(state)
        try:
            yield
        finally:
            self._set_rng_state(now)

    def _recompute(self, j: int, leaves: Tensors, keep: Any) -> Any:
        """Microbatch ``j``'s forward again, with grad, under the RNG state of its first forward
        (the same dropout masks) and without touching the module's buffers twice (BatchNorm's
        running statistics are updated once, by the first forward): its outputs, or the scaled
        loss on the last stage."""
        tree, rng = keep
        args = tuple(t.clone() if t.requires_grad else t for t in leaves)
        scratch = {n: b.clone() for n, b in self.module.named_buffers()}
        with self._rng_replayed(rng):
            out = self._call(j, args, tree, grad=True, buffers=scratch)
        if self.is_last:
            return self._scaled(self._loss(j, out))  # type: ignore[arg-type]
        return microbatch.pack_output(out)[0]

    def early_input_grads(self, j: int) -> Tensors:
        """Input gradients computed in the forward (interlocking); plain backprop has none."""
        raise RuntimeError(f"stage {self.index}: the schedule sends a gradient after a forward")

    def backward(self, j: int, grads: Tensors | None) -> Tensors | None:
        """Backward of microbatch ``j``; returns the input gradients to send back (None on stage 0)."""
        leaves, outs, keep = self.stash.pop(j)
        if keep is not None:
            outs = self._recompute(j, leaves, keep)
        roots, gs = self._roots(j, outs, grads)
        if roots:
            engine_backward(roots, gs)  # torch.autograd.backward(roots, gs), less its Python
        if self.is_first:
            return None
        out = tuple(
            (t.grad if t.grad is not None else torch.zeros_like(t)).detach()
            for t in leaves
            if t.requires_grad
        )
        if self.scaler is None:
            self._nonfinite("the input gradient", j, out)
        return out

    @staticmethod
    def _check_grad_shapes(j: int, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Each (output, gradient) pair of microbatch ``j`` agrees in shape (ValueError otherwise)."""
        for o, g in pairs:
            if o.shape != g.shape:
                raise ValueError(
                    f"gradient of shape {tuple(g.shape)} for output of shape {tuple(o.shape)} (microbatch {j})")

    def stats(self, reset: bool = False) -> dict[str, Any]:
        """Peak memory since the last reset (see :func:`pipeq.stage.numerics.peak_memory`), the
        optimizer steps skipped for non-finite gradients and whether the stage recomputes."""
        return {**peak_memory(self.device, reset), "skipped_steps": self.skipped_steps,
                "recompute": self.recompute}

    # -- transfer to the CPU ---------------------------------------------------------------
    #: the transport takes device tensors as they are (CUDA IPC on one host: pipeq.wire.shm)
    keep_on_device = False

    def for_peer(self, tensors: Tensors) -> Tensors:
        """What goes to a neighbour stage: the tensors themselves when the transport moves
        device tensors (:attr:`keep_on_device`), else CPU copies (:meth:`to_host`)."""
        return tensors if self.keep_on_device else self.to_host(tensors)

    def to_host(self, tensors: Tensors) -> Tensors:
        """CPU copies for sending (the same tensors when already on the CPU); a tree's
        description stays with them."""
        if not self._cuda:
            return tensors
        return microbatch.rewrap(tensors, pinned_copies(tensors, self.device))
