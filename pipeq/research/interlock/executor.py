"""Interlocking backpropagation on one stage: auxiliary heads and exact gradient routing.

Stage k < N-1 owns an auxiliary head; its loss ``L_k = aux_loss(head_k(a_k), y)`` where ``a_k``
is the stage's output, and the last stage has the real loss ``L_{N-1}``. With distance d (see
:class:`pipeq.research.Interlock`):

- ``main_k`` is trained by ``L_t``, ``t = min(k + d, N - 1)``: its own head's loss when d = 0
  (local), the gradient arriving from stage k+1 otherwise;
- ``head_k`` is trained by ``L_k`` on a detached ``a_k`` (d >= 1): the head's loss reaches
  ``main_k`` only through the stages below it;
- stage k sends down the gradients, with respect to its input, of the losses the stages below
  are trained by (:func:`~pipeq.research.sends_down`). A loss other than
  ``L_t`` is carried through ``main_k`` with ``torch.autograd.grad`` (nothing accumulates into
  ``main_k``); its own head's is computed right after the forward, so pairwise stages send it
  before they wait.

Each microbatch's losses are weighted by its share of the batch, like the real loss, so the
gradients accumulated over a step are those of the whole batch. :class:`InterlockExecutor` runs
the same F/B/STEP actions as :class:`~pipeq.StageExecutor` and replaces its
forward and backward; ``predict`` uses the main path only. A checkpoint holds stage k's head
beside the stage, under ``aux_heads.{k}.*`` with its optimizer state (see :mod:`pipeq.checkpoint`):
the executor's state is a :class:`HeadStateIO`.
Gomez et al., "Interlocking Backpropagation: Improving depthwise model-parallelism", arXiv 2010.04116.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipeq import checkpoint as ckpt
from pipeq.research.interlock.routing import receives, sends_down, sends_early, trained_by
from pipeq.stage.backprop import check_grad_shapes
from pipeq.stage.executor import StageExecutor, Tensors, describe
from pipeq.stage.spec import StageSpec
from pipeq.stage.state import StateIO
from pipeq.stage.step import Stepper

if TYPE_CHECKING:
    from pipeq.research.interlock.schedule import Interlock

__all__ = ["InterlockExecutor"]


class InterlockExecutor(StageExecutor):
    """Runs one stage of an interlocking schedule: its main module and auxiliary head (see the module)."""

    def __init__(self, index: int, n_stages: int, spec: StageSpec, device: torch.device,
                 schedule: Interlock) -> None:
        self.distance = d = schedule.distance(n_stages)
        aux_head, aux_loss = spec.aux_head, spec.aux_loss
        if index < n_stages - 1 and aux_head is None and d < n_stages - 1:
            raise ValueError(
                f"stage {index}: schedule {schedule.name!r} trains with auxiliary heads: pass "
                f"aux_heads=[head_0, ..., head_{n_stages - 2}] (one per stage but the last)"
            )
        # the head lives with its stage: one optimizer covers both
        self.head = aux_head.to(device) if aux_head is not None else None
        holder = nn.ModuleList([spec.module, self.head]) if self.head is not None else None
        super().__init__(index, n_stages, spec, device, trains=holder)
        self.aux_loss = aux_loss if aux_loss is not None else nn.CrossEntropyLoss()
        self.trainer = trained_by(index, n_stages, d)  # the loss that trains main
        self.down = sends_down(index, n_stages, d)  # the losses whose input gradient goes down
        self.up = receives(index, n_stages, d)  # the losses whose output gradient comes up
        self.sends_early = sends_early(index, n_stages, d)  # own head's gradient, right after F
        self.needs_target = True  # every stage computes a loss
        self.own_grad: dict[int, torch.Tensor] = {}  # microbatch -> own head's input gradient
        if self.head is not None:  # checkpoints hold the head beside the stage
            self.state_io = HeadStateIO(index, self.module, device, self.stepper, self.head)

    def begin(self, step: int, sizes: Any, training: bool, x: Any = None, target: Any = None,
              weights: Any = None, aux_weights: Any = None, inputs: Any = None) -> None:
        # a head's loss is weighted by its share of the batch under its own reduction (and
        # ignore_index), like the real one: pipeq.control.batching computes them with the main weights
        if training and self.head is not None and aux_weights is None:
            raise ValueError(f"stage {self.index}: a training step with an auxiliary head needs its loss weights")
        super().begin(step, sizes, training, x, target, weights, aux_weights, inputs)

    # -- forward: main path, then this stage's own loss ----------------------------------------
    def forward(self, j: int, received: Tensors | None) -> Tensors | None:
        if not self.training:
            return super().forward(j, received)
        leaf = None
        if not self.is_first:
            assert received is not None
            if len(received) != 1:
                raise ValueError(
                    f"interlocking schedules pass one tensor between stages; stage {self.index} "
                    f"received {describe(received)}"
                )
            leaf = received[0].to(self.device, non_blocking=True).requires_grad_()
        # the module gets a copy of the leaf: an in-place first op stays fine, as in StageExecutor.forward
        out = self._call(j, (leaf.clone(),) if leaf is not None else (), None, grad=True)
        if isinstance(out, tuple) or not isinstance(out, torch.Tensor):
            raise TypeError(f"stage {self.index}: interlocking schedules need a stage to return one tensor")
        if self.is_last:
            scaled = self._loss(j, out)  # None: the targets are all ignored, no loss, no gradient
            if scaled is not None:
                d = scaled.detach()
                self.loss_sum = d if self.loss_sum is None else self.loss_sum + d
            self.stash[j] = (leaf, out, scaled)
            return None
        target = self.targets[j]
        own = None
        w = self.aux_weights[j] if self.head is not None else 0.0
        if self.head is not None and w != 0.0:
            if self.distance == 0:  # local: the head's loss trains main too (in B)
                own = self.aux_loss(self.head(out), target).reshape(()) * w
            else:  # the head learns from a detached output; its gradient w.r.t. out is kept
                detached = out.detach().requires_grad_()
                aux = self.aux_loss(self.head(detached), target).reshape(()) * w
                aux.backward()
                if self.index in self.down:  # a stage below is trained by this head's loss
                    assert leaf is not None
                    (gx,) = torch.autograd.grad(out, leaf, detached.grad, retain_graph=True)
                    self.own_grad[j] = gx.detach()
        if self.index in self.down and j not in self.own_grad and leaf is not None:
            self.own_grad[j] = torch.zeros_like(leaf)  # nothing counts in this microbatch
        self.stash[j] = (leaf, out, own)
        return (out.detach(),)

    def early_input_grads(self, j: int) -> Tensors:
        return (self.own_grad.pop(j),)

    # -- backward: main is trained by one loss; the others pass through ------------------------
    def backward(self, j: int, grads: Tensors | None) -> Tensors | None:
        leaf, out, own = self.stash.pop(j)
        got: dict[int, torch.Tensor] = {}
        if self.up:
            assert grads is not None
            if len(grads) != len(self.up):
                raise ValueError(
                    f"stage {self.index}: got {len(grads)} gradient(s) for microbatch {j}, expected "
                    f"{len(self.up)} (losses {self.up})"
                )
            check_grad_shapes(j, ((out, g) for g in grads))
            got = {loss_id: g.to(self.device, non_blocking=True) for loss_id, g in zip(self.up, grads)}
        send: dict[int, torch.Tensor] = {}
        wanted = [] if leaf is None or self.sends_early else self.down
        # losses that only pass through main (no accumulation), before the graph is freed
        for loss_id in wanted:
            if loss_id == self.trainer:
                continue
            if loss_id == self.index:  # own head's, computed in the forward
                send[loss_id] = self.own_grad.pop(j)
                continue
            (send[loss_id],) = torch.autograd.grad(out, leaf, got[loss_id], retain_graph=True)
        # the one loss that trains main (its input gradient lands in leaf.grad)
        if self.trainer == self.index:
            if own is not None:  # local: this stage's own head
                own.backward()
        else:
            # main's parameters only, unless the stage below needs this loss's input gradient too
            params = [p for p in self.module.parameters() if p.requires_grad]
            if self.trainer in wanted or not params:
                torch.autograd.backward(out, got[self.trainer])
            else:
                torch.autograd.backward(out, got[self.trainer], inputs=params)
        if self.trainer in wanted:
            assert leaf is not None
            send[self.trainer] = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        if not wanted:
            return None
        return tuple(send[i].detach() for i in wanted)


class HeadStateIO(StateIO):
    """A stage's state with its auxiliary ``head`` beside it: checkpoint layouts and snapshots
    hold the head under ``aux`` (its parameters, and its part of the optimizer's state, which
    covers the stage and the head)."""

    def __init__(self, index: int, module: nn.Module, device: torch.device, stepper: Stepper,
                 head: nn.Module) -> None:
        super().__init__(index, module, device, stepper)
        self.head = head

    def _both(self) -> nn.ModuleDict:
        """The stage and its head under one roof: the names of everything the optimizer holds."""
        return nn.ModuleDict({"main": self.module, "head": self.head})

    def layout(self) -> dict[str, Any]:
        lay = super().layout()
        lay["aux"] = dataclasses.asdict(ckpt.layout_of(self.head))
        return lay

    def snapshot(self) -> dict[str, Any]:
        snap = dict(ckpt.stage_snapshot(self.module))
        both = ckpt.optimizers_snapshot(self._both(), self.stepper.optimizers())
        part = {p: {n.removeprefix(p): v for n, v in both.items() if n.startswith(p)} for p in ("main.", "head.")}
        snap["optim"] = part["main."]
        snap["sched"] = ckpt.schedulers_snapshot(self.stepper.schedulers())
        snap["scaler"] = None
        snap["aux"] = {"model": {n: t.detach().to("cpu", copy=True) for n, t in self.head.state_dict().items()},
                       "optim": part["head."]}
        return snap

    def restore(self, snap: dict[str, Any]) -> None:
        aux = snap.get("aux")
        if not isinstance(aux, dict):
            raise ckpt.CheckpointError(f"stage {self.index} has an auxiliary head, the checkpoint has none for it")
        self.module.load_state_dict(snap["model"], strict=True)
        self.head.load_state_dict(aux["model"], strict=True)
        ckpt.load_schedulers_snapshot(self.stepper.schedulers(), snap.get("sched"), self.index)
        if snap.get("optim"):
            both = {**{f"main.{n}": v for n, v in snap["optim"].items()},
                    **{f"head.{n}": v for n, v in aux["optim"].items()}}
            for optimizer in self.stepper.optimizers():
                ckpt.load_optimizer_snapshot(self._both(), optimizer, both, self.device)
        if snap.get("rng") is not None:
            torch.set_rng_state(snap["rng"])
