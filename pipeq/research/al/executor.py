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
through stage k (``AssociatedLearning(inference_layer=k)``, a 0-based stage index: the f's of stages
0..k, b of stage k, the h's of stages k..0) is selectable.

:func:`~pipeq.research.build_al` makes an AL model from plain blocks and widths,
:func:`~pipeq.research.build_al_lstm` and :func:`~pipeq.research.build_al_transformer` text
classifiers whose ``s`` is a tree (the padding mask, an LSTM's ``(h, c)``: see
:mod:`pipeq.research.al.models`); :class:`~pipeq.research.ALModel` is the inference path in one
process. A layer's messages are ``(s, t)`` packed as one tree (:mod:`pipeq.stage.microbatch`):
a pair of tensors travels as two bare tensors, anything else with its description.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

from pipeq.stage import microbatch
from pipeq.research.al.models import ALLayer, call, code, label_dtype, label_input
from pipeq.stage.executor import StageExecutor, Tensors, describe
from pipeq.stage.spec import StageSpec
from pipeq.tree import map_tensors, tensors_of

if TYPE_CHECKING:
    from pipeq.research.al.schedule import AssociatedLearning

__all__ = ["ALExecutor"]


class ALExecutor(StageExecutor):
    """Runs one AL layer: forward of both paths, the two local losses, two optimizers."""

    def __init__(self, index: int, n_stages: int, spec: StageSpec, device: torch.device,
                 schedule: AssociatedLearning) -> None:
        module = spec.module
        if not isinstance(module, ALLayer):
            raise ValueError(
                f"stage {index}: schedule 'al' needs pipeq.research.ALLayer stages (f, b, g, h), got a "
                f"{type(module).__name__}; build them with pipeq.research.build_al"
            )
        super().__init__(index, n_stages, spec, device, trains=nn.ModuleList([module.f, module.b]))
        layer: ALLayer = self.module  # type: ignore[assignment]
        label = [p for m in (layer.g, layer.h) for p in m.parameters() if p.requires_grad]
        # the label path's optimizer, stepped after f and b's; the lr scheduler, if any, drives
        # both paths' optimizers (stepped with them, per microbatch)
        self.stepper.add(spec, label)
        self.criterion = spec.loss_fn if spec.loss_fn is not None else nn.MSELoss()
        self.loss_fn = None  # no end-to-end loss: the criterion serves the local ones
        first_loss, inference_layer = schedule.first_loss, schedule.inference_layer
        self.first_loss = first_loss
        self.inference_layer = n_stages - 1 if inference_layer is None else inference_layer
        self.needs_target = index == 0
        if index == 0:
            self.label_reads, self.n_classes = label_input(layer.g)
            self.label_dtype = label_dtype(layer.g)
        self.assoc_sum = 0.0
        self.count = 0

    def begin(self, step: int, sizes: Any, training: bool, x: Any = None, target: Any = None,
              weights: Any = None, aux_weights: Any = None, inputs: Any = None) -> None:
        if inputs is not None:  # an AL layer is four modules: no one forward to hand them to
            raise ValueError(f"stage {self.index}: schedule 'al' takes no stage_inputs (its layers' f, b, g and h "
                             "are called with what the layer below sends only)")
        super().begin(step, sizes, training, x, target, [1.0] * len(sizes))  # (clears both paths' gradients)
        self.assoc_sum = 0.0
        self.count = 0

    def mean_loss(self) -> float:
        """The mean associated loss of this layer over the step's microbatches."""
        return self.assoc_sum / self.count if self.count else float("nan")

    def _received(self, received: Tensors, training: bool) -> Any:
        """The value the previous layer sent: ``(s, t)`` in training, ``s`` in inference."""
        tensors = [t.to(self.device, non_blocking=True) for t in received]
        tree = microbatch.spec_of(received)
        if tree is not None:
            value = microbatch.unpack(tree, tensors)
        else:
            value = tensors[0] if len(tensors) == 1 and not training else tuple(tensors)
        if training and not (isinstance(value, tuple) and len(value) == 2):
            raise ValueError(f"stage {self.index}: AL stages pass (s, t), received {describe(received)}")
        return value

    @staticmethod
    def _message(value: Any) -> Tensors:
        """``value`` (detached) as the tensors of one message, with their description if needed."""
        tensors, tree = microbatch.pack_output(map_tensors(value, torch.Tensor.detach))
        return microbatch.Packed.of(tensors, tree)

    def _labels(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 0's (what g_1 reads, the one-hot the first autoencoder loss compares with)."""
        y = self.targets[j]
        if not isinstance(y, torch.Tensor) or y.is_floating_point() or y.is_complex():
            got = describe((y,)) if isinstance(y, torch.Tensor) else describe(tensors_of(y)) or repr(y)
            raise ValueError(f"stage 0: AL needs class indices as targets, got {got}")
        onehot = F.one_hot(y.long(), self.n_classes).to(self.label_dtype)
        return (y.long() if self.label_reads == "index" else onehot), onehot

    def forward(self, j: int, received: Tensors | None) -> Tensors | None:
        layer: ALLayer = self.module  # type: ignore[assignment]
        if not self.training:
            s_in = self.inputs[j] if self.is_first else self._received(received, False)  # type: ignore[arg-type]
            with torch.no_grad():
                s = call(layer.f, s_in)
            if self.index == self.inference_layer:  # the decode starts here: keep s for b
                self.stash[j] = (s, None)
                return None
            return self._message(s)
        if self.is_first:
            s_in = self.inputs[j]
            t_in, t_target = self._labels(j)
        else:
            s_in, t_in = self._received(received, True)  # type: ignore[arg-type]
            t_target = code(t_in)
        s = call(layer.f, s_in)
        t = call(layer.g, t_in)
        assoc = self.criterion(call(layer.b, s), code(t).detach())
        if self.is_first and self.first_loss == "ce":
            ae = F.cross_entropy(torch.tanh(call(layer.h, t)), self.targets[j].long())
        else:
            ae = self.criterion(call(layer.h, t), t_target)
        self.stash[j] = (None, (assoc, ae))
        self.assoc_sum += float(assoc.detach())
        self.count += 1
        return None if self.is_last else self._message((s, t))

    def backward(self, j: int, grads: Tensors | None) -> Tensors | None:
        layer: ALLayer = self.module  # type: ignore[assignment]
        s, losses = self.stash.pop(j, (None, None))
        if self.training:  # the two local losses; nothing crosses the layer
            assoc, ae = losses
            (assoc + ae).backward()
            return None
        # inference, decoding toward stage 0: b then h on the shortcut layer, h below it
        with torch.no_grad():
            if self.index == self.inference_layer:
                t_hat = call(layer.b, s)
            else:
                assert grads is not None
                t_hat = grads[0].to(self.device, non_blocking=True)
            out = layer.h(t_hat)
            if self.is_first and self.first_loss == "ce":
                out = torch.tanh(out)
        return (out,)

    def optimizer_step(self) -> None:
        """Both paths' steps (f and b's, then g and h's), then their gradients cleared (a step
        after every microbatch)."""
        super().optimizer_step()
        self.stepper.zero_grad()
