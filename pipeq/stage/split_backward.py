"""A compiled stage's backward in two compiled graphs: the input gradients (``I``) and the weight gradients (``W``).

``torch.compile`` gives a stage's backward as one autograd node (AOTAutograd's
``CompiledFunctionBackward``), which computes the gradients of the stage's inputs and of its
parameters together: a split-backward schedule (ZB-H1, ZBV, DualPipeV...) would run it whole in
``I``, and its ``W`` would have nothing left to do (:mod:`pipeq.stage.backprop`). Here the
compiled backward graph (AOTAutograd's partitioned backward, after the forward was cut from the
joint graph) is cut once more, after the zero-bubble papers' ``B = I + W``:

- ``I``'s graph computes every output of the backward that is not a parameter's gradient (the
  stage inputs' gradients), and returns beside them what the ``W`` will read that it computed
  (the gradients at the matmuls' outputs, typically);
- ``W``'s graph computes the parameters' gradients from those and from the backward's inputs
  (the forward's saved tensors) it reads, and nothing that ``I`` computed already.

Each graph is compiled by the stage's backend (inductor: ``compile_fx_inner``, the same inner
compiler a whole backward gets, and its FX graph cache; ``aot_eager``: run as traced). When the
autograd engine runs the node during an ``I`` (:func:`deferring` is open), the node returns no
gradient for the parameters (the engine leaves their ``.grad`` alone) and leaves a
:class:`DeferredWeights` behind: the ``W`` graph, what it reads, and the parameters' edges
(``node.next_functions``). Its :meth:`DeferredWeights.run` computes the gradients and accumulates
them through those edges, as a whole backward would (``AccumulateGrad``: the same hooks fire).
What the forward saved and the ``W`` does not read is freed with the node after ``I``. Outside an
``I`` (``B``, a schedule that does not split, a user's own ``backward``), the node runs both graphs
and returns every gradient.

Where a backward cannot be cut this way, the stage runs the whole compiled backward in ``I`` (as
before) and says why once (:attr:`Splitting.reason`, ``runner.stats()``'s ``backward_split``):
a backend other than inductor and aot_eager, CUDA graphs (``mode="reduce-overhead"``), a graph
whose parameters' gradients need nothing beside what ``I`` computes, inputs AOTAutograd
rearranged (subclasses such as DTensor, duplicated inputs), or a parameter whose gradient does not
go straight to its accumulator.

The idea of partitioning a compiled backward into dI and dW graphs is torchtitan's GraphPP's
(their PR 2727); the schedules that use it are Qi et al., *Zero Bubble Pipeline Parallelism*
(ICLR 2024) and DeepSeek-V3's DualPipe.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import fx, nn
from torch.autograd.graph import GradientEdge

__all__ = ["DeferredWeights", "Splitting", "cut", "deferring", "split_backend", "SPLIT_BACKENDS"]

#: the backends whose backward pipeq cuts (any other compiles its backward whole)
SPLIT_BACKENDS = ("inductor", "aot_eager")

_ACCUMULATE = type(torch.autograd.graph.get_gradient_edge(torch.zeros(1, requires_grad=True)).node)


class DeferredWeights:
    """What a compiled node's ``I`` leaves for its ``W``: the ``W`` graph, the tensors it reads
    (:attr:`grads`, as :class:`~pipeq.stage.grad_graph.WeightCall`'s: what a microbatch holds
    between its ``I`` and ``W``) and the parameters' edges its gradients go to."""

    __slots__ = ("fn", "grads", "edges")

    def __init__(self, fn: Callable[[list[Any]], Sequence[Any]], reads: list[Any], edges: list[GradientEdge]) -> None:
        self.fn = fn
        self.grads = reads
        self.edges = edges

    def run(self) -> None:
        """Compute the parameters' gradients and accumulate them (frees what it read)."""
        args, self.grads = self.grads, []
        with torch.no_grad():  # as the engine runs a backward: its inputs include the parameters
            got = self.fn(args)
        pairs = [(e, g) for e, g in zip(self.edges, got) if g is not None]
        if pairs:
            torch.autograd.backward([GradientEdge(*e) for e, _ in pairs], [g for _, g in pairs])


_open: list[list[DeferredWeights]] = []  # the collectors of the I running now (innermost last)


@contextlib.contextmanager
def deferring() -> Iterator[list[DeferredWeights]]:
    """Within: a split compiled node that runs defers its parameters' gradients to the list
    yielded (an ``I``), instead of computing them."""
    got: list[DeferredWeights] = []
    _open.append(got)
    try:
        yield got
    finally:
        _open.pop()


class Splitting:
    """One stage's record of its compiled backwards: cut or not, and why not (the first reason,
    logged once, a warning of the logger named after this module)."""

    def __init__(self, stage: int | None = None) -> None:
        self.stage = stage
        self.graphs = 0  # backward graphs cut
        self.reason: str | None = None

    def whole(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            where = f"stage {self.stage}" if self.stage is not None else "a stage"
            logging.getLogger(__name__).warning(
                "pipeq: %s runs its compiled backward whole in I (its W has nothing left to do): %s", where, reason)

    def figure(self) -> str:
        """``runner.stats()``'s ``backward_split``: "I+W", or "whole: <why>"."""
        if self.reason is not None:
            return f"whole: {self.reason}"
        return "I+W" if self.graphs else "none compiled yet"


def _ancestors(roots: Sequence[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(roots)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def _copy(nodes: Sequence[fx.Node], inputs: Sequence[fx.Node], outputs: Sequence[Any]) -> fx.GraphModule:
    """A graph of ``nodes`` (in order) whose placeholders are ``inputs`` and which returns ``outputs``."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        p = g.placeholder(n.name)
        p.meta = dict(n.meta)
        env[n] = p
    for n in nodes:
        if n not in env:
            env[n] = g.node_copy(n, lambda a: env[a])
    out = g.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outputs))
    out.meta["user_visible_output_idxs"] = [k for k, o in enumerate(outputs) if isinstance(o, fx.Node)]
    g.lint()
    return fx.GraphModule(torch.nn.Module(), g)


class Cut:
    """A backward graph cut in two (see the module): ``i_gm`` takes the backward's inputs and
    returns its outputs that are not parameters' gradients, then :attr:`n_pass` values for
    ``W``; ``w_gm`` takes the backward's inputs at :attr:`w_args` and those values, and returns
    the gradients at :attr:`w_slots` (the backward's output indices)."""

    def __init__(self, i_gm: fx.GraphModule, w_gm: fx.GraphModule, i_slots: list[int], w_slots: list[int],
                 w_args: list[int], n_pass: int, n_out: int) -> None:
        self.i_gm, self.w_gm = i_gm, w_gm
        self.i_slots, self.w_slots, self.w_args = i_slots, w_slots, w_args
        self.n_pass, self.n_out = n_pass, n_out


def cut(gm: fx.GraphModule, params: set[int]) -> Cut | str:
    """Cut backward graph ``gm`` (AOTAutograd's: one output per forward input) where the outputs
    at ``params`` are the parameters' gradients; a reason instead where it cannot be cut."""
    nodes = list(gm.graph.nodes)
    out_node = next(n for n in reversed(nodes) if n.op == "output")
    outs = list(out_node.args[0])
    holders = [n for n in nodes if n.op == "placeholder"]
    w_slots = [k for k in sorted(params) if k < len(outs) and isinstance(outs[k], fx.Node)]
    i_slots = [k for k in range(len(outs)) if k not in params]
    if not w_slots:
        return "no parameter gradient in the compiled backward"
    inputs = set(holders)
    mine_i = _ancestors([outs[k] for k in i_slots if isinstance(outs[k], fx.Node)]) - inputs
    mine_w = _ancestors([outs[k] for k in w_slots]) - inputs
    w_only = [n for n in nodes if n in mine_w and n not in mine_i]
    if not any(n.op == "call_function" for n in w_only):
        return "its parameters' gradients need nothing beyond the input gradients' graph"
    w_set = set(w_only)
    passed: dict[fx.Node, None] = {}  # computed by I, read by W (ordered)
    args: dict[fx.Node, None] = {}  # the backward's inputs W reads
    for n in w_only:
        for a in n.all_input_nodes:
            if a in inputs:
                args[a] = None
            elif a not in w_set:
                passed[a] = None
    for k in w_slots:  # a parameter gradient I computes anyway (shared with an input gradient)
        o = outs[k]
        if o in inputs:
            args[o] = None
        elif o not in w_set:
            passed[o] = None
    # every size the backward takes (a SymInt): what W's inputs' shapes are made of (inductor
    # binds a shape's symbols from the graph's inputs)
    sizes = [n for n in holders if isinstance(n.meta.get("val"), torch.SymInt) and n not in args]
    args = {**dict.fromkeys(sizes), **args}
    i_nodes = [n for n in nodes if n in mine_i]
    i_gm = _copy(i_nodes, holders, [outs[k] for k in i_slots] + list(passed))
    w_inputs = list(args) + list(passed)
    w_gm = _copy(w_only, w_inputs, [outs[k] for k in w_slots])
    return Cut(i_gm, w_gm, i_slots, w_slots, [holders.index(a) for a in args], len(passed), len(outs))


class _SplitNode:
    """A cut backward as AOTAutograd calls it (boxed: a list of arguments it may empty)."""

    def __init__(self, c: Cut, i_fn: Callable, w_fn: Callable, next_index: dict[int, int],
                 record: Splitting) -> None:
        self._boxed_call = True  # an instance attribute: the wrappers torch puts around it copy __dict__
        self.cut, self.i_fn, self.w_fn = c, i_fn, w_fn
        self.next_index = next_index  # backward output slot -> the node's next_functions index
        self.record = record

    def __call__(self, args: list[Any]) -> list[Any]:
        c = self.cut
        w_args = [args[k] for k in c.w_args]
        got = list(self.i_fn(args))  # empties args
        n_i = len(c.i_slots)
        passed = got[n_i:]
        out: list[Any] = [None] * c.n_out
        for k, g in zip(c.i_slots, got[:n_i]):
            out[k] = g
        reads = w_args + passed
        node = torch._C._current_autograd_node() if _open else None
        edges = self._edges(node) if node is not None else None
        if edges is None:  # not in an I (or its parameters' edges are not plain): W now
            for k, g in zip(c.w_slots, self.w_fn(reads)):
                out[k] = g
            return out
        _open[-1].append(DeferredWeights(self.w_fn, reads, edges))
        return out

    def _edges(self, node: Any) -> list[GradientEdge] | None:
        nexts = node.next_functions
        edges = []
        for k in self.cut.w_slots:
            i = self.next_index.get(k)
            fn, nr = nexts[i] if i is not None and i < len(nexts) else (None, 0)
            if type(fn) is not _ACCUMULATE:
                self.record.whole("a parameter's gradient does not go straight to its accumulator")
                return None
            edges.append((fn, nr))
        return edges


def _boxed(fn: Callable) -> Callable[[list[Any]], Any]:
    if getattr(fn, "_boxed_call", False):
        return fn
    return lambda args: fn(*args)


def _split_bw(inner: Callable[..., Any], params: set[int], next_index: dict[int, int], record: Splitting,
              gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """A backward compiler: ``gm`` cut and each part compiled with ``inner`` (or ``gm`` whole)."""
    c = cut(gm, params)
    if isinstance(c, str):
        record.whole(c)
        return inner(gm, example_inputs, **kwargs)
    w_holders = [n for n in c.w_gm.graph.nodes if n.op == "placeholder"]
    w_given = [example_inputs[k] for k in c.w_args]
    w_examples = w_given + [n.meta["val"] for n in w_holders[len(w_given):]]
    i_fn = _boxed(inner(c.i_gm, list(example_inputs), **kwargs))
    # (the backward's static inputs are numbered in its own graph, not in W's)
    w_fn = _boxed(inner(c.w_gm, w_examples, **{**kwargs, "static_input_idxs": ()}))
    record.graphs += 1
    return _SplitNode(c, i_fn, w_fn, next_index, record)


def _slots(example_inputs: Sequence[Any]) -> tuple[set[int], dict[int, int]]:
    """Which forward inputs are parameters, and each tensor input's index among the node's edges."""
    params = {k for k, x in enumerate(example_inputs) if isinstance(x, nn.Parameter) and x.requires_grad}
    tensors = [k for k, x in enumerate(example_inputs) if isinstance(x, torch.Tensor)]
    return params, {k: i for i, k in enumerate(tensors)}


def _plain(example_inputs: Sequence[Any]) -> bool:
    return all(type(x) in (torch.Tensor, nn.Parameter) for x in example_inputs if isinstance(x, torch.Tensor))


def split_backend(backend: str, options: dict[str, Any] | None, record: Splitting) -> Callable[..., Any]:
    """A ``torch.compile`` backend that compiles as ``backend`` ("inductor" with its config
    ``options``, or "aot_eager") does, its backward cut in two (see the module)."""

    def compile_graph(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        params, next_index = _slots(example_inputs)
        if not _plain(example_inputs):
            record.whole("a tensor subclass among its inputs (e.g. DTensor): AOTAutograd rearranges them")
            params = set()
        if backend == "aot_eager":
            from torch._dynamo.backends.debugging import aot_eager, boxed_nop

            bw = functools.partial(_split_bw, lambda g, ex, **kw: boxed_nop(g, ex), params, next_index, record)
            return aot_eager(gm, example_inputs, bw_compiler=bw)
        from torch._functorch import config as functorch_config
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner(g: fx.GraphModule, ex: Sequence[Any], **kw: Any) -> Any:
            if not kw.get("is_backward"):
                return compile_fx_inner(g, ex, **kw)
            return _split_bw(compile_fx_inner, params, next_index, record, g, ex, **kw)

        # AOTAutograd's own cache would hand back a whole backward compiled before (its key does not
        # know of the cut); each part still hits inductor's FX graph cache
        with functorch_config.patch(enable_autograd_cache=False), inductor_config.patch(options or {}):
            return compile_fx(gm, example_inputs, inner_compile=inner)

    return compile_graph
