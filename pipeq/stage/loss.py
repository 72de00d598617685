"""How the microbatches' losses add up to the batch's: the weight of each microbatch's loss.

Gradient accumulation makes one step equal to one full-batch step: the loss of microbatch j is
scaled by n_j / n (its share of the batch's samples) for a mean-reduced loss, by 1 for a
sum-reduced one, so microbatches of unequal size are weighted correctly. :func:`weighted_loss` is
one microbatch's loss so weighted, as a stage computes it.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Sequence

import torch
from torch import nn

from pipeq.errors import StageComputeError, error_line
from pipeq.stage.microbatch import describe
from pipeq.tree import tensors_of

__all__ = ["loss_weight_mode", "microbatch_weights", "step_weights", "weighted_loss"]


def loss_weight_mode(loss_fn: Callable) -> str:
    """'mean' or 'sum': how microbatch losses combine into the batch loss."""
    reduction = getattr(loss_fn, "reduction", "mean")
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"loss_fn has reduction={reduction!r}; pipeq needs a scalar loss: use 'mean' or 'sum'"
        )
    return reduction


def microbatch_weights(loss_fn: Callable, target: Any, sizes: Sequence[int]) -> list[float]:
    """What each microbatch's loss is multiplied by so that their sum is the full-batch loss.

    A mean-reduced loss divides by its own denominator: the number of samples for most losses,
    but for class-index targets of CrossEntropyLoss / NLLLoss the number of targets that are not
    ``ignore_index``, each counted with its class weight. Each microbatch gets its share of the
    batch's denominator (a microbatch with none gets 0). A sum-reduced loss needs weight 1.
    """
    if loss_weight_mode(loss_fn) == "sum":
        return [1.0] * len(sizes)
    dens: list[float]
    if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)) and isinstance(target, torch.Tensor) and not (
        target.is_floating_point() or target.is_complex()
    ):
        dens = []
        for chunk in target.split(list(sizes)):
            valid = chunk[chunk != loss_fn.ignore_index]
            if loss_fn.weight is not None:
                dens.append(float(loss_fn.weight.detach().cpu()[valid].sum()))
            else:
                dens.append(float(valid.numel()))
    else:
        dens = [float(n) for n in sizes]
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
    return loss.reshape(()) * weight
