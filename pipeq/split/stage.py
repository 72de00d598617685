"""A stage of a traced split: one stage's graph, run on what the stage before sent and the driver's inputs."""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from pipeq.split.dims import check_limits
from pipeq.split.graph import StageFlow, mark_constants, mark_non_persistent, move_graphs, unsaved_buffers

__all__ = ["GraphStage"]


def _modules_of(spec: Any) -> list[str]:
    """The modules defining the containers of ``spec`` (importing one registers its types)."""
    out = {getattr(spec.type, "__module__", "builtins")} if spec.type is not None else set()
    for child in spec.children() if hasattr(spec, "children") else spec.children_specs:
        out |= set(_modules_of(child))
    return sorted(out)


def _portable(spec: Any) -> Any:
    """The model output's pytree spec in a form that pickles quietly: None for one tensor, else
    its JSON and the modules that register its types (a Hugging Face ModelOutput's), or the
    spec itself when torch cannot write it."""
    if spec.is_leaf():
        return None
    try:
        return (pytree.treespec_dumps(spec), _modules_of(spec))
    except Exception:  # a type registered without a serialised name
        return spec


def _unflatten(values: list[Any], spec: Any) -> Any:
    if spec is None:
        return values[0]
    if isinstance(spec, tuple):  # (JSON, modules): the stage process may not have imported them yet
        for name in spec[1]:
            importlib.import_module(name)
        spec = pytree.treespec_loads(spec[0])
    return pytree.tree_unflatten(values, spec)


class GraphStage(nn.Module):
    """Stage ``index`` of a model cut by :func:`pipeq.split`: it runs its part of the traced graph.

    Its children, parameters and buffers are the stage graph's own, under the whole model's
    names (``blocks.2.attn.qkv.weight``), so its ``state_dict`` is the model's part. ``forward``
    takes what the stage before sent (stage 0: the model's positional inputs) and, as keyword
    arguments, the inputs the driver hands this stage (``pipeq_stage.inputs``); it returns the
    values the stages after need (a tuple), or on the last stage the model's output, shaped as
    the model returns it.
    """

    def __init__(self, index: int, graph: fx.GraphModule, flow: StageFlow, out_spec: Any, last: bool,
                 eval_graph: fx.GraphModule | None = None) -> None:
        """``eval_graph``: the stage traced in eval mode, when it differs (dropout...): it runs
        when the stage is in eval mode, on the same parameters and buffers."""
        super().__init__()
        for name, child in graph.named_children():
            self.add_module(name, child)
        for name, p in graph.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in graph.named_buffers(recurse=False):
            self.register_buffer(name, b, persistent=name not in graph._non_persistent_buffers_set)
        object.__setattr__(self, "_graph", graph)  # its code; not a child: no tensor is named twice
        object.__setattr__(self, "_eval", eval_graph)
        self._share()
        self.index = index
        self.flow = flow
        self.out_spec = _portable(out_spec)
        self.last = last
        #: the model's inputs this stage takes, and the sizes beyond dim 0 that its trace holds
        #: for them (:func:`pipeq.split.dims.limits_of`; set by :func:`pipeq.split`)
        self.limits: dict[str, Any] = {}
        self.unsaved = unsaved_buffers(self)  # non-persistent buffers (RoPE's inv_freq): again after unpickling

    def forward(self, *received: Any, **named: Any) -> Any:
        flow = self.flow
        if len(received) != len(flow.receives):
            raise ValueError(f"split stage {self.index} takes {len(flow.receives)} value(s) from the stage "
                             f"before ({', '.join(flow.receives)}), got {len(received)}")
        env = dict(zip(flow.receives, received))
        for name in flow.named:
            if name not in named:
                raise ValueError(f"split stage {self.index} needs the model's input {name!r}: pass it in "
                                 f"stage_inputs={{{name!r}: ...}}")
            env[name] = named[name]
        self.check_sizes(env)
        args = [env[a] for a in flow.call]
        for i in flow.int_inputs:  # a symbolic size sent between stages as a 0-d tensor
            if isinstance(args[i], torch.Tensor):
                args[i] = int(args[i])
        if self.training or self._eval is None:
            run = self.__dict__.get("_compiled") or type(self._graph).forward
            out = run(self, *args)
        else:
            out = (self.__dict__.get("_compiled_eval") or self._eval)(*args)
        if flow.picks:
            env.update((name, out[i]) for name, i in zip(flow.produces, flow.picks))
        else:
            env[flow.produces[0]] = out
        values = [env[v] for v in flow.sends]
        if self.last:
            return _unflatten(values, self.out_spec)
        return tuple(torch.tensor(v) if isinstance(v, int) else v for v in values)

    @property
    def model_inputs(self) -> tuple[str, ...]:
        """The model's positional inputs this stage takes, by name, in order: stage 0's (the
        driver's ``x``); none for a later stage, which takes what the stage before sends."""
        return self.flow.receives if self.index == 0 else ()

    def check_sizes(self, inputs: dict[str, Any]) -> None:
        """Refuse (ValueError) a model input, by name, of a size beyond dim 0 that this stage's
        trace does not hold (:func:`pipeq.split.dims.check_limits`); the driver calls it too, on
        every batch, before anything is sent."""
        if self.limits:
            check_limits(self.index, self.limits, inputs)
    def pipeq_compile(self, compile: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Compile the stage's graph code with ``compile`` (:func:`pipeq.stage.compiled.compile_stage`),
        not this wrapper (whose sizes sent as tensors would break the graph): its ``forward`` then
        calls the compiled code with the sizes as ints (the eval graph's too)."""
        self.__dict__["_compiled"] = compile(type(self._graph).forward)  # its own code: its own compiled entries
        if self._eval is not None:
            self.__dict__["_compiled_eval"] = compile(self._eval.forward)

    def __getstate__(self) -> dict:
        """Pickled without what :meth:`pipeq_compile` compiled (a stage process compiles its own)."""
        state = dict(super().__getstate__())
        state.pop("_compiled", None)
        state.pop("_compiled_eval", None)
        return state

    def __setstate__(self, state: dict) -> None:
        """Unpickled (in a stage process): torch.fx rebuilds each graph from its code, which turns
        a call on constants alone (``torch.arange(T)`` of position ids) into a buffer of the
        rebuilt graph (``_tensor_constant0``). The stage runs that code as itself: it takes them
        over, as buffers outside its state_dict (``.to(device)`` moves them)."""
        super().__setstate__(state)
        for name, value in self._graph.named_buffers(recurse=False):
            if not hasattr(self, name):
                self.register_buffer(name, value, persistent=False)
        mark_constants(self)
        mark_non_persistent(self, names=getattr(self, "unsaved", ()))
        if self._eval is not None:
            mark_constants(self._eval)

    def _share(self) -> None:
        """The eval graph's parameters and buffers are this stage's own (the same tensors)."""
        if self._eval is None:
            return
        params, buffers = dict(self.named_parameters(remove_duplicate=False)), dict(self.named_buffers())
        for name, _ in list(self._eval.named_parameters(remove_duplicate=False)):
            if name in params:
                owner, _, leaf = name.rpartition(".")
                self._eval.get_submodule(owner)._parameters[leaf] = params[name]
        for name, _ in list(self._eval.named_buffers(remove_duplicate=False)):
            if name in buffers:
                owner, _, leaf = name.rpartition(".")
                self._eval.get_submodule(owner)._buffers[leaf] = buffers[name]

    def train(self, mode: bool = True) -> "GraphStage":
        super().train(mode)
        if not mode:  # the eval graph runs on the training graph's tensors (re-linked: ties may have replaced some)
            self._share()
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> "GraphStage":
        super()._apply(fn, recurse)  # .to(device), .half()...: the eval graph follows
        self._share()
        placed = next(iter([*self.parameters(), *self.buffers()]), None)
        if placed is not None:  # the code's own devices (arange's) follow the tensors
            move_graphs([self._graph] + ([self._eval] if self._eval is not None else []), placed.device)
        return self

    def extra_repr(self) -> str:
        return f"stage {self.index}: receives {list(self.flow.receives)}, sends {list(self.flow.sends)}"
