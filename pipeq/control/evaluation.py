"""Evaluation metrics: ``runner.evaluate(batches, metrics=...)`` and ``pipeq launch``'s eval.

A metric is a callable ``(output, target) -> float`` computed on each evaluation batch (the
output of ``runner.predict(x)``, as the last stage returns it, and the target as given: what
``loss_fn`` gets in training) and reduced over the whole evaluation set as a sample mean: each
batch's value weighted by its samples (dim 0 of the target's tensors), so batches of unequal size count as one big batch would for a metric that
is itself a per-sample mean (accuracy, a mean-reduced loss). The defaults:

    loss      the loss function's value over the whole set, each batch's weighted as the run's
              ``loss_weighting`` weighs microbatches: by its target's tokens ("token", the
              default: the mean over every token of the set) or by its samples ("sample"); a
              sum-reduced loss per sample (divided by the batch's samples first)
    accuracy  argmax accuracy, when every batch is a classification one: a 2-d floating-point
              output and a 1-d integer target

A metric given under one of these names replaces the default. A batch given as its microbatches
(:class:`~pipeq.stage.microbatch.Microbatches`, which may differ in length) counts as that many
batches.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch

from pipeq.control.batching import check_batch
from pipeq.control.stage_inputs import batch_item
from pipeq.stage.loss import loss_weight_mode, tokens
from pipeq.stage.microbatch import Microbatches

Metric = Callable[[Any, torch.Tensor], Any]


def is_classification(output: torch.Tensor, target: torch.Tensor) -> bool:
    """A batch of class scores ``(n, classes)`` against class indices ``(n,)``."""
    return (output.dim() == 2 and output.is_floating_point() and target.dim() == 1
            and not (target.is_floating_point() or target.is_complex() or target.dtype == torch.bool))


def accuracy(output: torch.Tensor, target: torch.Tensor) -> float:
    """The share of samples whose highest score is their target class."""
    return float((output.argmax(1) == target).float().mean())


def check_metrics(metrics: Mapping[str, Metric] | None) -> dict[str, Metric]:
    """``metrics`` as a dict of names to callables; a ``ValueError`` names what is not."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise ValueError(f"metrics must be a dict of names to callables (output, target) -> float, "
                         f"got a {type(metrics).__name__}")
    for name, fn in metrics.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"metrics: a metric's name must be a non-empty string, got {name!r}")
        if not callable(fn):
            raise ValueError(f"metrics[{name!r}] must be callable as fn(output, target) -> float, "
                             f"got a {type(fn).__name__}")
    return dict(metrics)


def _value(name: str, fn: Metric, output: Any, target: torch.Tensor) -> float:
    """One batch's value of metric ``name`` as a float; a ``ValueError`` names the metric."""
    try:
        got = fn(output, target)
    except Exception as exc:
        raise ValueError(f"metric {name!r} failed on output {_shape(output)} and target "
                         f"{_shape(target)}: {type(exc).__name__}: {exc}") from exc
    if isinstance(got, torch.Tensor) and got.numel() != 1:
        raise ValueError(f"metric {name!r} returned a tensor of shape {tuple(got.shape)}; a metric returns "
                         "one number per batch (its mean over the batch's samples)")
    try:
        return float(got)
    except (TypeError, ValueError):
        raise ValueError(f"metric {name!r} returned a {type(got).__name__}, not a number") from None


def _shape(t: Any) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def _batches(batches: Any) -> Iterable[tuple[Any, ...]]:
    """One ``(x, target)`` pair of tensors (or ``(x, target, stage_inputs)`` with a dict; x may be
    a dict batch) is one batch; anything else is an iterable of them. A batch given as its
    microbatches is each of them."""
    one = (isinstance(batches, tuple) and len(batches) in (2, 3) and isinstance(batches[0], (torch.Tensor, Mapping))
           and isinstance(batches[1], torch.Tensor) and (len(batches) == 2 or isinstance(batches[2], Mapping)))
    given = (isinstance(batches, tuple) and len(batches) in (2, 3)  # one batch given as its microbatches,
             and all(isinstance(part, Microbatches) for part in batches)  # not batches of (x, target) pairs
             and not any(isinstance(v, (tuple, list)) and len(v) in (2, 3) for v in batches[0]))
    if one or given:
        batches = [batches]
    for item in batches:
        if isinstance(item, Microbatches) or (isinstance(item, (tuple, list)) and len(item) in (2, 3)
                                              and isinstance(item[0], Microbatches)):
            x, target, given = batch_item(item, "evaluate")
            yield from (zip(x, target, given) if given is not None else zip(x, target))
        else:
            yield item


def evaluate(predict: Callable[..., Any], batches: Any, metrics: Mapping[str, Metric] | None,
             loss_fn: Callable | None, loss_weighting: str = "sample") -> dict[str, float]:
    """The sample means of the loss (when ``loss_fn`` is given), accuracy (classification) and
    ``metrics`` over ``batches`` (an iterable of ``(x, target)`` or ``(x, target, stage_inputs)``,
    or one of them), with ``predict(x)`` (``predict(x, stage_inputs=...)``) giving each batch's
    output. See the module's docstring."""
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError("loss_fn must be callable as loss_fn(output, target)")
    chosen = check_metrics(metrics)
    named: dict[str, Metric] = {}
    summed = loss_fn is not None and loss_weight_mode(loss_fn) == "sum" and "loss" not in chosen
    if loss_fn is not None:
        named["loss"] = loss_fn
    named["accuracy"] = accuracy
    named.update(chosen)  # a metric named like a default replaces it
    sums = dict.fromkeys(named, 0.0)
    classify = True  # the default accuracy: while every batch is a classification one
    count = 0
    loss_count = 0.0  # what the loss is a mean over: samples, or tokens (loss_weighting="token")
    by_tokens = loss_fn is not None and loss_weighting == "token" and not summed
    for i, pair in enumerate(_batches(batches)):
        if not (isinstance(pair, (tuple, list)) and len(pair) in (2, 3)):
            raise ValueError(f"evaluation batch {i} is a {type(pair).__name__}, not an (x, target) pair "
                             "(or an (x, target, stage_inputs) triple)")
        x, target = pair[0], pair[1]
        target, n = check_batch(f"evaluation batch {i}'s target", target)
        output = predict(x) if len(pair) == 2 else predict(x, stage_inputs=pair[2])
        if "accuracy" not in chosen:  # (the user's accuracy is always computed)
            classify = (classify and isinstance(output, torch.Tensor) and isinstance(target, torch.Tensor)
                        and is_classification(output, target))
        for name, fn in named.items():
            if name == "accuracy" and not classify:
                continue
            value = _value(name, fn, output, target)
            if name == "loss" and by_tokens:
                weight = tokens(loss_fn, target)
                sums[name] += value * weight if weight else 0.0
                loss_count += weight
            else:
                sums[name] += value if name == "loss" and summed else value * n  # a summed loss: already x n
        count += n
    if count == 0:
        raise ValueError("the evaluation set holds no batch")
    out = {name: total / count for name, total in sums.items() if name != "accuracy" or classify}
    if by_tokens and "loss" in out:
        out["loss"] = sums["loss"] / loss_count if loss_count else float("nan")
    return out
