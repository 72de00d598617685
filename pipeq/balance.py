"""Balanced stages: split one ``nn.Sequential`` into pipeline stages of about equal cost.

    counts = pipeq.balance(model, 3, sample, by="time")     # e.g. [5, 2, 1] layers per stage
    runner = pipeq.PipelineRunner(model, loss_fn, optimizer, balance=counts)
    stages = pipeq.balance.split(model, counts)              # the stage modules themselves

A pipeline runs as fast as its slowest stage: an equal number of layers per stage is balanced
only when the layers cost the same. :func:`profile_times` measures each layer's forward and
backward time (:func:`profile_sizes`: its parameter and activation bytes) on a sample batch, and
:func:`partition` cuts the layers into contiguous stages whose largest cost is as small as it can
be (exactly, not by a heuristic). The idea is torchgpipe's ``balance_by_time`` /
``balance_by_size``; the code is pipeq's own.

``pipeq.balance`` is this module, and calling it calls :func:`balance`: the package exposes the
module (``pipeq.balance.split``...) under the name of its main function.

Layers are the model's children, in order; a layer's output is the next layer's input, a tuple
being passed as its arguments, as between pipeq's stages. Profiling runs on copies of the
layers, under a forked RNG: the model, its gradients, buffers (batch-norm statistics) and the
caller's random stream are left exactly as they were.
"""

from __future__ import annotations

import copy
import math
import statistics
import sys
import time
import types
from typing import Any, Sequence

import torch
from torch import nn

from pipeq.tree import as_args

__all__ = ["balance", "partition", "profile_sizes", "profile_times", "split", "stages_for", "BY"]

#: What :func:`balance` can balance: measured time, or parameter + activation memory.
BY = ("time", "memory")

# -- the model's layers -----------------------------------------------------------------------

def layers_of(model: Any, what: str = "model") -> list[nn.Module]:
    """The children of ``model``, checked: an ``nn.Sequential`` of at least one layer that holds
    no parameter or buffer of its own (every tensor must go with one of its layers)."""
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"{what} must be an nn.Sequential whose children are the layers to split, got "
                         f"{type(model).__name__}; wrap the layers: nn.Sequential(layer_0, layer_1, ...)")
    layers = list(model.children())
    if not layers:
        raise ValueError(f"{what} is an empty nn.Sequential: there are no layers to split into stages")
    own = [n for n, _ in model.named_parameters(recurse=False)] + [n for n, _ in model.named_buffers(recurse=False)]
    if own:
        raise ValueError(f"{what} holds {own} itself, outside its layers; stages are made of its children only: "
                         "move those tensors into one of the layers")
    return layers


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in as_args(value) if isinstance(t, torch.Tensor)]


def _check_sample(sample: Any) -> None:
    if not _tensors(sample) or not all(isinstance(t, torch.Tensor) for t in as_args(sample)):
        raise ValueError("sample must be the model's input: a tensor or a tuple of tensors (one microbatch "
                         f"is the most faithful size), got {type(sample).__name__}")


def _leaf_inputs(value: Any, device: torch.device) -> tuple[Any, ...]:
    """A layer's inputs, cut from the previous layer's graph and on ``device``: floating tensors
    need a gradient, as they do on every stage but the first."""
    out = []
    for t in as_args(value):
        if isinstance(t, torch.Tensor):
            t = t.detach().to(device)
            if t.is_floating_point():
                t.requires_grad_(True)
        out.append(t)
    return tuple(out)


def _backward(output: Any) -> None:
    """Backward from every output that has a graph, with a gradient of ones (the values do not
    matter for timing; the work does)."""
    outs = [t for t in _tensors(output) if t.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sandbox(model: nn.Sequential, device: "torch.device | str | None") -> tuple[list[nn.Module], torch.device]:
    """Private copies of the layers (in the modes they are in: the runner keeps a submodule put
    in eval mode in eval mode) on ``device`` (default: where the model's first parameter is,
    else the CPU)."""
    layers = layers_of(model)
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    device = torch.device(device)
    copies = [copy.deepcopy(layer).to(device) for layer in layers]
    for layer in copies:
        for p in layer.parameters():
            p.grad = None
    return copies, device


def _forked_rng(device: torch.device) -> Any:
    """The caller's random stream, put back afterwards (dropout in the profiled layers draws)."""
    if device.type != "cuda":
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=[device.index if device.index is not None else torch.cuda.current_device()])


# -- measuring ----------------------------------------------------------------------------------

def profile_times(model: nn.Sequential, sample: Any, *, repeats: int = 8, warmup: int = 1,
                  device: "torch.device | str | None" = None) -> list[float]:
    """Seconds of forward + backward of each layer of ``model`` on ``sample``: the lower quartile
    of ``repeats`` timed passes after ``warmup`` untimed ones (allocations, lazy initialisation).

    The lower quartile, not the median: on a busy machine a pass is often descheduled, which only
    ever makes it slower, and the quartile holds while up to three quarters of the passes are (the
    median, half). The passes go through all layers in turn, so a busy spell slows every layer
    alike. Each layer is timed on its own (its input cut from the previous layer's graph), so
    the figure is the work that layer adds to a stage. Threads: torch runs with
    ``torch.get_num_threads()``; set it as the stages will (``threads_per_stage``)."""
    if type(repeats) is not int or repeats < 1 or type(warmup) is not int or warmup < 0:
        raise ValueError(f"repeats must be a positive integer and warmup 0 or more, got {repeats!r}, {warmup!r}")
    _check_sample(sample)
    layers, dev = _sandbox(model, device)
    runs: list[list[float]] = [[] for _ in layers]
    with _forked_rng(dev), torch.enable_grad():
        for r in range(warmup + repeats):
            x: Any = sample
            for k, layer in enumerate(layers):
                inputs = _leaf_inputs(x, dev)
                _sync(dev)
                t0 = time.perf_counter()
                x = layer(*inputs)
                _backward(x)
                _sync(dev)
                if r >= warmup:
                    runs[k].append(time.perf_counter() - t0)
                for p in layer.parameters():
                    p.grad = None
    return [_lower_quartile(ts) for ts in runs]


def _lower_quartile(values: list[float]) -> float:
    return statistics.quantiles(values, n=4, method="inclusive")[0] if len(values) > 1 else values[0]


def profile_sizes(model: nn.Sequential, sample: Any, *, param_scale: float = 2.0,
                  device: "torch.device | str | None" = None) -> list[int]:
    """Bytes each layer of ``model`` holds in training: its parameters and buffers, the
    parameters counted ``param_scale`` times (2: a parameter and its gradient; 3 with SGD's
    momentum, 4 with Adam's two moments), plus the activations autograd keeps for its backward
    on ``sample`` (per microbatch in flight, when ``sample`` is one microbatch)."""
    if not isinstance(param_scale, (int, float)) or isinstance(param_scale, bool) or not param_scale >= 0:
        raise ValueError(f"param_scale must be a number >= 0 (2: parameters and gradients), got {param_scale!r}")
    _check_sample(sample)
    layers, dev = _sandbox(model, device)
    sizes = []
    with _forked_rng(dev), torch.enable_grad():
        x: Any = sample
        for layer in layers:
            kept = _ActivationBytes(layer)
            inputs = _leaf_inputs(x, dev)
            with torch.autograd.graph.saved_tensors_hooks(kept.pack, kept.unpack):
                x = layer(*inputs)
            params = sum(_nbytes(p) for p in layer.parameters())
            buffers = sum(_nbytes(b) for b in layer.buffers())
            sizes.append(int(param_scale * params) + buffers + kept.total)
    return sizes


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _ActivationBytes:
    """Counts the tensors autograd saves for the backward, each storage once, leaving out the
    layer's own parameters and buffers (counted as such)."""

    def __init__(self, layer: nn.Module) -> None:
        self.own = {_storage(t) for t in [*layer.parameters(), *layer.buffers()]}
        self.seen: set[int] = set()
        self.total = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage(t)
        if key not in self.own and key not in self.seen:
            self.seen.add(key)
            self.total += t.untyped_storage().nbytes()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# -- partitioning -------------------------------------------------------------------------------

def _check_partition(costs: Sequence[float], n_stages: int) -> list[float]:
    if type(n_stages) is not int or n_stages < 1:
        raise ValueError(f"n_stages must be a positive integer, got {n_stages!r}")
    costs = list(costs)
    if not costs:
        raise ValueError("costs is empty: there are no layers to split into stages")
    if not all(isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) and c >= 0
               for c in costs):
        raise ValueError(f"costs must be finite numbers >= 0 (one per layer), got {costs!r}")
    if n_stages > len(costs):
        raise ValueError(f"n_stages={n_stages} but there are only {len(costs)} layers: every stage needs at "
                         f"least one layer, so use at most {len(costs)} stages (or split the layers finer)")
    return [float(c) for c in costs]


def _bottleneck(prefix: list[float], n_stages: int) -> float:
    """The smallest possible largest stage cost (exact): ``best[m]`` is that of the first m
    layers in j stages. The previous row grows with m, the last stage's cost shrinks as it
    starts later, so the best cut is where they cross: found by bisection."""
    n = len(prefix) - 1
    best = prefix[:]  # one stage: the first m layers together
    for j in range(2, n_stages + 1):
        row = [math.inf] * (n + 1)
        for m in range(j, n + 1):
            lo, hi = j - 1, m - 1  # the last stage is layers i..m-1, i in [j-1, m-1]
            while lo < hi:  # the first i where the earlier stages cost at least the last one
                mid = (lo + hi) // 2
                if best[mid] >= prefix[m] - prefix[mid]:
                    hi = mid
                else:
                    lo = mid + 1
            row[m] = min(max(best[i], prefix[m] - prefix[i]) for i in (lo - 1, lo) if j - 1 <= i <= m - 1)
        best = row
    return best[n]


def partition(costs: Sequence[float], n_stages: int) -> list[int]:
    """Layer counts per stage (each >= 1, summing to ``len(costs)``) of a contiguous split of
    the layers that minimises the largest stage cost: an optimal one, not an approximation.

    Among the optimal splits it takes the one whose stages are most even (least sum of squared
    stage costs, then of squared layer counts), so the stages that are not the bottleneck are
    balanced too."""
    costs = _check_partition(costs, n_stages)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    limit = _bottleneck(prefix, n_stages)
    limit += 1e-9 * max(limit, 1.0)  # float sums of the same layers may differ in the last bit
    return _most_even(prefix, n_stages, limit)


def _most_even(prefix: list[float], n_stages: int, limit: float) -> list[int]:
    """The split into ``n_stages`` stages, none costing over ``limit``, with the least
    (sum of squared costs, sum of squared counts); as counts."""
    n = len(prefix) - 1
    inf = (math.inf, math.inf)
    # score[j][m]: the first m layers in j stages; start[j][m]: where the j-th stage starts
    score = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    start = [[0] * (n + 1) for _ in range(n_stages + 1)]
    score[0][0] = (0.0, 0.0)
    for j in range(1, n_stages + 1):
        for m in range(j, n - (n_stages - j) + 1):
            for i in range(m - 1, j - 2, -1):  # the stage is layers i..m-1
                cost = prefix[m] - prefix[i]
                if cost > limit:
                    break  # starting earlier only adds layers
                prev = score[j - 1][i]
                cand = (prev[0] + cost * cost, prev[1] + (m - i) ** 2)
                if cand < score[j][m]:
                    score[j][m], start[j][m] = cand, i
    counts, m = [], n
    for j in range(n_stages, 0, -1):
        counts.append(m - start[j][m])
        m = start[j][m]
    return counts[::-1]


# -- the public entry points --------------------------------------------------------------------

def balance(model: nn.Sequential, n_stages: int, sample: Any, by: str = "time", *, repeats: int = 8,
            param_scale: float = 2.0, device: "torch.device | str | None" = None) -> list[int]:
    """Layer counts per stage that balance ``model``'s layers over ``n_stages`` stages by measured
    forward + backward time (``by="time"``, :func:`profile_times`) or by parameter + activation
    memory (``by="memory"``, :func:`profile_sizes`) on ``sample`` (the model's input: a tensor or
    a tuple of tensors; one microbatch is the most faithful). Pass the result to
    ``PipelineRunner(model, ..., balance=counts)`` or :func:`split`. The model is left as it was."""
    if by not in BY:
        raise ValueError(f"by must be one of {BY}, got {by!r}")
    n_layers = len(layers_of(model))
    _check_partition([0.0] * n_layers, n_stages)  # a wrong count fails before anything is measured
    if by == "time":
        costs: list[float] = profile_times(model, sample, repeats=repeats, device=device)
    else:
        costs = [float(s) for s in profile_sizes(model, sample, param_scale=param_scale, device=device)]
    return partition(costs, n_stages)


def check_counts(counts: Any, n_layers: int, what: str = "balance") -> list[int]:
    """``counts`` as a list of ints, checked: each at least 1, summing to ``n_layers``."""
    if isinstance(counts, str):
        raise ValueError(f"{what}={counts!r}: give layer counts per stage, e.g. {what}=[3, 2, 1]; measure them "
                         f"with pipeq.balance(model, n_stages, sample, by={counts!r})")
    if not isinstance(counts, (list, tuple)) or not counts or not all(type(c) is int for c in counts):
        raise ValueError(f"{what} must be a non-empty list of layer counts per stage (integers), got {counts!r}; "
                         "pipeq.balance(model, n_stages, sample) measures them")
    if min(counts) < 1:
        raise ValueError(f"{what}={list(counts)}: every stage needs at least one layer")
    if sum(counts) != n_layers:
        raise ValueError(f"{what}={list(counts)} counts {sum(counts)} layers, but the model has {n_layers}: the "
                         "counts must add up to the number of layers (the model's children)")
    return list(counts)


def split(model: nn.Sequential, counts: Sequence[int]) -> list[nn.Sequential]:
    """The stages: ``nn.Sequential`` s of ``model``'s children (the same modules, not copies),
    ``counts[k]`` of them in stage k. ``pipeq.checkpoint.flat_model(stages)`` names their tensors
    as ``model`` does when its children have index names (the usual ``nn.Sequential(a, b, c)``)."""
    layers = layers_of(model)
    counts = check_counts(counts, len(layers), "counts")
    stages, start = [], 0
    for c in counts:
        stages.append(nn.Sequential(*layers[start:start + c]))
        start += c
    return stages


def stages_for(model: Any, counts: Any) -> Any:
    """What ``PipelineRunner(model, ..., balance=counts)`` trains: ``model`` split by
    ``counts``; without counts, ``model`` as given (a list of stages, or a recipe)."""
    if counts is None:
        return model
    if isinstance(model, (list, tuple)):
        raise ValueError("balance= splits one nn.Sequential, but a list of stages was given: pass the whole "
                         "model (nn.Sequential(*layers)) with balance=, or the stages without it")
    if not isinstance(model, nn.Module):
        raise ValueError(f"balance= splits an nn.Sequential, got a {type(model).__name__}; a job recipe names "
                         "its own split (model and balance in the job file)")
    layers = layers_of(model)
    return split(model, check_counts(counts, len(layers)))


class _CallableModule(types.ModuleType):
    """``pipeq.balance(model, n_stages, sample)`` calls :func:`balance`: the package names this
    module after its main function, and importing the module would replace a function of that
    name on the package anyway."""

    def __call__(self, *args: Any, **kwargs: Any) -> list[int]:
        return balance(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
