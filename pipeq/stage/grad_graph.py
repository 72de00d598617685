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

from typing import Any, Sequence

import torch
from torch.autograd import graph as _graph
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightCall", "WeightPlan", "plan_weights", "run_weight_calls"]

Roots = tuple[list[torch.Tensor], list[Any]]  # what a backward starts from: tensors, their gradients

#: the node type that accumulates into a leaf (its ``variable``)
_ACCUMULATE = type(get_gradient_edge(torch.zeros(1, requires_grad=True)).node)
#: the engine's entry point under ``torch.autograd.backward`` (which first checks the gradients
#: it is given: a ``W``'s come from the engine itself, on the very nodes they are given to)
_RUN = getattr(_graph, "_engine_run_backward", None)


class WeightCall:
    """One ``backward`` of a ``W``: from ``edges`` (GradientEdges, or tensors) with ``grads`` into
    ``params``; ``checked``: ``edges`` and ``grads`` came from the engine (no need to check them)."""

    __slots__ = ("edges", "grads", "params", "checked")

    def __init__(self, edges: Sequence[Any], grads: Sequence[Any], params: list[torch.Tensor],
                 checked: bool = False) -> None:
        self.edges = edges
        self.grads = grads
        self.params = params
        self.checked = checked


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

    def __init__(self, groups: list[_Group], captures: list[GradientEdge], roots: Roots) -> None:
        self.groups = groups
        #: the entries' input slots, whose gradients ``I`` keeps
        self.captures = captures
        self._roots = roots if any(g.chain for g in groups) else None

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
                out.append(WeightCall(edges, grads, g.params, checked=not g.seeds))
        return out


def _find(parent: dict[Node, Node], n: Node) -> Node:
    root = n
    while parent[root] is not root:
        root = parent[root]
    while parent[n] is not root:  # path compression
        parent[n], n = root, parent[n]
    return root


def _walk(root_nodes: Sequence[Node], inputs: set[int], params: dict[int, torch.Tensor],
          ) -> tuple[dict[Node, bool], dict[Node, list[tuple[Node, int]]], list[tuple[Node, torch.Tensor]]]:
    """Every node below ``root_nodes``: whether a leaf of ``inputs`` (ids) is reachable from it,
    its edges (child, slot); and the nodes that accumulate into ``params`` (by id)."""
    reaches: dict[Node, bool] = {}
    children: dict[Node, list[tuple[Node, int]]] = {}
    found: list[tuple[Node, torch.Tensor]] = []
    stack: list[tuple[Node, bool]] = [(n, False) for n in root_nodes]
    pop, push = stack.pop, stack.append
    while stack:
        node, done = pop()
        if done:
            kids = children[node]
            if kids:
                r = False
                for c, _ in kids:
                    if reaches[c]:
                        r = True
                        break
                reaches[node] = r
            elif type(node) is _ACCUMULATE:
                v = id(node.variable)
                reaches[node] = v in inputs
                p = params.get(v)
                if p is not None:
                    found.append((node, p))
            else:
                reaches[node] = False
        elif node not in children:
            kids = [e for e in node.next_functions if e[0] is not None]
            children[node] = kids
            push((node, True))
            for c, _ in kids:
                if c not in children:
                    push((c, False))
    return reaches, children, found


def _below(start: Node, children: dict[Node, list[tuple[Node, int]]], reaches: dict[Node, bool]) -> set[Node]:
    """The input-side nodes below ``start`` (itself excluded)."""
    seen: set[Node] = set()
    todo = [start]
    while todo:
        for c, _ in children[todo.pop()]:
            if reaches[c] and c not in seen:
                seen.add(c)
                todo.append(c)
    return seen


def plan_weights(roots: Sequence[torch.Tensor], grads: Sequence[Any], inputs: Sequence[torch.Tensor],
                 params: Sequence[torch.Tensor]) -> WeightPlan:
    """The groups of ``params`` that a backward from ``roots`` (gradients ``grads``, None: ones)
    reaches, with their entries from the side of ``inputs`` (leaves) and their own roots (module doc)."""
    root_edges = [GradientEdge(r.grad_fn, r.output_nr) if r.grad_fn is not None else get_gradient_edge(r)
                  for r in roots]
    reaches, children, found = _walk([e.node for e in root_edges], {id(t) for t in inputs},
                                     {id(p): p for p in params})
    parent: dict[Node, Node] = {}
    entries: dict[Node, None] = {}  # an ordered set
    for node, kids in children.items():
        for c, _ in kids:
            if not reaches[c]:
                if reaches[node]:
                    entries[node] = None
                a, b = _find(parent, parent.setdefault(node, node)), _find(parent, parent.setdefault(c, c))
                if a is not b:
                    parent[a] = b
    groups: dict[Node, _Group] = {}
    for node, p in found:
        key = _find(parent, parent.setdefault(node, node))  # (a parameter that is a root: its own)
        g = groups.get(key)
        if g is None:
            g = groups[key] = _Group()
        g.params.append(p)
    for node in entries:
        g = groups.get(_find(parent, node))
        if g is not None:
            g.entries.append(node)
    for edge, root, gr in zip(root_edges, roots, grads):
        if not reaches[edge.node] and edge.node in parent:
            g = groups.get(_find(parent, edge.node))
            if g is not None:
                g.seeds.append((edge, gr if gr is not None else torch.ones_like(root)))
    return WeightPlan(list(groups.values()), _captures(groups.values(), children, reaches, root_edges),
                      (list(roots), list(grads)))


def _captures(groups: Any, children: dict[Node, list[tuple[Node, int]]], reaches: dict[Node, bool],
              root_edges: list[GradientEdge]) -> list[GradientEdge]:
    """The input slots of every entry of a group without a chain (marked here), in order; each
    group notes which are its own."""
    slots: dict[Node, set[int]] = {}
    for g in groups:
        if len(g.entries) > 1:
            mine = set(g.entries)
            g.chain = any(not mine.isdisjoint(_below(e, children, reaches)) for e in g.entries)
        if not g.chain:
            for e in g.entries:
                slots[e] = set()
    for kids in children.values():
        for c, k in kids:
            s = slots.get(c)
            if s is not None:
                s.add(k)
    for e in root_edges:
        s = slots.get(e.node)
        if s is not None:
            s.add(e.output_nr)
    out: list[GradientEdge] = []
    for g in groups:
        if not g.chain:
            for node in g.entries:
                for k in sorted(slots[node]):
                    g.taken.append(len(out))
                    out.append(GradientEdge(node, k))
    return out


def run_weight_calls(calls: Sequence[WeightCall]) -> None:
    """Run a ``W``'s calls in order; the graph is kept until the last one, which frees it."""
    last = len(calls) - 1
    for i, call in enumerate(calls):
        if call.checked and _RUN is not None:
            _RUN(tuple(call.edges), tuple(call.grads), i < last, False, tuple(call.params),
                 allow_unreachable=True, accumulate_grad=True)
        else:
            torch.autograd.backward(call.edges, call.grads, inputs=call.params, retain_graph=i < last)
