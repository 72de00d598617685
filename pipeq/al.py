"""Associated Learning (ICLR 2022) with pipelined local updates.

An AL layer i has four parts: ``f_i`` (the original block, x side), ``b_i`` (bridge), ``g_i``
(label encoder) and ``h_i`` (label decoder). With ``s_0 = x`` and ``t_0 = onehot(y)``::

    s_i = f_i(s_{i-1})                       t_i = g_i(t_{i-1})
    associated loss  MSE(b_i(s_i), t_i.detach())     trains f_i and b_i
    autoencoder loss MSE(h_i(t_i), t_{i-1})          trains g_i and h_i
                     (layer 1: optionally CE(tanh(h_1(t_1)), y) against the class index)

Both ``s_i`` and ``t_i`` leave the layer detached: no gradient ever crosses a layer, so messages
only flow forward and each stage updates (one optimizer per path: f+b and g+h) while the next
stages work on the same microbatch and it receives the next one (schedule ``"al"``).

Inference (``predict``): ``s`` through every f, then the last layer's ``b``, then ``h_L, ...,
h_1`` back toward stage 0 (over the backward channel); stage 0 returns class scores. A shortcut
through layer l (``AssociatedLearning(inference_layer=l)``: f_1..f_l, b_l, h_l..h_1) is selectable.

:func:`build_al` makes an AL model from plain blocks and widths.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from .schedules import AssociatedLearning
from .stage import StageExecutor, StageSpec, Tensors, describe


class ALLayer(nn.Module):
    """One AL layer: ``f`` (x side), ``b`` (bridge to the label side), ``g`` (label encoder), ``h``
    (label decoder). As a plain module it runs ``f`` (the inference path's x side)."""

    def __init__(self, f: nn.Module, b: nn.Module, g: nn.Module, h: nn.Module) -> None:
        super().__init__()
        self.f, self.b, self.g, self.h = f, b, g, h

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        return self.f(s)


def build_al(
    blocks: Sequence[nn.Module], widths: Sequence[int], n_classes: int, label_widths: Sequence[int] | None = None,
) -> list[ALLayer]:
    """AL layers from plain blocks: ``blocks[i]`` maps to ``widths[i]`` features (flattened).

    Layer i's label side is ``g_i: label_widths[i-1] -> label_widths[i]`` (``label_widths[-1]`` =
    ``n_classes`` for t_0) with ``b_i: widths[i] -> label_widths[i]`` and ``h_i`` its inverse
    (Linear + Tanh bridges and encoders; ``h_1`` ends in plain class scores). Default label widths:
    ``widths``.
    """
    if len(blocks) != len(widths):
        raise ValueError(f"{len(blocks)} blocks but {len(widths)} widths: give one width per block")
    label_widths = list(label_widths or widths)
    if len(label_widths) != len(blocks):
        raise ValueError(f"label_widths has {len(label_widths)} entries for {len(blocks)} blocks")
    layers = []
    prev = n_classes
    for i, (blk, w, lw) in enumerate(zip(blocks, widths, label_widths)):
        f = nn.Sequential(blk, nn.Flatten())
        b = nn.Sequential(nn.Linear(w, lw), nn.Tanh())
        g = nn.Sequential(nn.Linear(prev, lw), nn.Tanh())
        h = nn.Linear(lw, prev) if i == 0 else nn.Sequential(nn.Linear(lw, prev), nn.Tanh())
        layers.append(ALLayer(f, b, g, h))
        prev = lw
    return layers


class ALExecutor(StageExecutor):
    """Runs one AL layer: forward of both paths, the two local losses, two optimizers."""

    def __init__(self, index: int, n_stages: int, spec: StageSpec, device: torch.device,
                 schedule: AssociatedLearning) -> None:
        module = spec.module
        if not isinstance(module, ALLayer):
            raise ValueError(
                f"stage {index}: schedule 'al' needs pipeq.al.ALLayer stages (f, b, g, h), got a "
                f"{type(module).__name__}; build them with pipeq.al.build_al"
            )
        super().__init__(index, n_stages, spec, device, trains=nn.ModuleList([module.f, module.b]))
        layer: ALLayer = self.module  # type: ignore[assignment]
        label = [p for m in (layer.g, layer.h) for p in m.parameters() if p.requires_grad]
        # the lr scheduler, if any, drives both paths' optimizers (stepped with them, per microbatch)
        self.label_optimizer = self.make_optimizer(spec, label)
        self.label_scheduler = self.make_scheduler(spec, self.label_optimizer)
        self.criterion = spec.loss_fn if spec.loss_fn is not None else nn.MSELoss()
        self.loss_fn = None  # no end-to-end loss: the criterion serves the local ones
        first_loss, inference_layer = schedule.first_loss, schedule.inference_layer
        self.first_loss = first_loss
        self.inference_layer = n_stages - 1 if inference_layer is None else inference_layer
        self.needs_target = index == 0
        self.n_classes = self._classes(layer) if index == 0 else 0
        self.assoc_sum = 0.0
        self.count = 0

    @staticmethod
    def _classes(layer: ALLayer) -> int:
        first = next((m for m in layer.g.modules() if isinstance(m, nn.Linear)), None)
        if first is None:
            raise ValueError("stage 0's g must start with an nn.Linear over the one-hot classes")
        return first.in_features

    def begin(self, step: int, sizes: Any, training: bool, x: Any = None, target: Any = None,
              weights: Any = None, aux_weights: Any = None) -> None:
        super().begin(step, sizes, training, x, target, [1.0] * len(sizes))
        if training and self.label_optimizer is not None:
            self.label_optimizer.zero_grad(set_to_none=True)
        self.assoc_sum = 0.0
        self.count = 0

    def mean_loss(self) -> float:
        """The mean associated loss of this layer over the step's microbatches."""
        return self.assoc_sum / self.count if self.count else float("nan")

    def forward(self, j: int, received: Tensors | None) -> Tensors | None:
        layer: ALLayer = self.module  # type: ignore[assignment]
        if self.is_first:
            s_in = self.inputs[j]
        else:
            assert received is not None
            s_in = received[0].to(self.device, non_blocking=True)
        if not self.training:
            with torch.no_grad():
                s = layer.f(s_in)
            if self.index == self.inference_layer:  # the decode starts here: keep s for b
                self.stash[j] = ((s,), None)
                return None
            return (s,)
        if self.is_first:
            y = self.targets[j]
            if y.is_floating_point():
                raise ValueError(f"stage 0: AL needs class indices as targets, got {describe((y,))}")
            t_in = F.one_hot(y.long(), self.n_classes).to(s_in.dtype)
        else:
            if len(received) != 2:  # type: ignore[arg-type]
                raise ValueError(f"stage {self.index}: AL stages pass (s, t), received {describe(received)}")
            t_in = received[1].to(self.device, non_blocking=True)  # type: ignore[index]
        s = layer.f(s_in)
        t = layer.g(t_in)
        assoc = self.criterion(layer.b(s), t.detach())
        if self.is_first and self.first_loss == "ce":
            ae = F.cross_entropy(torch.tanh(layer.h(t)), self.targets[j].long())
        else:
            ae = self.criterion(layer.h(t), t_in)
        self.stash[j] = ((s, t), (assoc, ae))
        self.assoc_sum += float(assoc.detach())
        self.count += 1
        return None if self.is_last else (s.detach(), t.detach())

    def backward(self, j: int, grads: Tensors | None) -> Tensors | None:
        layer: ALLayer = self.module  # type: ignore[assignment]
        outs, losses = self.stash.pop(j, ((), None))
        if self.training:  # the two local losses; nothing crosses the layer
            assoc, ae = losses
            (assoc + ae).backward()
            return None
        # inference, decoding toward stage 0: b then h on the shortcut layer, h below it
        with torch.no_grad():
            if self.index == self.inference_layer:
                t_hat = layer.b(outs[0])
            else:
                assert grads is not None
                t_hat = grads[0].to(self.device, non_blocking=True)
            out = layer.h(t_hat)
            if self.is_first and self.first_loss == "ce":
                out = torch.tanh(out)
        return (out,)

    def optimizer_step(self) -> None:
        super().optimizer_step()
        if self.label_optimizer is not None:
            self.label_optimizer.step()
            if self.label_scheduler is not None and self.scheduler_interval == "step":
                self.label_scheduler.step()
        for opt in (self.optimizer, self.label_optimizer):
            if opt is not None:
                opt.zero_grad(set_to_none=True)

    def schedulers(self) -> list[Any]:
        """Both paths' schedulers: f and b's, then g and h's."""
        return super().schedulers() + ([self.label_scheduler] if self.label_scheduler is not None else [])

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Both paths' optimizers: f and b's, then g and h's."""
        return super().optimizers() + ([self.label_optimizer] if self.label_optimizer is not None else [])
