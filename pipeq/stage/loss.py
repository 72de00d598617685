"""How the microbatches' losses add up to the batch's: the weight of each microbatch's loss.

Gradient accumulation makes one step equal to one full-batch step: each microbatch's loss is
scaled by its share of the whole batch's denominator before its backward (not by 1/microbatches
whatever it holds, nor divided by the batch's tokens after the backward: torchtitan #1733 and
#2972), so the gradients summed over the microbatches are those of the batch's loss. What the denominator
counts is the run's ``loss_weighting`` (``pipeq.NumericsConfig.loss_weighting``):

- ``"token"`` (the default): the target's elements that count. For a mean over tokens, the
  loss of one process on the whole batch: ``sum_j (tokens_j / tokens) * loss_j``. An
  integer target's elements equal to the loss's ``ignore_index`` (its attribute, else -100, what
  ``F.cross_entropy`` and Hugging Face use) do not count; with ``nn.CrossEntropyLoss`` /
  ``nn.NLLLoss`` class weights each counts its class's weight, as their mean does. When every row
  has as many target elements and none is ignored, this is the samples' share.
- ``"sample"``: the microbatch's rows (dim 0): for a loss that is a mean over samples (each
  sample's loss a sum or a mean over its own tokens).

A sum-reduced loss (``reduction="sum"``) needs weight 1 either way. :func:`weighted_loss` is one
microbatch's loss so weighted, as a stage computes it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, ContextManager, Sequence

import torch
from torch import nn

from pipeq.errors import StageComputeError, error_line
from pipeq.stage import microbatch
from pipeq.stage.microbatch import describe
from pipeq.tree import tensors_of

__all__ = ["IGNORE_INDEX", "loss_weight_mode", "tokens", "microbatch_weights", "step_weights",
           "weighted_loss"]

#: The ignored target value of a loss that names none (``F.cross_entropy``'s and Hugging Face's).
IGNORE_INDEX = -100


def _setting(loss_fn: Callable, name: str, default: Any) -> Any:
    """The loss's ``name`` setting: its attribute (``nn.CrossEntropyLoss().ignore_index``), else a
    keyword that a ``functools.partial`` binds (``partial(F.cross_entropy, ignore_index=0)``)."""
    if hasattr(loss_fn, name):
        return getattr(loss_fn, name)
    if isinstance(loss_fn, functools.partial):
        return loss_fn.keywords.get(name, _setting(loss_fn.func, name, default))
    return default


def loss_weight_mode(loss_fn: Callable) -> str:
    """'mean' or 'sum': how microbatch losses combine into the batch loss."""
    reduction = _setting(loss_fn, "reduction", "mean")
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"loss_fn has reduction={reduction!r}; pipeq needs a scalar loss: use 'mean' or 'sum'"
        )
    return reduction


def tokens(loss_fn: Callable, target: Any) -> float:
    """The tokens of one microbatch's ``target`` that ``loss_fn``'s mean divides by: the elements
    of its first tensor (depth-first), but an integer target's ``ignore_index`` ones; with an
    ``nn.CrossEntropyLoss`` / ``nn.NLLLoss`` of class weights on class indices, their weights."""
    t = target if isinstance(target, torch.Tensor) else tensors_of(target)[0]
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        return float(t.numel())
    ignore = _setting(loss_fn, "ignore_index", IGNORE_INDEX)
    valid = t[t != ignore]
    weight = getattr(loss_fn, "weight", None) if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)) else None
    if weight is not None:
        return float(weight.detach().cpu()[valid.cpu()].sum())
    return float(valid.numel())


def microbatch_weights(loss_fn: Callable, target: Any, sizes: Sequence[int], weighting: str = "token") -> list[float]:
    """What each microbatch's loss is multiplied by so that their sum is the full-batch loss: its
    share of the batch's tokens (``weighting="token"``) or rows (``"sample"``), see the module;
    1 each for a sum-reduced loss. ``target`` is the whole batch's (split by ``sizes``), or a
    :class:`~pipeq.stage.microbatch.Microbatches`. A microbatch with no token gets 0; a batch
    with none at all (every target ignored: NaN in one process too) weighs them equally."""
    if weighting not in ("token", "sample"):
        raise ValueError(f"loss_weighting must be 'token' or 'sample', got {weighting!r}")
    if loss_weight_mode(loss_fn) == "sum":
        return [1.0] * len(sizes)
    if weighting == "sample":
        dens = [float(n) for n in sizes]
    else:
        dens = [tokens(loss_fn, t) for t in microbatch.split(target, list(sizes))]
    total = sum(dens)
    if total == 0:  # nothing to learn from (every target ignored): the loss is NaN, as in one process
        return [1.0 / len(sizes)] * len(sizes)
    return [d / total for d in dens]


def step_weights(sizes: Sequence[int], weights: Sequence[float] | None) -> list[float]:
    """A step's loss weights, one per microbatch: ``weights`` when given (see
    :func:`microbatch_weights`), else each microbatch's share of the batch's samples."""
    if weights is None:
        total = sum(sizes)
        return [n / total for n in sizes]
    if len(weights) != len(sizes):
        raise ValueError(f"{len(weights)} loss weights for {len(sizes)} microbatches: give one per microbatch "
                         "(see pipeq.stage.loss.microbatch_weights)")
    return list(weights)


def weighted_loss(loss_fn: Callable, out: Any, target: Any, weight: float, autocast: ContextManager[Any],
                  where: str) -> torch.Tensor | None:
    """``loss_fn(out, target)`` (under ``autocast``) as a 0-d tensor times ``weight``; None when
    ``weight`` is 0: nothing in the microbatch counts (all its targets ignored), no gradient.
    ``where`` (the microbatch and step) is named in the errors of a loss_fn that fails or
    returns no scalar tensor."""
    try:
        with autocast:
            loss = loss_fn(out, target)
    except Exception as exc:
        raise StageComputeError(f"loss_fn failed on output {describe(tensors_of(out))} and target "
                                f"{describe(tensors_of(target))} ({where}): {error_line(exc)}") from exc
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"loss_fn must return a scalar tensor, got "
                         f"{describe((loss,)) if isinstance(loss, torch.Tensor) else type(loss).__name__}")
    if weight == 0.0:
        return None
    return (loss if loss.dim() == 0 else loss.reshape(())) * weight
