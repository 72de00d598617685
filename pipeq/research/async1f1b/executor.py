"""Asynchronous 1F1B on one stage: an optimizer step after every microbatch, weight stashing.

With :class:`pipeq.research.AsyncOneFOneB` a stage updates its weights after
each backward, so microbatch j's backward may come after updates made since its forward (PipeDream,
SOSP 2019). Two rules:

- ``weight_stashing=True`` (default, PipeDream): the forward of j runs on a *copy* of the weights
  as they are then (``torch.func.functional_call``), its backward computes the gradient of that
  copy, and the optimizer applies it to the live weights. Forward and backward of j agree; at most
  the stage's in-flight microbatches (its warm-up, min(m, N-k)) hold a copy.
- ``weight_stashing=False``: the gradient of j is that of the newest weights, those at its
  backward (no weight copies). The forward of j runs without a graph, keeping its input and the
  RNG state it started from (CPU, and the stage's CUDA device if any); the backward recomputes
  the forward from them with the current weights, then backpropagates. The recompute is the
  forward's twin, not a second forward:

  * the same RNG state, so the same dropout masks as the output that was sent on; the stream is
    put back after it, so it advances as if every forward had run once (what
    ``torch.utils.checkpoint(preserve_rng_state=True)`` does; checkpoint itself does not fit:
    its forward builds a graph, and it counts BatchNorm twice);
  * scratch copies of the module's buffers, so running statistics (BatchNorm's running_mean,
    running_var, num_batches_tracked) count the forward only. In train mode BatchNorm
    normalizes with the batch's statistics, so the recompute's output is exact; the live
    buffers are never written by it;
  * not on the last stage: its B(j) directly follows its F(j) (it alternates from its first
    microbatch), no update comes between them, so its forward builds the graph of the newest weights and the
    backward uses it. ``loss_fn`` runs once per microbatch, and the loss reported is the one
    backpropagated.

Every microbatch is its own update: its loss is not scaled by a share of the batch. The lr
scheduler, if any, steps with the optimizer (once per microbatch; with
``lr_scheduler_interval="epoch"`` only when ``runner.scheduler_step`` says so).

Training microbatches are numbered across batches (0, 1, ... over a whole ``runner.stream``):
:meth:`AsyncExecutor.extend` adds a batch's microbatches, and a backward may belong to an
earlier batch than the forward before it (the stage does not drain between batches).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.func import functional_call

from pipeq.stage import microbatch
from pipeq.stage.executor import StageExecutor, Tensors, as_tuple, forward_error, rng_replayed, rng_state
from pipeq.stage.spec import StageSpec

if TYPE_CHECKING:
    from pipeq.research.async1f1b.schedule import AsyncOneFOneB

__all__ = ["AsyncExecutor"]


class AsyncExecutor(StageExecutor):
    """Runs one stage of asynchronous 1F1B: a step after every backward, with or without weight stashing."""

    def __init__(self, index: int, n_stages: int, spec: StageSpec, device: torch.device,
                 schedule: AsyncOneFOneB) -> None:
        super().__init__(index, n_stages, spec, device)
        weight_stashing = schedule.weight_stashing
        self.weight_stashing = weight_stashing
        self.copies: dict[int, dict[str, torch.Tensor]] = {}  # microbatch -> its stashed weights
        self.max_copies = 0  # the most copies held at once (bounded by the pipeline depth)
        self._fresh: int | None = None  # no stashing, last stage: the microbatch whose graph is current
        # training microbatches, numbered across batches: their inputs (stage 0), targets (last
        # stage) and batch (step); each batch's microbatch losses until its LOSS is reported
        self.stream_inputs: dict[int, torch.Tensor] = {}
        self.stream_targets: dict[int, torch.Tensor] = {}
        self.stream_kwargs: dict[int, dict[str, Any]] = {}  # their stage inputs, until their backward
        self.step_of: dict[int, int] = {}
        self.step_losses: dict[int, list[torch.Tensor]] = {}

    def optimizer_step(self) -> None:
        super().optimizer_step()
        self._fresh = None  # the weights changed: no forward's graph is of the newest ones

    def extend(self, step: int, first: int, sizes: Any, x: Any = None, target: Any = None,
               inputs: dict[str, Any] | None = None) -> None:
        """Batch ``step`` joins the stream: its microbatches are numbered ``first``, ``first + 1``...
        (``inputs``: the stage's keyword arguments, each microbatch keeps its own part until its backward)."""
        self.step_index = step
        self.training = True
        self.kwargs = None  # (a predict's: the stream keeps each microbatch's own, stream_kwargs)
        for m, mode in self._train_modes:
            m.training = mode
        for store, data in ((self.stream_inputs, x), (self.stream_targets, target)):
            if data is not None:
                for j, chunk in enumerate(data.to(self.device, non_blocking=True).split(list(sizes))):
                    store[first + j] = chunk
        for j in range(len(sizes)):
            self.step_of[first + j] = step
        if inputs:
            parts = microbatch.split(microbatch.to_device(inputs, self.device), list(sizes))
            self.stream_kwargs.update((first + j, part) for j, part in enumerate(parts))
        self.step_losses[step] = []

    def _report(self, j: int, loss: torch.Tensor) -> None:
        self.step_losses[self.step_of[j]].append(loss.detach())

    def mean_loss(self) -> float:
        """The mean of the current batch's microbatch losses (each microbatch is its own update;
        the last stage finishes a batch's forwards before it reports)."""
        losses = self.step_losses.pop(self.step_index, [])
        return float(sum(losses)) / len(losses) if losses else float("nan")

    def _run(self, j: int, args: Tensors, tensors: dict[str, torch.Tensor] | None) -> Any:
        """The module on ``args`` (and microbatch ``j``'s stage inputs), with ``tensors`` (parameters
        and/or buffers) in place of its own."""
        kwargs = self.stream_kwargs.get(j) if self.stream_kwargs else None
        try:
            if tensors is None:
                return self.module(*args, **kwargs) if kwargs else self.module(*args)
            return functional_call(self.module, tensors, args, kwargs)
        except Exception as exc:
            raise forward_error(j, self.step_index, args, kwargs, exc) from exc

    def forward(self, j: int, received: Tensors | None) -> Tensors | None:
        if not self.training:
            return super().forward(j, received)
        args = (self.stream_inputs.pop(j),) if self.is_first else tuple(
            t.to(self.device, non_blocking=True) for t in received or ())
        if self.weight_stashing or self.is_last:
            # a graph now: of a copy of the weights (stashing), or, on the last stage without
            # stashing, of the live ones (its B(j) comes next, before any update)
            leaves = tuple(t.requires_grad_() if t.is_floating_point() else t for t in args) \
                if not self.is_first else ()
            tensors = None
            if self.weight_stashing:
                copy = {n: p.detach().clone().requires_grad_(p.requires_grad)
                        for n, p in self.module.named_parameters()}
                self.copies[j] = copy
                self.max_copies = max(self.max_copies, len(self.copies))
                tensors = {**copy, **dict(self.module.named_buffers())}
            else:
                self._fresh = j
            out = self._run(j, tuple(t.clone() if t.requires_grad else t for t in leaves) or args, tensors)
            if self.is_last:
                loss = self.loss_fn(out, self.stream_targets[j]).reshape(())  # type: ignore[misc]
                self._report(j, loss)
                self.stash[j] = (leaves, loss)
                return None
            outs = as_tuple(out)
            self.stash[j] = (leaves, outs)
            return tuple(t.detach() for t in outs)
        # no stashing: keep the input and the RNG state, the backward recomputes from them
        rng = rng_state(self.device)
        with torch.no_grad():
            out = self._run(j, args, None)
        self.stash[j] = (args, rng)
        return tuple(t.detach() for t in as_tuple(out))

    def _recompute(self, j: int, args: Tensors, rng: tuple[torch.Tensor, torch.Tensor | None]) -> Any:
        """The forward of j again, with a graph: the newest weights, the RNG state the forward
        started from, scratch copies of the buffers (the forward already updated the running
        statistics). The RNG stream is left as it was."""
        scratch = {n: b.clone() for n, b in self.module.named_buffers()}
        with rng_replayed(rng, self.device):
            return self._run(j, args, scratch or None)

    def backward(self, j: int, grads: Tensors | None) -> Tensors | None:
        self.stepper.zero_grad()
        self.step_of.pop(j, None)
        self.stream_targets.pop(j, None)
        if self.is_last and not self.weight_stashing and self._fresh != j:
            # the schedule guarantees it; a graph of older weights would be wrong
            raise RuntimeError(f"stage {self.index}: an update came between the forward and the "
                               f"backward of microbatch {j}; the last stage needs them adjacent")
        if self.weight_stashing or self.is_last:
            leaves, outs = self.stash.pop(j)
            copy = self.copies.pop(j, None)
        else:
            saved, rng = self.stash.pop(j)
            leaves = tuple(t.detach().requires_grad_() if t.is_floating_point() else t for t in saved) \
                if not self.is_first else ()
            args = tuple(t.clone() if t.requires_grad else t for t in leaves) or saved
            outs = as_tuple(self._recompute(j, args, rng))
            copy = None
        self.stream_kwargs.pop(j, None)  # (after the recompute, which needs them)
        if self.is_last:
            outs.backward()
        else:
            assert grads is not None
            pairs = [(o, g.to(self.device, non_blocking=True)) for o, g in
                     zip([o for o in outs if o.is_floating_point()], grads) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if copy is not None:  # the stashed copy's gradient updates the live weights
            for n, p in self.module.named_parameters():
                g = copy[n].grad
                if g is not None:
                    p.grad = g
        if self.is_first:
            return None
        return tuple((t.grad if t.grad is not None else torch.zeros_like(t)).detach()
                     for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad)
