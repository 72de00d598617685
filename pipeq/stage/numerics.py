"""How a stage computes: mixed precision, loss scaling, global-norm clipping, finiteness checks
and activation recomputation.

:class:`Numerics` is the run's choice, plain data that reaches every stage process with its
settings. Three of them need the whole model, not one stage: the global gradient norm, fp16's
found-inf and the first stage with a non-finite gradient. Before the optimizer step each stage
computes its :class:`StepStats` (after the data-parallel all-reduce, so every replica's are the
same), the stages combine them along the pipeline (:func:`combine`, carried by the interpreter
over the data channels), and every stage then decides alike, as one optimizer on the whole
model would::

    stage 0 --[own]--> stage 1 --[0+1]--> stage 2 (total)
    stage 0 <--total-- stage 1 <--total-- stage 2          then each: unscale, clip, step or skip

:class:`LossScaler` is torch.amp.GradScaler's dynamic loss scaling (the same constants and update
rule, through the same torch ops), except that the found-inf it updates with is the combined one.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

__all__ = ["PRECISIONS", "FINITE_CHECKS", "Numerics", "check", "check_device", "StepStats", "combine", "total_norm",
           "norm_term", "all_finite", "clip_", "LossScaler"]

PRECISIONS = ("fp32", "bf16", "fp16")
FINITE_CHECKS = (False, "raise", "skip")


@dataclass(frozen=True)
class Numerics:
    """A run's numerics (see :class:`pipeq.PipelineRunner`)."""

    precision: str = "fp32"
    clip_grad_norm: float | None = None
    clip_norm_type: float = 2.0
    check_finite: Any = False  # False, "raise" or "skip"
    recompute: tuple[bool, ...] = ()  # per stage; () for none

    @property
    def scales_loss(self) -> bool:
        """Whether the losses are scaled (fp16: see :class:`LossScaler`)."""
        return self.precision == "fp16"

    @property
    def combines(self) -> bool:
        """Whether the stages combine statistics before every optimizer step."""
        return self.clip_grad_norm is not None or self.scales_loss or self.check_finite in ("raise", "skip")

    def recomputes(self, stage: int) -> bool:
        """Whether stage ``stage`` recomputes its forward in the backward instead of keeping activations."""
        return bool(self.recompute) and self.recompute[stage]

    def autocast(self, device: torch.device) -> Any:
        """The autocast context of a forward (a no-op context in fp32)."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(device.type, dtype=dtype)


def check(precision: Any, clip_grad_norm: Any, clip_norm_type: Any, check_finite: Any, recompute: Any,
          n_stages: int | None) -> Numerics:
    """The runner's numerics arguments, checked (ValueError naming the setting). ``n_stages`` None:
    before the stages are known (a :class:`~pipeq.control.config.NumericsConfig` being made), a
    per-stage ``recompute`` list is checked for its form only (its ``recompute`` is then ())."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if clip_grad_norm is not None and (type(clip_grad_norm) not in (int, float) or not clip_grad_norm > 0
                                       or not math.isfinite(clip_grad_norm)):
        raise ValueError(f"clip_grad_norm must be a positive number (the largest global gradient norm) or "
                         f"None, got {clip_grad_norm!r}")
    if type(clip_norm_type) not in (int, float) or not (clip_norm_type > 0):
        raise ValueError(f"clip_norm_type must be a positive number or float('inf'), got {clip_norm_type!r}")
    if check_finite is True:
        check_finite = "raise"
    if check_finite not in FINITE_CHECKS:
        raise ValueError(f"check_finite must be False, 'raise' (or True) or 'skip', got {check_finite!r}")
    if isinstance(recompute, bool):
        per_stage = (recompute,) * (n_stages or 0)
    elif isinstance(recompute, (list, tuple)) and len(recompute) == (n_stages or len(recompute)) and recompute \
            and all(isinstance(r, bool) for r in recompute):
        per_stage = tuple(recompute) if n_stages is not None else ()
    else:
        many = f"{n_stages} booleans" if n_stages is not None else "booleans"
        raise ValueError(f"recompute must be True, False or a list of {many} (one per stage), got {recompute!r}")
    return Numerics(precision, float(clip_grad_norm) if clip_grad_norm is not None else None,
                    float(clip_norm_type), check_finite, per_stage if any(per_stage) else ())


def check_device(numerics: Numerics, devices: Iterable[str]) -> None:
    """fp16 autocast needs a device type with float16 autocast (CUDA; recent CPUs' torch too)."""
    if numerics.precision != "fp16":
        return
    for d in devices:
        kind = torch.device(d).type
        if kind == "cpu" and not torch.amp.autocast_mode.is_autocast_available("cpu"):
            from pipeq.compat import refusal

            raise ValueError(refusal("fp16-cpu").message())


# -- the statistics the stages combine ----------------------------------------------------------
@dataclass
class StepStats:
    """One stage's part of the step's global statistics, as a 2-element float64 tensor on the wire:
    [the stage's norm term (sum of |g|^p, or max |g| for p = inf), the first stage with a
    non-finite gradient (inf: none)]."""

    norm_term: float
    first_bad: float

    def to_tensor(self) -> torch.Tensor:
        """The statistics as they go on the wire."""
        return torch.tensor([self.norm_term, self.first_bad], dtype=torch.float64)

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor], who: str) -> "StepStats":
        """The statistics ``who`` sent (a ValueError names ``who`` when they are malformed)."""
        if len(tensors) != 1 or tensors[0].dtype != torch.float64 or tuple(tensors[0].shape) != (2,):
            raise ValueError(f"{who} sent malformed step statistics: expected one float64 tensor of shape (2,)")
        a, b = tensors[0].tolist()
        return cls(a, b)


def combine(a: StepStats, b: StepStats, norm_type: float) -> StepStats:
    """Two stages' statistics as those of both together."""
    term = max(a.norm_term, b.norm_term) if math.isinf(norm_type) else a.norm_term + b.norm_term
    return StepStats(term, min(a.first_bad, b.first_bad))


def total_norm(stats: StepStats, norm_type: float) -> float:
    """The global gradient norm of every stage's combined ``stats``."""
    return stats.norm_term if math.isinf(norm_type) else stats.norm_term ** (1.0 / norm_type)


def norm_term(grads: Sequence[torch.Tensor], weights: Sequence[float] | None, norm_type: float) -> float:
    """This stage's part of the global norm (computed in float64 on the stage's device): the sum of
    each gradient's ``|g|^p`` times its weight (None: 1; a piece several processes hold counts a
    share on each), or the largest ``|g|`` for p = inf."""
    if not grads:
        return 0.0
    if math.isinf(norm_type):
        return max(float(g.detach().abs().max()) for g in grads)
    norms = torch._foreach_norm([g.detach() for g in grads], norm_type)
    terms = torch.stack([n.double() for n in norms]).pow(norm_type)
    if weights is not None:
        terms = terms * torch.tensor(weights, dtype=torch.float64, device=terms.device)
    return float(terms.sum())


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every floating-point or complex tensor of ``tensors`` holds no NaN or Inf."""
    for t in tensors:
        if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
            return False
    return True


def clip_(grads: Sequence[torch.Tensor], max_norm: float, total: float) -> None:
    """Scale ``grads`` as torch.nn.utils.clip_grad_norm_ does for a total norm ``total``."""
    coef = max_norm / (total + 1e-6)
    if coef < 1.0 and grads:
        torch._foreach_mul_([g.detach() for g in grads], coef)


# -- fp16 loss scaling ----------------------------------------------------------------------------
class LossScaler:
    """Dynamic loss scaling with torch.amp.GradScaler's defaults and update rule; every stage
    holds one and updates it with the combined found-inf, so all scales stay equal."""

    def __init__(self, device: torch.device, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self.scale = torch.full((), init_scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval

    def unscale_(self, grads: Sequence[torch.Tensor]) -> bool:
        """Divide ``grads`` by the scale in place; True if any of them is not finite."""
        found = torch.zeros((), dtype=torch.float32, device=self.scale.device)
        if grads:
            inv = self.scale.double().reciprocal().float()
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for g in grads:
                by_dtype.setdefault(g.dtype, []).append(g)
            for group in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
        return bool(found)

    def update(self, found_inf: bool) -> None:
        """Back off after a step with a non-finite gradient (any stage's), grow after enough good ones."""
        found = torch.full((), float(found_inf), dtype=torch.float32, device=self.scale.device)
        torch._amp_update_scale_(self.scale, self.growth_tracker, found, self.growth_factor,
                                 self.backoff_factor, self.growth_interval)

    def state_dict(self) -> dict[str, Any]:
        """The scale and growth tracker as plain numbers (a checkpoint's)."""
        return {"scale": float(self.scale), "growth_tracker": int(self.growth_tracker)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`."""
        self.scale.fill_(float(state["scale"]))
        self.growth_tracker.fill_(int(state["growth_tracker"]))
