"""Associated Learning's schedule: local losses on every stage, messages that only flow forward.

Kao and Chen, "Associated Learning: Decomposing End-to-end Backpropagation based on Autoencoders
and Target Propagation", Neural Computation 2021, and Wu, Chen et al., "Associated Learning: an
Alternative to End-to-End Backpropagation that Works on CNN, RNN, and Transformer", ICLR 2022.
Pure: the executor and the layer types (:mod:`pipeq.research.al`) are imported when asked for.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from pipeq.errors import ScheduleError
from pipeq.schedules.actions import STEP, B, F, Schedule, lower_stage
from pipeq.schedules.basic import check_counts
from pipeq.schedules.protocol import SchedulePolicy

__all__ = ["AssociatedLearning"]


class AssociatedLearning(SchedulePolicy):
    """Associated Learning's pipeline (see :mod:`pipeq.research.al`): messages only flow forward.

    Training, per stage and microbatch: receive (s, t), F (both paths and the two local losses),
    send (s, t) on, B (the local backward), STEP. Inference (:meth:`inference`): s flows forward
    to layer l (the last by default), whose b and h start the decode; each stage below applies
    its h to what comes back (on the backward channel), and stage 0's is the output::

        training   stage k | F0 B0 ST F1 B1 ST F2 B2 ST ...   (stage k+1 one F behind)
        inference  stage k | F0 F1 ... D0 D1 ...              (D = decode, toward stage 0)
    """

    name = "al"
    per_microbatch_steps = True
    plain_backprop = False
    needs_loss = False
    takes_stage_inputs = False  # a layer is four modules (f, b, g, h): no one forward to hand them to
    option_names = ("first_loss", "inference_layer")
    FIRST_LOSSES = ("ce", "mse")

    def __init__(self, *, first_loss: str = "ce", inference_layer: int | None = None) -> None:
        """``first_loss``: layer 1's label-path loss, cross-entropy on the one-hot labels ("ce")
        or mean squared error ("mse"); ``inference_layer``: the stage (0-based) whose b and h start the
        decode in ``predict`` (default: the last; a lower one is the shortcut)."""
        if first_loss not in self.FIRST_LOSSES:
            raise ValueError(f"AssociatedLearning(first_loss=...) must be 'ce' or 'mse', got {first_loss!r}")
        if inference_layer is not None and (type(inference_layer) is not int or inference_layer < 0):
            raise ValueError(
                f"AssociatedLearning(inference_layer=...) must be a stage index >= 0, got {inference_layer!r}")
        self.first_loss = first_loss
        self.inference_layer = inference_layer

    @classmethod
    def from_label(cls, label: str) -> "AssociatedLearning | None":
        return cls() if label == cls.name else None

    def plan(self, n_stages: int, n_microbatches: int) -> Schedule:
        check_counts(n_stages, n_microbatches)
        order = [a for j in range(n_microbatches) for a in (F(j), B(j), STEP)]
        return [lower_stage(order, recv_act=k > 0, send_act=k < n_stages - 1, recv_grad=False, send_grad=False)
                for k in range(n_stages)]

    def last(self, n_stages: int) -> int:
        layer = n_stages - 1 if self.inference_layer is None else self.inference_layer
        if layer >= n_stages:
            raise ScheduleError(
                f"AssociatedLearning(inference_layer={layer}) but there are only {n_stages} stages")
        return layer

    def inference(self, n_stages: int, n_microbatches: int) -> Schedule:
        """Forwards up to the inference layer, then the decode down to stage 0 (as backwards)."""
        check_counts(n_stages, n_microbatches)
        top = self.last(n_stages)
        m = n_microbatches
        order = [F(j) for j in range(m)] + [B(j) for j in range(m)]
        return [lower_stage(order, recv_act=k > 0, send_act=k < top, recv_grad=k < top, send_grad=k > 0)
                if k <= top else [] for k in range(n_stages)]

    inference_plan = inference

    @property
    def options(self) -> dict[str, str | int | None]:
        return {"first_loss": self.first_loss, "inference_layer": self.inference_layer}

    def with_options(self, **options: Any) -> "AssociatedLearning":
        return AssociatedLearning(**options) if options else self

    # -- roles: the labels enter at stage 0, every layer has its local losses, stage 0 decodes ----
    def loss_stages(self, n_stages: int) -> list[int]:
        return [0]

    def output_stage(self, n_stages: int) -> int:
        return 0

    def computes_loss(self, stage: int, n_stages: int) -> bool:
        return True

    def executor(self, index: int, n_stages: int, spec: Any, device: Any) -> Any:
        from pipeq.research.al.executor import ALExecutor

        return ALExecutor(index, n_stages, spec, device, self)

    def default_loss(self) -> Callable:
        from torch import nn

        return nn.MSELoss()  # the associated and autoencoder losses' criterion

    def eval_loss(self, loss_fn: Callable) -> Callable:
        from torch import nn

        return nn.CrossEntropyLoss()  # of the class scores the decode gives

    # -- what AL refuses -----------------------------------------------------------------------------
    def _check_inference_layer(self, n: int) -> None:
        if self.inference_layer is not None and self.inference_layer >= n:
            raise ValueError(f"AssociatedLearning(inference_layer={self.inference_layer}) but there are only "
                             f"{n} AL layers (stages 0..{n - 1})")

    def check_stages(self, stages: Sequence[Any]) -> None:
        from pipeq.research.al.models import ALLayer

        self._check_inference_layer(len(stages))
        for k, st in enumerate(stages):
            if not isinstance(st, ALLayer):
                raise ValueError(f"stage {k} is a {type(st).__name__}: schedule 'al' trains "
                                 "pipeq.research.ALLayer stages (f, b, g, h); build them with pipeq.research.build_al")

    def check_recipe(self, builder: Any, n_stages: int) -> None:
        """Stage 0 is an AL layer (built here once: a wrong stages function fails before any process)."""
        from pipeq.research.al.models import ALLayer

        self._check_inference_layer(n_stages)
        first = builder.build_stage(0, n_stages)
        if not isinstance(first, ALLayer):
            raise ValueError(f"schedule 'al' trains pipeq.research.ALLayer stages (f, b, g, h), but the recipe's "
                             f"stages ({getattr(builder, 'stages', builder)}) give a {type(first).__name__}; "
                             "build them with pipeq.research.build_al")

    def check_target(self, target: Any) -> None:
        import torch

        if not (isinstance(target, torch.Tensor) and target.dim() == 1
                and not (target.is_floating_point() or target.is_complex())):
            what = (f"{tuple(target.shape)} {target.dtype}" if isinstance(target, torch.Tensor)
                    else type(target).__name__)
            raise ValueError(f"schedule 'al' encodes class indices as one-hot labels: target must be a "
                             f"1-d integer tensor, got {what}")

    def check_job(self, path: str, raw: dict[str, Any]) -> None:
        if "model" in raw:
            raise ValueError(f"job file {path}: schedule 'al' trains pipeq.research.ALLayer stages, and model + "
                             "balance splits an nn.Sequential into plain ones: name the AL layers with "
                             "stages = 'pkg.mod:fn' (pipeq.research.build_al)")
