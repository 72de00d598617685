"""A stage's backward in two parts: the input gradient (``I``) now, the weight gradients (``W``) later.

Zero-bubble schedules (:mod:`pipeq.schedules.zero_bubble`) split a microbatch's backward ``B``
into ``I``, the gradient with respect to the stage's input (what the previous stage waits for),
and ``W``, the gradients of the stage's parameters, which the schedule defers to fill its
bubbles. :meth:`SplitBackward.input_grad` differentiates the microbatch's outputs (the last stage:
its loss) with respect to the input leaves only (``torch.autograd.grad``, keeping the graph) and
also returns the gradients arriving at the *entries* of the parameter side, the nodes on the
input side with an edge towards a parameter (see :mod:`pipeq.stage.grad_graph`).
:meth:`SplitBackward.weight_grad` then runs autograd from those nodes only, restricted to the
parameters (one call per group of parameters), which frees the graph: ``W`` computes only the
parameter gradients, not the activation gradients ``I`` computed already. Each parameter's
gradient arrives as under ``B``: the same sums, accumulated in the same order, so ``I`` then ``W``
gives ``B``'s bits.

Stage 0 has no input gradient: its ``I`` only keeps what the ``W`` needs, and its ``W`` is the
whole backward (so is a stage's whose inputs need no gradient). With recomputation the ``I``
recomputes the forward and the ``W`` uses that graph. Gradients are final after the step's last ``W`` (the data-parallel all-reduce starts
there; clipping, loss scaling and check_finite run at ``STEP``, after every ``W``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from pipeq.stage.grad_graph import WeightCall, engine_grad, plan_weights, run_weight_calls

__all__ = ["SplitBackward", "Roots"]

Roots = tuple[list[torch.Tensor], list[Any]]  # what a backward starts from: tensors, their gradients


class SplitBackward:
    """The ``I`` and ``W`` halves of :class:`~pipeq.StageExecutor`'s backward."""

    # what the executor provides
    index: int
    step_index: int
    is_first: bool
    is_last: bool
    device: torch.device
    _cpu: bool  # the device is the CPU
    module: nn.Module
    scaler: Any
    stash: dict[int, tuple[Any, Any, Any]]
    _grad_params: list[torch.Tensor] | None  # this step's (see _trained), None until asked
    #: microbatch -> what its W backpropagates (kept by its I)
    pending_w: dict[int, list[WeightCall]]

    _recompute: Callable[[int, Any, Any], Any]  # microbatch j's forward again (recompute)
    _nonfinite: Callable[[str, int, Any], None]  # check_finite='raise' on tensors
    _check_grad_shapes: Callable[[int, Iterable[tuple[torch.Tensor, torch.Tensor]]], None]

    def _roots(self, j: int, outs: Any, grads: Any) -> Roots:
        """The tensors microbatch ``j``'s backward starts from and their gradients: the scaled
        loss on the last stage (none when it weighs nothing), else the outputs that require grad
        with the gradients the next stage sent (one per floating-point output, in order)."""
        if self.is_last:
            return ([outs], [None]) if outs is not None else ([], [])
        if grads is None:
            raise ValueError(f"stage {self.index}: no gradient for microbatch {j} (step {self.step_index})")
        diff_outs = [o for o in outs if o.is_floating_point() or o.is_complex()]
        if len(grads) != len(diff_outs):
            shapes = ", ".join(f"{tuple(o.shape)} {str(o.dtype).replace('torch.', '')}" for o in outs)
            raise ValueError(f"got {len(grads)} gradient(s) for outputs {shapes} of microbatch {j}")
        pairs = [(o, g) for o, g in zip(diff_outs, grads) if o.requires_grad]
        self._check_grad_shapes(j, pairs)
        if self._cpu:
            return [o for o, _ in pairs], [g for _, g in pairs]
        return [o for o, _ in pairs], [g.to(self.device, non_blocking=True) for _, g in pairs]

    def _trained(self) -> list[torch.Tensor]:
        """The module's parameters that require grad (looked up once per step: every I of a
        step would find the same)."""
        if self._grad_params is None:
            self._grad_params = [p for p in self.module.parameters() if p.requires_grad]
        return self._grad_params

    def input_grad(self, j: int, grads: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor, ...] | None:
        """``I j``: the gradient of microbatch ``j`` with respect to the stage's input (None on
        stage 0), keeping what its :meth:`weight_grad` needs."""
        if j not in self.stash:
            raise ValueError(f"stage {self.index}, step {self.step_index}: action I{j} has no forward of "
                             f"microbatch {j} to differentiate (or its backward ran already)")
        leaves, outs, keep = self.stash.pop(j)
        if keep is not None:
            outs = self._recompute(j, leaves, keep)
        roots, gs = self._roots(j, outs, grads)
        need = [t for t in leaves if t.requires_grad]
        params = self._trained()
        if not (roots and need):  # stage 0 (or no input gradient): W is the whole backward
            self.pending_w[j] = [WeightCall(roots, gs, params)] if roots and params else []
            return None if self.is_first else tuple(torch.zeros_like(t) for t in need)
        plan = plan_weights(roots, gs, need, params)
        got = engine_grad(roots, gs, [*need, *plan.captures])
        self.pending_w[j] = plan.calls(got[len(need):])
        got = got[:len(need)]
        out = tuple((g if g is not None else torch.zeros_like(t)).detach() for g, t in zip(got, need))
        if self.scaler is None:
            self._nonfinite("the input gradient", j, out)
        return out

    def weight_grad(self, j: int) -> None:
        """``W j``: microbatch ``j``'s parameter gradients, accumulated; frees its graph."""
        calls = self.pending_w.pop(j, None)
        if calls is None:
            raise ValueError(f"stage {self.index}, step {self.step_index}: action W{j} before I{j} "
                             f"(nothing kept for microbatch {j}'s weight gradients)")
        run_weight_calls(calls)
