"""A microbatch's backward from what its forward kept: whole (``B``), or in two halves, the input
gradient (``I``) now and the weight gradients (``W``) later.

Zero-bubble schedules (:mod:`pipeq.schedules.zero_bubble`) split a microbatch's backward ``B``
into ``I``, the gradient with respect to the stage's input (what the previous stage waits for),
and ``W``, the gradients of the stage's parameters, which the schedule defers to fill its
bubbles. :meth:`Backprop.input_grad` differentiates the microbatch's outputs (the last stage:
its loss) with respect to the input leaves only (``torch.autograd.grad``, keeping the graph) and
also returns the gradients arriving at the *entries* of the parameter side, the nodes on the
input side with an edge towards a parameter (see :mod:`pipeq.stage.grad_graph`).
:meth:`Backprop.weight_grad` then runs autograd from those nodes only, restricted to the
parameters (one call per group of parameters), which frees the graph: ``W`` computes only the
parameter gradients, not the activation gradients ``I`` computed already. Each parameter's
gradient arrives as under ``B``: the same sums, accumulated in the same order, so ``I`` then ``W``
gives ``B``'s bits. After ``I``, what the forward saved that the ``W``'s nodes will not read is
freed (:meth:`pipeq.stage.memory.MemoryMeter.keep_for_w`): a microbatch waiting for its ``W``
holds what the ``W`` computes from, not its whole forward.

A compiled stage's backward is one node (``torch.compile``'s): its ``I`` runs it, and where the
stage's compiled backward was cut in two (:mod:`pipeq.stage.split_backward`) the node computes
the input gradients only and leaves its weight gradients' graph for the ``W``
(:class:`~pipeq.stage.split_backward.DeferredWeights`); where it was not, ``I`` computes both and
``W`` has nothing left to do, the same numbers as ``B``.

Stage 0 has no input gradient: its ``I`` only keeps what the ``W`` needs, and its ``W`` is the
whole backward (so is a stage's whose inputs need no gradient). With recomputation the ``I``
recomputes the forward and the ``W`` uses that graph. Gradients are final after the step's last
``W`` (the data-parallel all-reduce starts there; clipping, loss scaling and check_finite run at
``STEP``, after every ``W``).

:class:`Backprop` is held by :class:`~pipeq.stage.executor.StageExecutor`, which keeps each
microbatch's forward (its input leaves and outputs, or what a recompute needs) and hands them
over when the backward comes; this object keeps, per microbatch, what its ``W`` backpropagates
between ``I`` and ``W``.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable

import torch
from torch import nn

from pipeq.stage.memory import MemoryMeter, free_all
from pipeq.stage.microbatch import describe
from pipeq.stage.split_backward import DeferredWeights, deferring
from pipeq.stage.grad_graph import (WeightCall, WeightPlan, engine_backward, engine_grad, plan_weights, read_node,
                                    read_saved, run_weight_calls, saving)

__all__ = ["Backprop", "check_grad_shapes"]

Tensors = tuple[torch.Tensor, ...]


def check_grad_shapes(j: int, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each (output, gradient) pair of microbatch ``j`` agrees in shape (ValueError otherwise)."""
    for o, g in pairs:
        if o.shape != g.shape:
            raise ValueError(f"gradient of shape {tuple(g.shape)} for output of shape {tuple(o.shape)} (microbatch {j})")


class Backprop:
    """Stage ``index`` of ``n_stages``'s backward (``module``'s parameters on ``device``): whole
    or split, and the ``W`` each ``I`` leaves behind (see the module)."""

    def __init__(self, index: int, n_stages: int, module: nn.Module, device: torch.device,
                 meter: MemoryMeter | None = None) -> None:
        """``meter``: counts, on a measured step, what an ``I`` keeps for its ``W`` (:mod:`pipeq.stage.memory`)."""
        self.index = index
        self.is_first = index == 0
        self.is_last = index == n_stages - 1
        self.module = module
        self.device = device
        self._cpu = device.type == "cpu"  # received gradients are on the stage's device already (no .to())
        self.step = 0  # named in errors
        #: microbatch -> what its W backpropagates (kept by its I)
        self.pending: dict[int, list[WeightCall] | list[DeferredWeights]] = {}
        self._params: list[torch.Tensor] | None = None  # this step's (see _trained), None until asked
        self.meter = meter

    def begin(self, step: int) -> None:
        """Start step ``step``: nothing pending, the trained parameters looked up again."""
        self.step = step
        self.pending.clear()
        self._params = None

    def _roots(self, j: int, outs: Any, grads: Tensors | None) -> tuple[list[torch.Tensor], list[Any]]:
        """The tensors microbatch ``j``'s backward starts from and their gradients: the scaled
        loss on the last stage (none when it weighs nothing), else the outputs that require grad
        with the gradients the next stage sent (one per floating-point output, in order)."""
        if self.is_last:
            return ([outs], [None]) if outs is not None else ([], [])
        if grads is None:
            raise ValueError(f"stage {self.index}: no gradient for microbatch {j} (step {self.step})")
        diff_outs = [o for o in outs if o.is_floating_point() or o.is_complex()]
        if len(grads) != len(diff_outs):
            raise ValueError(f"got {len(grads)} gradient(s) for outputs {describe(outs)} of microbatch {j}")
        pairs = [(o, g) for o, g in zip(diff_outs, grads) if o.requires_grad]
        check_grad_shapes(j, pairs)
        if self._cpu:
            return [o for o, _ in pairs], [g for _, g in pairs]
        return [o for o, _ in pairs], [g.to(self.device, non_blocking=True) for _, g in pairs]

    def whole(self, j: int, leaves: Tensors, outs: Any, grads: Tensors | None) -> Tensors | None:
        """``B j``: microbatch ``j``'s backward from ``outs`` (its outputs; the last stage: its
        scaled loss, or None) given ``grads`` (the next stage's), its parameter gradients
        accumulated; returns the gradients of its input ``leaves`` (None on stage 0)."""
        return self._whole(*self._roots(j, outs, grads), leaves)

    def _whole(self, roots: list[torch.Tensor], gs: list[Any], leaves: Tensors) -> Tensors | None:
        if roots:
            engine_backward(roots, gs)  # torch.autograd.backward(roots, gs), less its Python
        if self.is_first:
            return None
        return tuple((t.grad if t.grad is not None else torch.zeros_like(t)).detach() for t in leaves if t.requires_grad)

    def _trained(self) -> list[torch.Tensor]:
        """The module's parameters that require grad (looked up once per step: every I of a
        step would find the same)."""
        if self._params is None:
            self._params = [p for p in self.module.parameters() if p.requires_grad]
        return self._params

    def input_grad(self, j: int, leaves: Tensors, outs: Any, grads: Tensors | None) -> Tensors | None:
        """``I j``: as :meth:`whole`, but only the gradients of the input ``leaves`` (None on stage
        0), keeping what :meth:`weight_grad` needs for the parameters'."""
        gin, marked = self._input_grad(j, leaves, outs, grads)
        meter = self.meter
        if meter is not None and meter.on:  # the gradients its W starts from, held until then
            meter.kept_for_w(j, [g for call in self.pending[j] for g in call.grads])
        if marked:  # what its forward saved and its W will not read, not freed as the I ran: now
            meter.keep_for_w(j, True)  # type: ignore[union-attr]
        return gin

    def _free_early(self, j: int, plan: WeightPlan) -> bool:
        """Before ``I j``: mark what its ``W`` will read (the ``W``'s nodes' saved tensors) and have
        each other node free what it saved and the ``W`` will not read as soon as it has run (a
        post-hook): the ``I`` never holds the whole forward beside the gradients it captures.
        False: nothing may be freed (see :meth:`~pipeq.stage.grad_graph.WeightPlan.weight_nodes`)."""
        meter = self.meter
        assert meter is not None
        nodes = plan.weight_nodes()
        try:
            marked = nodes is not None and meter.mark(j, functools.partial(read_saved, nodes))
        except RuntimeError:  # a node that would not show what it saved: the W may need any of it
            marked = False
        if not marked:
            meter.keep_for_w(j, False)
            return False
        w = set(nodes)
        for node, saved in meter.unkept(saving(n for n in plan.input_side() if n not in w), read_node):
            node.register_hook(free_all(saved))
        return True

    def _input_grad(self, j: int, leaves: Tensors, outs: Any,
                    grads: Tensors | None) -> tuple[Tensors | None, bool]:
        """``I j``'s input gradients, and whether what its ``W`` will read is marked (the rest is
        freed: see :meth:`_free_early`)."""
        roots, gs = self._roots(j, outs, grads)
        need = [t for t in leaves if t.requires_grad]
        params = self._trained()
        if not (roots and need):  # stage 0 (or no input gradient): W is the whole backward
            self.pending[j] = [WeightCall(roots, gs, params)] if roots and params else []
            if self.meter is not None:
                self.meter.keep_for_w(j, False)
            return (None if self.is_first else tuple(torch.zeros_like(t) for t in need)), False
        plan = plan_weights(roots, gs, need, params)
        if plan.whole:  # a compiled stage: its node leaves its W behind where it is cut, else I does all
            with deferring() as deferred:
                gin = self._whole(roots, gs, leaves)
            self.pending[j] = deferred  # type: ignore[assignment]
            return gin, False
        marked = self.meter is not None and self.meter.frees and self._free_early(j, plan)
        got = engine_grad(roots, gs, [*need, *plan.captures])
        self.pending[j] = plan.calls(got[len(need):])
        return tuple((g if g is not None else torch.zeros_like(t)).detach() for g, t in zip(got, need)), marked

    def weight_grad(self, j: int) -> None:
        """``W j``: microbatch ``j``'s parameter gradients, accumulated; frees its graph."""
        calls = self.pending.pop(j, None)
        if calls is None:
            raise ValueError(f"stage {self.index}, step {self.step}: action W{j} before I{j} "
                             f"(nothing kept for microbatch {j}'s weight gradients)")
        if self.meter is not None and self.meter.on:
            self.meter.waited(j)
        if calls and isinstance(calls[0], DeferredWeights):
            for deferred in calls:
                deferred.run()  # type: ignore[union-attr]
        else:
            run_weight_calls(calls)
