"""``pipeq.split``: a whole model cut into pipeline stages, traced or by module names.

    stages = pipeq.split(model, (tokens,), n_stages=4)                 # traced, balanced
    stages = pipeq.split(model, (tokens,), split_points=["blocks.2"])  # traced, cut where named
    stages = pipeq.split(model, modules=[["tok_emb", "blocks.0"], ["blocks.1", "norm", "lm_head"]])
    runner = pipeq.PipelineRunner(stages, loss_fn, optimizer, schedule="1f1b")

Traced (:mod:`pipeq.split.graph`): ``torch.export`` captures the forward on the example inputs
(one microbatch; every dimension the model lets vary stays dynamic -- the batch, the sequence
length --, ``dynamic=`` to fix or name them, ``stages.dynamic`` says which:
:mod:`pipeq.split.dims`) and ``torch.distributed.pipelining``'s splitter cuts the graph before
each split point. ``n_stages`` picks the points among the model's children and the
entries of its ModuleLists / Sequentials (``blocks.3``, ``transformer.h.0``), balancing parameter
counts (deterministic: every process of a job gets the same split), or the measured time or
memory of each piece (``balance="time" | "memory"``, :mod:`pipeq.balance`). A value that a later
stage needs rides through the stages in between (a skip connection); a keyword input of the
model (an attention mask, position ids) goes from the driver straight to the stages that use
it: ``runner.step(x, y, stage_inputs={"mask": m})``.

By module names (:mod:`pipeq.split.by_name`), for a forward that cannot be traced: each stage is
a copy of the model keeping only its modules, running the model's own forward (torchtitan's
``module_fqns_per_model_part``); in a Hugging Face model, a module another stage holds passes
its input on, and the stages are checked against the model on the example inputs.

Either way, each stage's tensors keep the model's own names (its ``state_dict`` is the model's
part; ``runner.state_dict()`` loads into the model), and a parameter that several stages use
(an embedding tied to the LM head) is a copy on each, kept bitwise equal by the runner
(``pipeq_stage.ties``, :mod:`pipeq.stage.info`).

Its modules: :mod:`~pipeq.split.graph` (the traced split), :mod:`~pipeq.split.dims` (which input
dimensions may change size), :mod:`~pipeq.split.points` (where a
traced model may be cut, and where for N balanced stages), :mod:`~pipeq.split.stage`
(:class:`GraphStage`), :mod:`~pipeq.split.by_name` and :mod:`~pipeq.split.ties` (the model's own
sharing, declared as ties through :mod:`pipeq.stage.tie_groups`).
"""

from __future__ import annotations

import sys
import types
import warnings
from typing import Any, Sequence

import torch
from torch import nn

from pipeq import balance as balancing
from pipeq.split import points as cuts
from pipeq.split.by_name import own_mapping, split_by_names, without_cache
from pipeq.split.dims import SpecializedDim, describe, limits_of
from pipeq.split.graph import UntraceableModel, trace_stages
from pipeq.split.stage import GraphStage
from pipeq.split.ties import declared_groups, tie_stages
from pipeq.stage.info import set_info

__all__ = ["split", "Split", "GraphStage", "UntraceableModel", "SpecializedDim"]


class Split(list):
    """The stages :func:`split` made (a list of ``nn.Module``), and the points it cut at. A traced
    split also says which dimensions of its inputs may change size from batch to batch
    (``dynamic``: input -> {dim: (lowest, highest or None)}) and which the trace fixed
    (``static``: input -> {dim: size}; the model's code needs that size, or the example had 0 or 1
    there, or ``dynamic=`` fixed it; ``why_static`` and :meth:`explain` say which). All are empty
    for a split by module names (it runs the model's own forward: any shape the model takes)."""

    split_points: list[str]
    dynamic: dict[str, dict[int, tuple[int, int | None]]]
    static: dict[str, dict[int, int]]
    why_static: dict[str, dict[int, str]]  # input -> {dim: why the trace fixed it}

    def explain(self) -> str:
        """Each input's dimensions, one line per input: those that vary (and their range), those
        fixed (and why: the example's size, ``dynamic=``, or the model's code)."""
        return describe(self.dynamic, self.static, self.why_static)

    def __repr__(self) -> str:
        varying = {name: sorted(d) for name, d in self.dynamic.items()}
        return f"Split({len(self)} stages, split_points={self.split_points}, dynamic={varying}, static={self.static})"


def _example(model: nn.Module, args: Any, kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    args = args if isinstance(args, tuple) else (args,)
    kwargs = dict(kwargs or {})
    for name, v in [*((f"example_args[{i}]", a) for i, a in enumerate(args)),
                    *((f"example_kwargs[{k!r}]", v) for k, v in kwargs.items())]:
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] < 2:
            raise ValueError(f"{name} has batch size {v.shape[0]}: give an example microbatch of 2 or more "
                             "samples (torch.export would fix a batch of 1 into the graph)")
    if not args:
        raise ValueError(f"pass example inputs of {type(model).__name__}.forward: pipeq.split(model, (x,), ...)")
    return args, kwargs


def _points(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], n_stages: Any, split_points: Any,
            balance: Any, dynamic: Any) -> list[str]:
    if split_points is not None:
        if n_stages is not None and n_stages != len(split_points) + 1:
            raise ValueError(f"n_stages={n_stages} but {len(split_points)} split points make "
                             f"{len(split_points) + 1} stages: pass one of them")
        if not isinstance(split_points, (list, tuple)) or not all(type(p) is str for p in split_points):
            raise ValueError(f"split_points must be module names, e.g. ['blocks.2'], got {split_points!r}")
        return list(split_points)
    if type(n_stages) is not int or n_stages < 1:
        raise ValueError(f"pass n_stages (a positive integer), split_points or modules; got n_stages={n_stages!r}")
    order, costs = cuts.candidates(model, args, kwargs)
    if n_stages == 1:
        return []
    if balance is None:
        return cuts.choose(order, costs, n_stages)
    if balance not in balancing.BY:
        raise ValueError(f"balance must be one of {', '.join(map(repr, balancing.BY))} or None, got {balance!r}")
    measured = _measure(model, args, kwargs, order[1:], balance, dynamic)
    return cuts.choose(order, measured, n_stages)


def _measure(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], points: list[str],
             by: str, dynamic: Any) -> list[float]:
    """Each piece's cost when the model is cut at every candidate point (:mod:`pipeq.balance`)."""
    graphs, _, flow = trace_stages(model, args, kwargs, points, dynamic)
    pieces = [_Bound(GraphStage(k, g, f, flow.out_spec, k == len(graphs) - 1), {n: kwargs[n] for n in f.named})
              for k, (g, f) in enumerate(zip(graphs, flow.stages))]
    chain = nn.Sequential(*pieces)
    if by == "time":
        return balancing.profile_times(chain, args)
    return [float(b) for b in balancing.profile_sizes(chain, args)]


class _Bound(nn.Module):
    """A piece run with its keyword inputs bound (for profiling a chain of pieces)."""

    def __init__(self, stage: nn.Module, named: dict[str, Any]) -> None:
        super().__init__()
        self.stage = stage
        self.named = named

    def forward(self, *received: Any) -> Any:
        return self.stage(*received, **self.named)


def split(model: nn.Module, example_args: Any = (), example_kwargs: dict[str, Any] | None = None, *,
          n_stages: int | None = None, split_points: Sequence[str] | None = None, balance: str | None = None,
          modules: Sequence[Sequence[str]] | None = None, ties: Sequence[Sequence[str]] | None = None,
          dynamic: bool | dict[str, Any] | None = None) -> Split:
    """``model`` as pipeline stages (see the module): traced at ``split_points`` or into
    ``n_stages`` balanced ones, or by ``modules`` (each stage's module names). ``example_args``
    / ``example_kwargs``: one microbatch of the forward's inputs. ``ties``: groups of parameter
    names to train as one beside those the model already shares (the first name's value is kept).
    ``dynamic`` (traced): which input dimensions may change size -- by default every one the model
    lets vary; False: only the batch (dim 0); a dict of input name -> ``{dim: Dim or None}``
    (``torch.export.Dim``) overrides the default per dimension, a named ``Dim`` or
    ``Dim.DYNAMIC`` must stay dynamic (else :class:`SpecializedDim` says why not), ``None`` fixes
    it (:mod:`pipeq.split.dims`). The model itself is left as it was."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"pipeq.split splits an nn.Module, got {type(model).__name__}")
    model = _original(model)
    groups = declared_groups(model, ties)
    if modules is not None:
        if n_stages is not None and n_stages != len(modules) or split_points is not None or balance is not None \
                or dynamic is not None:
            raise ValueError("modules= names each stage's modules: do not pass n_stages, split_points, balance or "
                             "dynamic too (a split by module names runs the model's own forward: any shape it takes)")
        example = example_args if isinstance(example_args, tuple) else (example_args,)
        stages = Split(split_by_names(model, modules, tuple(example_kwargs or ()), example, example_kwargs))
        stages.split_points = [names[0] for names in modules[1:]]
        stages.dynamic, stages.static, stages.why_static = {}, {}, {}
    else:
        args, kwargs = _example(model, example_args, example_kwargs)
        with without_cache(model):  # a Hugging Face model's KV cache: no stage keeps one
            points = _points(model, args, kwargs, n_stages, split_points, balance, dynamic)
            graphs, evals, flow = trace_stages(model, args, kwargs, points, dynamic)
        stages = Split(set_info(GraphStage(k, g, f, flow.out_spec, k == len(graphs) - 1, e), model_names=True,
                                inputs=f.named) for k, (g, e, f) in enumerate(zip(graphs, evals, flow.stages)))
        stages.split_points = points
        stages.dynamic, stages.static, stages.why_static = flow.dynamic, flow.static, flow.why_static
        for k, (stage, f) in enumerate(zip(stages, flow.stages)):
            stage.limits = limits_of((f.receives if k == 0 else ()) + f.named, flow.dynamic, flow.static,
                                     flow.why_static)
        set_info(stages[-1], returns=own_mapping(flow.out_spec.type))
    tie_stages(stages, groups)
    return stages


def _original(model: nn.Module) -> nn.Module:
    """A model compiled before the split (``torch.compile(model)``): its original module, which
    torch.export traces (Dynamo cannot trace a compiled one), with a warning saying how stages compile."""
    while hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
        warnings.warn("pipeq.split: the model given was compiled (torch.compile): its original module is split. "
                      "To compile the stages, split the plain model and pass compile=True to the runner (each "
                      "stage process compiles its own stage)", stacklevel=4)
        model = model._orig_mod
    return model


class _CallableModule(types.ModuleType):
    """``pipeq.split(model, ...)`` calls :func:`split` (the package is named after it)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Split:
        return split(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
