"""The traced split: torch.export with dynamic shapes, cut by torch.distributed.pipelining's splitter.

:func:`trace_stages` exports a deep copy of the model (``torch.export.export``, every dimension
of its input tensors dynamic unless the model fixes it or ``dynamic=`` says otherwise, so a stage
runs any microbatch size and sequence length: :mod:`pipeq.split.dims`), marks the split points the way
``torch.distributed.pipelining.pipeline()`` does (``annotate_split_points``, a ``pipe_split()``
before each named module) and lets that package's splitter cut the exported graph into one
``GraphModule`` per stage. What pipeq adds is the plan of what flows where
(:class:`Flow`): which values each stage receives from the one before (skip connections ride
through the stages in between), which keyword inputs come straight from the driver, and what the
last stage returns, and which input dimensions stayed dynamic. Sizes a later stage needs (the
batch and the sequence length, symbols of the trace) are values of the plan like any other: they
travel between stage processes as 0-d tensors (:class:`~pipeq.split.stage.GraphStage`).
"""

from __future__ import annotations

import copy
import inspect
import operator
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch
from torch import fx, nn

from pipeq.split import dims

__all__ = ["Flow", "StageFlow", "trace_stages", "mark_constants", "mark_non_persistent", "unsaved_buffers",
           "move_graphs", "UntraceableModel"]

FALLBACK = ("split by module names instead: pipeq.split(model, modules=[[names of stage 0's modules], "
            "[stage 1's], ...]) runs the model's own forward on each stage")


class UntraceableModel(ValueError):
    """torch.export could not capture the model's forward as one graph."""


@dataclass(frozen=True)
class StageFlow:
    """What stage k of a traced split takes and gives (values named by the top graph's nodes)."""

    receives: tuple[str, ...]  # from the stage before (stage 0: the model's positional inputs)
    named: tuple[str, ...]  # keyword inputs straight from the driver
    call: tuple[str, ...]  # the stage graph's arguments, in order
    produces: tuple[str, ...]  # names the stage graph's results bind: the whole result, or items of it
    picks: tuple[int, ...]  # which item of the result each of ``produces`` is (empty: the whole result)
    sends: tuple[str, ...]  # to the stage after (the last stage: the model's output leaves)
    int_inputs: tuple[int, ...] = ()  # positions in ``call`` that are Python ints (symbolic sizes)


@dataclass(frozen=True)
class Flow:
    """Every stage's :class:`StageFlow`, and the model's output structure."""

    stages: tuple[StageFlow, ...]
    out_spec: Any  # torch.utils._pytree spec of the model's output
    #: each input tensor's dimensions that may change size, with their range (lowest, highest or None)
    dynamic: dict[str, dict[int, tuple[int, int | None]]] = field(default_factory=dict)
    static: dict[str, dict[int, int]] = field(default_factory=dict)  # and those fixed, with their size
    why_static: dict[str, dict[int, str]] = field(default_factory=dict)  # and why each is fixed


def _export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic: Any) -> tuple[Any, dims.Request]:
    request = dims.requested(model, args, kwargs, dynamic)
    try:
        return torch.export.export(model, args, kwargs, dynamic_shapes=request.shapes), request
    except Exception as exc:  # torch says which construct: keep its first lines
        specialized = dims.explain(exc, request)
        if specialized is not None:
            raise specialized from exc
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()][:6]
        raise UntraceableModel(
            f"pipeq.split could not trace {type(model).__name__}.forward with torch.export "
            f"({type(exc).__name__}: {' '.join(lines)}); {FALLBACK}") from exc


def _picklable(module: nn.Module) -> nn.Module:
    """``module`` with every graph below it (``torch.export``'s InterpreterModules, the
    splitter's stage modules) rebuilt as a plain ``fx.GraphModule`` (same graph and names):
    those pickle, to reach a stage process, and run compiled code rather than an interpreter."""
    for name, child in list(module.named_children()):
        setattr(module, name, _picklable(child))
    graph = getattr(module, "graph", None)
    if not isinstance(graph, fx.Graph):
        return module
    for node in graph.nodes:
        node.meta = {}  # export's fake tensors: nothing a stage needs, and they do not pickle
    gm = fx.GraphModule(module, graph, class_name=type(module).__name__)
    for name, child in module.named_children():  # a container's entries, called by its parent
        if name not in gm._modules:
            gm.add_module(name, child)
    return gm


def mark_constants(module: nn.Module) -> None:
    """The constants the trace lifted into buffers (a causal mask...) are no state of the
    model's: out of ``state_dict`` (again after unpickling, which forgets it)."""
    for m in module.modules():
        for name in m._buffers:
            if name.startswith(("_tensor_constant", "_lifted_tensor_constant")):
                m._non_persistent_buffers_set.add(name)


def mark_non_persistent(module: nn.Module, model: nn.Module | None = None, names: Sequence[str] = ()) -> None:
    """The buffers ``model`` registered as non-persistent (RoPE's ``inv_freq``), and ``names``,
    stay out of ``module``'s ``state_dict`` (``module``'s tensors are under ``model``'s names)."""
    for name, _ in module.named_buffers(remove_duplicate=False):
        owner, _, leaf = name.rpartition(".")
        if name not in names:
            try:
                if model is None or leaf not in model.get_submodule(owner)._non_persistent_buffers_set:
                    continue
            except AttributeError:  # not a module of the model's (a lifted constant)
                continue
        module.get_submodule(owner)._non_persistent_buffers_set.add(leaf)


def move_graphs(graphs: Sequence[nn.Module], device: torch.device) -> bool:
    """Point every device the trace burnt into the code of ``graphs`` (and their submodules) at
    ``device``: a ``torch.arange(T, device=x.device)`` of position ids traced on the CPU is an
    ``arange`` node with ``device=cpu`` once its length is dynamic. Its ``device=`` keyword, and
    ``aten.to.device``'s device, are rewritten, as torch's ``move_to_device_pass`` does for an
    ``ExportedProgram``. True when some code changed (it is recompiled)."""
    moved = False
    for graph in graphs:
        for gm in graph.modules():
            if not isinstance(gm, fx.GraphModule):
                continue
            changed = False
            for node in gm.graph.nodes:
                old = node.kwargs.get("device")
                if isinstance(old, (torch.device, str)) and torch.device(old) != device:
                    node.kwargs = {**node.kwargs, "device": device}
                    changed = True
                if (node.op == "call_function" and node.target is torch.ops.aten.to.device
                        and len(node.args) > 1 and torch.device(node.args[1]) != device):
                    node.args = (node.args[0], device, *node.args[2:])
                    changed = True
            if changed:
                gm.recompile()
                moved = True
    return moved


def unsaved_buffers(module: nn.Module) -> tuple[str, ...]:
    """The buffers of ``module`` outside its ``state_dict`` (to mark again after unpickling,
    which rebuilds graph modules with every buffer persistent: :func:`mark_non_persistent`)."""
    saved = module.state_dict(keep_vars=True)
    return tuple(name for name, _ in module.named_buffers(remove_duplicate=False) if name not in saved)


def _plain_codegen(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` taking its placeholders positionally, in graph order (no pytree input spec)."""
    if type(gm.graph._codegen) is not fx.graph.CodeGen:
        gm.graph._codegen = fx.graph.CodeGen()
        gm.recompile()
    return gm


def _codes(module: nn.Module) -> list[str]:
    return [m.code for m in module.modules() if isinstance(m, fx.GraphModule)]


def _reads_mode(model: nn.Module) -> bool:
    """Whether a forward of ``model`` may depend on train / eval mode: some module's class reads
    ``training`` (dropout, batch norm...), or its source cannot be read (then assume it does)."""
    for cls in {type(m) for m in model.modules()}:
        if cls.forward is nn.Module.forward:
            continue
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            return True
        if "training" in source:
            return True
    return False


def trace_stages(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], points: Sequence[str],
                 dynamic: Any = None) -> tuple[list[fx.GraphModule], list[fx.GraphModule | None], Flow]:
    """Each stage's graph module (its tensors under the model's own names), its graph in eval
    mode when that differs (dropout, batch norm: export fixes the mode into the graph; None
    otherwise), and the :class:`Flow` between them, for stages beginning at the modules
    ``points`` (in execution order). ``dynamic``: which input dimensions may change size
    (:func:`pipeq.split.dims.requested`; None: every one the model allows)."""
    training = model.training
    try:
        graphs, flow = _trace(model.train(), args, kwargs, points, dynamic)
        if not _reads_mode(model):
            return graphs, [None] * len(graphs), flow
        evals, eval_flow = _trace(model.eval(), args, kwargs, points, dynamic)
    finally:
        model.train(training)
    if eval_flow.stages != flow.stages:
        raise ValueError("the model's forward sends other values between the split points in eval mode than "
                         "in training mode; pipeq.split cannot run both: split by module names instead")
    return graphs, [e if _codes(e) != _codes(g) else None for g, e in zip(graphs, evals)], flow


def _trace(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], points: Sequence[str],
           dynamic: Any) -> tuple[list[fx.GraphModule], Flow]:
    """One trace of ``model`` (in its current mode) cut at ``points``."""
    from torch.distributed.pipelining import SplitPoint
    from torch.distributed.pipelining._IR import MultiUseParameterConfig, Pipe, annotate_split_points

    work = copy.deepcopy(model)  # the split points wrap forwards: never the caller's model
    annotate_split_points(work, {p: SplitPoint.BEGINNING for p in points})
    program, request = _export(work, args, kwargs, dynamic)
    varying, fixed, why = dims.read_back(program, model, args, kwargs, request)
    pipe = Pipe._from_traced(work, program, MultiUseParameterConfig.REPLICATE)
    if pipe.num_stages != len(points) + 1:
        raise ValueError(f"split points {list(points)} made {pipe.num_stages} stages, not {len(points) + 1}: "
                         "a split point must be a module the forward calls, in the order it calls them")
    modules = [pipe.get_stage_module(k) for k in range(pipe.num_stages)]
    ints = [tuple(i for i, p in enumerate(n for n in m.graph.nodes if n.op == "placeholder")
                  if isinstance(p.meta.get("val"), (int, torch.SymInt))) for m in modules]
    graphs = [_plain_codegen(_picklable(m)) for m in modules]
    for g in graphs:
        mark_constants(g)
        mark_non_persistent(g, model)
    with torch.no_grad():
        out_spec = torch.utils._pytree.tree_flatten(model(*args, **kwargs))[1]
    return graphs, replace(_flow(pipe.split_gm.graph, ints, len(args), out_spec), dynamic=varying, static=fixed,
                           why_static=why)


def _flow(top: fx.Graph, ints: Sequence[tuple[int, ...]], n_positional: int, out_spec: Any) -> Flow:
    """Who produces and who consumes each value of the top graph (see :class:`Flow`)."""
    placeholders = [n for n in top.nodes if n.op == "placeholder"]
    positional = [n.name for n in placeholders[:n_positional]]
    keywords = {n.name for n in placeholders[n_positional:]}
    calls = [n for n in top.nodes if n.op == "call_module"]
    made_at: dict[str, int] = {name: 0 for name in positional}  # value -> the stage that has it first
    used_at: dict[str, int] = {}  # value -> the last stage that needs it
    produces: list[tuple[str, ...]] = []
    picks: list[tuple[int, ...]] = []
    for k, call in enumerate(calls):
        items = [u for u in call.users if u.op == "call_function" and u.target is operator.getitem]
        items.sort(key=lambda u: u.args[1])
        names = tuple(u.name for u in items) if items else (call.name,)
        produces.append(names)
        picks.append(tuple(int(u.args[1]) for u in items))
        for name in names:
            made_at[name] = k
        for a in call.args:
            if isinstance(a, fx.Node) and a.name not in keywords:
                used_at[a.name] = max(used_at.get(a.name, 0), k)
    last = len(calls) - 1
    output = next(n for n in top.nodes if n.op == "output")
    out_leaves = [a.name for a in torch.utils._pytree.tree_leaves(output.args[0]) if isinstance(a, fx.Node)]
    for name in out_leaves:
        used_at[name] = last
    order = positional + [n for names in produces for n in names]
    stages = []
    for k, call in enumerate(calls):
        receives = positional if k == 0 else [v for v in order if made_at.get(v, last + 1) < k <= used_at.get(v, -1)]
        sends = out_leaves if k == last else [v for v in order if made_at.get(v, last + 1) <= k < used_at.get(v, -1)]
        args = [a.name for a in call.args if isinstance(a, fx.Node)]
        stages.append(StageFlow(tuple(receives), tuple(a for a in args if a in keywords), tuple(args),
                                produces[k], picks[k], tuple(sends), ints[k]))
    return Flow(tuple(stages), out_spec)
