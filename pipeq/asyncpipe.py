"""Asynchronous 1F1B on one stage: an optimizer step after every microbatch, weight stashing.

With :class:`pipeq.schedules.AsyncOneFOneB` a stage updates its weights after each backward, so
microbatch j's backward may come after updates made since its forward. Two rules:

- ``weight_stashing=True`` (default, PipeDream): the forward of j runs on a *copy* of the weights
  as they are then (``torch.func.functional_call``), its backward computes the gradient of that
  copy, and the optimizer applies it to the live weights. Forward and backward of j agree; at most
  the stage's in-flight microbatches (its warm-up, min(m, N-k)) hold a copy.
- ``weight_stashing=False``: the forward of j runs without a graph; its backward recomputes the
  forward with the current weights from the saved input, so the gradient is that of the newest
  weights (no copies, one more forward per microbatch).

Every microbatch is its own update: its loss is not scaled by a share of the batch. The lr
scheduler, if any, steps with the optimizer (once per microbatch).

Training microbatches are numbered across batches (0, 1, ... over a whole ``runner.stream``):
:meth:`AsyncExecutor.extend` adds a batch's microbatches, and a backward may belong to an
earlier batch than the forward before it (the stage does not drain between batches).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.func import functional_call

from .schedules import AsyncOneFOneB
from .stage import StageExecutor, StageSpec, Tensors, as_tuple, describe


class AsyncExecutor(StageExecutor):
    def __init__(self, index: int, n_stages: int, spec: StageSpec, device: torch.device,
                 schedule: AsyncOneFOneB) -> None:
        super().__init__(index, n_stages, spec, device)
        weight_stashing = schedule.weight_stashing
        self.weight_stashing = weight_stashing
        self.copies: dict[int, dict[str, torch.Tensor]] = {}  # microbatch -> its stashed weights
        self.max_copies = 0  # the most copies held at once (bounded by the pipeline depth)
        # training microbatches, numbered across batches: their inputs (stage 0), targets (last
        # stage) and batch (step); each batch's microbatch losses until its LOSS is reported
        self.stream_inputs: dict[int, torch.Tensor] = {}
        self.stream_targets: dict[int, torch.Tensor] = {}
        self.step_of: dict[int, int] = {}
        self.step_losses: dict[int, list[torch.Tensor]] = {}

    def extend(self, step: int, first: int, sizes: Any, x: Any = None, target: Any = None) -> None:
        """Batch ``step`` joins the stream: its microbatches are numbered ``first``, ``first + 1``..."""
        self.step_index = step
        self.training = True
        for m, mode in self._train_modes:
            m.training = mode
        for store, data in ((self.stream_inputs, x), (self.stream_targets, target)):
            if data is not None:
                for j, chunk in enumerate(data.to(self.device, non_blocking=True).split(list(sizes))):
                    store[first + j] = chunk
        for j in range(len(sizes)):
            self.step_of[first + j] = step
        self.step_losses[step] = []

    def _report(self, j: int, loss: torch.Tensor) -> None:
        self.step_losses[self.step_of[j]].append(loss.detach())

    def mean_loss(self) -> float:
        """The mean of the current batch's microbatch losses (each microbatch is its own update;
        the last stage finishes a batch's forwards before it reports)."""
        losses = self.step_losses.pop(self.step_index, [])
        return float(sum(losses)) / len(losses) if losses else float("nan")

    def _run(self, j: int, args: Tensors, weights: dict[str, torch.Tensor] | None) -> Any:
        try:
            if weights is None:
                return self.module(*args)
            return functional_call(self.module, {**weights, **dict(self.module.named_buffers())}, args)
        except Exception as exc:
            raise RuntimeError(
                f"forward of microbatch {j} (step {self.step_index}) failed on input of shape "
                f"{describe(args)}: {exc}"
            ) from exc

    def forward(self, j: int, received: Tensors | None) -> Tensors | None:
        if not self.training:
            return super().forward(j, received)
        args = (self.stream_inputs.pop(j),) if self.is_first else tuple(
            t.to(self.device, non_blocking=True) for t in received or ())
        if self.weight_stashing:
            leaves = tuple(t.requires_grad_() if t.is_floating_point() else t for t in args) \
                if not self.is_first else ()
            copy = {n: p.detach().clone().requires_grad_(p.requires_grad)
                    for n, p in self.module.named_parameters()}
            self.copies[j] = copy
            self.max_copies = max(self.max_copies, len(self.copies))
            out = self._run(j, tuple(t.clone() if t.requires_grad else t for t in leaves) or args, copy)
            outs = as_tuple(out)
            if self.is_last:
                loss = self.loss_fn(out, self.stream_targets[j]).reshape(())  # type: ignore[misc]
                self._report(j, loss)
                self.stash[j] = (leaves, loss)
                return None
            self.stash[j] = (leaves, outs)
            return tuple(t.detach() for t in outs)
        # no stashing: keep the input, recompute in the backward with the weights of that moment
        with torch.no_grad():
            out = self._run(j, args, None)
        self.stash[j] = (args, None)
        if self.is_last:
            loss = self.loss_fn(out, self.stream_targets[j]).reshape(())  # type: ignore[misc]
            self._report(j, loss)
            return None
        return tuple(t.detach() for t in as_tuple(out))

    def backward(self, j: int, grads: Tensors | None) -> Tensors | None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self.step_of.pop(j, None)
        if self.weight_stashing:
            leaves, outs = self.stash.pop(j)
            copy = self.copies.pop(j)
        else:
            saved, _ = self.stash.pop(j)
            leaves = tuple(t.detach().requires_grad_() if t.is_floating_point() else t for t in saved) \
                if not self.is_first else ()
            out = self._run(j, tuple(t.clone() if t.requires_grad else t for t in leaves) or saved, None)
            outs = self.loss_fn(out, self.stream_targets[j]).reshape(()) if self.is_last else as_tuple(out)  # type: ignore[misc]
            copy = None
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
        self.stream_targets.pop(j, None)
        if self.is_first:
            return None
        return tuple((t.grad if t.grad is not None else torch.zeros_like(t)).detach()
                     for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad)
