"""Where a split backward's weight gradients (``W``) start: the autograd nodes its ``I`` leaves behind.

A microbatch's autograd graph, seen from its roots (the outputs, or the loss), has two parts: the
nodes from which a stage input is reachable (the input side: the input gradient ``I`` runs exactly
these) and the rest, which lead only to parameters (or to other leaves). An *entry* is an
input-side node with an edge into the rest: a Linear's ``AddmmBackward``, whose edges go to the
layer below (input side) and to its weight and bias. ``I`` runs every entry (computing only its
input-side outputs) and also returns the gradients arriving at the entries (``torch.autograd.grad``
with the entries' input slots among its ``inputs``: captured, as they arrive, before the tensor
hooks a node applies when it runs). ``W`` then runs autograd from the entries with those
gradients, restricted to the parameters: each entry computes only its parameter-side outputs,
and nothing on the input side is computed twice.

The parameters fall into groups, the connected parts of the parameter side (with their entries,
and any root outside the input side, seeded with its own gradient): a group is one ``backward``
call, whose ``inputs`` are its parameters, so that an entry does not push its gradient down the
input side to a lower entry of another group (that would redo ``I``). A group with an entry
below another of its entries (a parameter used at two depths) would count the lower entry's
gradient twice that way: its ``W`` starts from the roots instead, as a whole backward restricted to
its parameters (exact; it redoes the input side between them). Each parameter's
``AccumulateGrad`` gets the same sum, once per microbatch, as under a whole backward ``B``: the
gradients are ``B``'s bits.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from torch.autograd import graph as _graph
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightCall", "WeightPlan", "compiled_node", "engine_backward", "engine_grad", "plan_weights",
           "read_node", "read_saved", "readable", "run_weight_calls", "saving"]

Roots = tuple[list[torch.Tensor], list[Any]]  # what a backward starts from: tensors, their gradients

#: the node type that accumulates into a leaf (its ``variable``)
_ACCUMULATE = type(get_gradient_edge(torch.zeros(1, requires_grad=True)).node)
#: the engine's entry point under ``torch.autograd.backward`` and ``grad``, which first spend
#: ~20 us of Python checking and converting their arguments (see :func:`engine_grad`)
_RUN = getattr(_graph, "_engine_run_backward", None)


def _grads_for(roots: Sequence[torch.Tensor], grads: Sequence[Any]) -> tuple[torch.Tensor, ...]:
    """``grads``, a None (a scalar root's) made ones, as ``torch.autograd`` makes it."""
    return tuple(g if g is not None else torch.ones_like(r, memory_format=torch.preserve_format)
                 for r, g in zip(roots, grads))


def engine_grad(roots: Sequence[torch.Tensor], grads: Sequence[Any], inputs: Sequence[Any]) -> Sequence[Any]:
    """``torch.autograd.grad(roots, inputs, grads, retain_graph=True, allow_unused=True)``, the
    same engine call without its Python checks: ``grads`` match ``roots`` in number and shape
    (the executor checked them; None only for a scalar root)."""
    if _RUN is None:
        return torch.autograd.grad(roots, inputs, grads, retain_graph=True, allow_unused=True)
    return _RUN(tuple(roots), _grads_for(roots, grads), True, False, tuple(inputs),
                allow_unreachable=True, accumulate_grad=False)


def engine_backward(roots: Sequence[torch.Tensor], grads: Sequence[Any], inputs: Sequence[Any] = ()) -> None:
    """``torch.autograd.backward(roots, grads, inputs=inputs or None)`` (frees the graph), the
    same engine call without its Python checks (as :func:`engine_grad`)."""
    if _RUN is None:
        torch.autograd.backward(roots, grads, inputs=list(inputs) or None)
        return
    _RUN(tuple(roots), _grads_for(roots, grads), False, False, tuple(inputs), allow_unreachable=True,
         accumulate_grad=True)


class WeightCall:
    """One ``backward`` of a ``W``: from ``edges`` (GradientEdges, or tensors) with ``grads`` (None
    only for a scalar tensor) into ``params``."""

    __slots__ = ("edges", "grads", "params")

    def __init__(self, edges: Sequence[Any], grads: Sequence[Any], params: list[torch.Tensor]) -> None:
        self.edges = edges
        self.grads = grads
        self.params = params


class _Group:
    __slots__ = ("params", "entries", "seeds", "chain", "taken")

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.entries: list[Node] = []
        self.seeds: list[tuple[GradientEdge, torch.Tensor]] = []
        self.chain = False  # an entry below another: W starts from the roots (module doc)
        self.taken: list[int] = []  # which of the plan's captures are its entries'


class WeightPlan:
    """The groups of a microbatch's parameters: ``I`` differentiates with respect to
    :attr:`captures` as well as the inputs, and :meth:`calls` makes the ``W`` of what they got."""

    def __init__(self, groups: list[_Group], captures: list[GradientEdge], roots: Roots, whole: bool = False,
                 graph: "_Graph | None" = None) -> None:
        self.groups = groups
        self.graph = graph
        #: the entries' input slots, whose gradients ``I`` keeps
        self.captures = captures
        self._roots = roots if any(g.chain for g in groups) else None
        #: an entry is a compiled graph's backward (:func:`compiled_node`): ``I`` runs the whole backward
        self.whole = whole

    def calls(self, got: Sequence[Any]) -> list[WeightCall]:
        """The ``W``, given what ``I`` got at :attr:`captures`: one call per group that has a
        gradient to start from."""
        out = []
        for g in self.groups:
            if g.chain:
                assert self._roots is not None
                out.append(WeightCall(*self._roots, g.params))
                continue
            edges = [self.captures[i] for i in g.taken if got[i] is not None]
            grads = [got[i] for i in g.taken if got[i] is not None]
            for edge, gr in g.seeds:
                edges.append(edge)
                grads.append(gr)
            if edges:
                out.append(WeightCall(edges, grads, g.params))
        return out


    def weight_nodes(self) -> list[Node] | None:
        """The nodes the ``W`` runs (each group's entries, its own roots and the parameter side
        below them), whose saved tensors it reads: the rest of the graph's (the input side
        below the entries) may be freed after ``I``. None: the ``W`` may run any node (it starts
        from the roots, or ``I`` ran the whole backward) or a node hides what it saved (a C++
        custom function): nothing may be freed."""
        graph = self.graph
        if self.whole or self._roots is not None or graph is None:
            return None
        todo = [n for g in self.groups for n in g.entries] + [e.node for g in self.groups for e, _ in g.seeds]
        seen = set(todo)
        reaches, children = graph.reaches, graph.children
        for node in todo:  # (grows as it goes)
            for c in children[node]:
                if not reaches[c] and c not in seen:
                    seen.add(c)
                    todo.append(c)
        return todo if all(readable(n) for n in todo) else None


    def input_side(self) -> list[Node]:
        """The nodes ``I`` runs (from which a stage input is reachable), the entries among them."""
        graph = self.graph
        return [n for n, r in graph.reaches.items() if r] if graph is not None else []


#: autograd's generated nodes (``AddmmBackward0``...), which show each tensor they saved as a
#: ``_saved_*`` attribute, and AccumulateGrad
_GENERATED = frozenset(v for v in vars(torch._C._functions).values() if isinstance(v, type))
_BACKWARD_FUNCTION = torch.autograd.function.BackwardCFunction  # a Python autograd.Function's: saved_tensors
_SAVED: dict[type, tuple[str, ...]] = {}  # a generated node type -> its _saved_* attributes


def readable(node: Node) -> bool:
    """Whether every tensor ``node`` saved can be read from Python (see :func:`read_saved`)."""
    return type(node) in _GENERATED or isinstance(node, _BACKWARD_FUNCTION)


def saving(nodes: Iterable[Node]) -> list[Node]:
    """Those of ``nodes`` that may have saved a tensor and show it (:func:`readable`, with a
    ``_saved_*`` tensor attribute or a Python function's ``saved_tensors``)."""
    out = []
    for node in nodes:
        kind = type(node)
        if kind in _GENERATED:
            names = _SAVED.get(kind)
            if names is None:
                names = _SAVED[kind] = _tensor_names(node)
            if names:
                out.append(node)
        elif isinstance(node, _BACKWARD_FUNCTION):
            out.append(node)
    return out


def read_saved(nodes: Sequence[Node]) -> None:
    """Read every tensor ``nodes`` saved (each through the saved-tensor hooks it was saved under:
    :meth:`pipeq.stage.memory.MemoryMeter.mark` marks what it reads)."""
    for node in nodes:
        read_node(node)


def read_node(node: Node) -> None:
    """Read every tensor ``node`` saved (a generated node's ``_saved_*`` attributes, a Python
    function's ``saved_tensors``)."""
    if isinstance(node, _BACKWARD_FUNCTION):
        node.saved_tensors  # noqa: B018 (unpacks them)
        return
    names = _SAVED.get(type(node))
    if names is None:
        names = _SAVED[type(node)] = _tensor_names(node)
    for name in names:
        getattr(node, name)


def _tensor_names(node: Node) -> tuple[str, ...]:
    """``node``'s ``_saved_*`` attributes that may hold tensors (read once per node type: sizes,
    strides and scalars are not; a None, an optional tensor not given here, may be)."""
    names = []
    for name in dir(type(node)):
        if name.startswith("_saved_"):
            value = getattr(node, name)
            items = value if isinstance(value, (tuple, list)) else (value,)
            if not items or any(v is None or isinstance(v, torch.Tensor) for v in items):
                names.append(name)
    return tuple(names)


def compiled_node(node: Node) -> bool:
    """Whether ``node`` is a compiled graph's backward (``torch.compile``: AOTAutograd's
    ``CompiledFunctionBackward``): one node that computes the gradients of all its inputs, the
    stage's inputs' and its parameters' together. Its parameter side cannot run apart from its
    input side (capturing the gradients at its inputs and running it again would compute both
    twice, and torch does not give a compiled backward's input gradients right when its inputs are
    captured), so a split backward through one computes everything at ``I``."""
    return type(node).__name__.startswith("CompiledFunction")


def _find(parent: dict[Node, Node], n: Node) -> Node:
    root = n
    while parent[root] is not root:
        root = parent[root]
    while parent[n] is not root:  # path compression
        parent[n], n = root, parent[n]
    return root


def _walk(root_nodes: Sequence[Node], inputs: set[int], params: dict[int, torch.Tensor]) -> _Graph:
    """The graph below ``root_nodes``: which nodes reach a leaf of ``inputs`` (ids), the entries,
    the parameter side's parts (union-find over its nodes and entries), the nodes that
    accumulate into ``params`` (by id)."""
    g = _Graph()
    reaches, children, parent, entries, found = g.reaches, g.children, g.parent, g.entries, g.found
    stack: list[tuple[Node, bool]] = [(n, False) for n in root_nodes]
    pop, push = stack.pop, stack.append
    while stack:
        node, done = pop()
        if not done:
            if node not in children:
                kids = [e[0] for e in node.next_functions if e[0] is not None]
                children[node] = kids
                push((node, True))
                for c in kids:
                    if c not in children:
                        push((c, False))
            continue
        kids = children[node]
        if not kids:
            r = False
            if type(node) is _ACCUMULATE:
                v = id(node.variable)
                r = v in inputs
                p = params.get(v)
                if p is not None:
                    found.append((node, p))
            reaches[node] = r
            continue
        apart = [c for c in kids if not reaches[c]]
        reaches[node] = len(apart) < len(kids)
        if apart:
            if reaches[node]:
                entries[node] = None
            a = _find(parent, parent.setdefault(node, node))
            for c in apart:
                b = _find(parent, parent.setdefault(c, c))
                if a is not b:
                    parent[b] = a
    return g


class _Graph:
    __slots__ = ("reaches", "children", "parent", "entries", "found")

    def __init__(self) -> None:
        self.reaches: dict[Node, bool] = {}
        self.children: dict[Node, list[Node]] = {}
        self.parent: dict[Node, Node] = {}
        self.entries: dict[Node, None] = {}  # an ordered set
        self.found: list[tuple[Node, torch.Tensor]] = []


def _below(start: Node, graph: _Graph) -> set[Node]:
    """The input-side nodes below ``start`` (itself excluded)."""
    seen: set[Node] = set()
    todo = [start]
    while todo:
        for c in graph.children[todo.pop()]:
            if graph.reaches[c] and c not in seen:
                seen.add(c)
                todo.append(c)
    return seen


def plan_weights(roots: Sequence[torch.Tensor], grads: Sequence[Any], inputs: Sequence[torch.Tensor],
                 params: Sequence[torch.Tensor]) -> WeightPlan:
    """The groups of ``params`` that a backward from ``roots`` (gradients ``grads``, None: ones)
    reaches, with their entries from the side of ``inputs`` (leaves) and their own roots (module doc)."""
    root_edges = [GradientEdge(r.grad_fn, r.output_nr) if r.grad_fn is not None else get_gradient_edge(r)
                  for r in roots]
    graph = _walk([e.node for e in root_edges], {id(t) for t in inputs}, {id(p): p for p in params})
    if any(compiled_node(n) for n in graph.entries):
        return WeightPlan([], [], (list(roots), list(grads)), whole=True)
    parent = graph.parent
    groups: dict[Node, _Group] = {}
    for node, p in graph.found:
        key = _find(parent, parent.setdefault(node, node))  # (a parameter that is a root: its own)
        g = groups.get(key)
        if g is None:
            g = groups[key] = _Group()
        g.params.append(p)
    for node in graph.entries:
        g = groups.get(_find(parent, node))
        if g is not None:
            g.entries.append(node)
    for edge, root, gr in zip(root_edges, roots, grads):
        if not graph.reaches[edge.node] and edge.node in parent:
            g = groups.get(_find(parent, edge.node))
            if g is not None:
                g.seeds.append((edge, gr if gr is not None else torch.ones_like(root)))
    captures: list[GradientEdge] = []
    for g in groups.values():
        slots = [_slots(node) for node in g.entries]
        if len(g.entries) > 1:
            mine = set(g.entries)
            g.chain = any(not mine.isdisjoint(_below(e, graph)) for e in g.entries)
        g.chain = g.chain or None in slots  # (a torch that does not say: the whole backward, exact)
        if not g.chain:
            for node, n in zip(g.entries, slots):
                for k in range(n):  # type: ignore[arg-type]
                    g.taken.append(len(captures))
                    captures.append(GradientEdge(node, k))
    return WeightPlan(list(groups.values()), captures, (list(roots), list(grads)), graph=graph)


def _slots(node: Node) -> int | None:
    """How many gradients ``node`` takes (its forward's outputs); None if this torch does not say."""
    meta = getattr(node, "_input_metadata", None)
    return len(meta) if meta is not None else None


def run_weight_calls(calls: Sequence[WeightCall]) -> None:
    """Run a ``W``'s calls in order; the graph is kept until the last one, which frees it."""
    last = len(calls) - 1
    for i, call in enumerate(calls):
        if _RUN is not None:
            _RUN(tuple(call.edges), _grads_for(call.edges, call.grads), i < last, False, tuple(call.params),
                 allow_unreachable=True, accumulate_grad=True)
        else:
            torch.autograd.backward(call.edges, call.grads, inputs=call.params, retain_graph=i < last)
