"""Where a split backward's weight gradients (``W``) start: the autograd nodes its ``I`` leaves behind.

A microbatch's autograd graph, seen from its roots (the outputs, or the loss), has two parts: the
nodes from which a stage input is reachable (:func:`plan_weights` calls them the input side; the
input gradient ``I`` runs exactly these) and the rest, which lead only to parameters (or to other
leaves). An *entry* is an input-side node with an edge into the rest: a Linear's ``AddmmBackward``,
whose edges go to the layer below (input side) and to its weight and bias. ``I`` runs every entry
(computing only its input-side outputs) and a pre-hook keeps the gradient arriving at it; ``W`` then
runs autograd from the entries with those gradients, restricted to the parameters, so each entry
computes only its parameter-side outputs and nothing on the input side is computed twice.

The parameters fall into groups, the connected parts of the parameter side (with their entries and
any root outside the input side, seeded with its own gradient): a group is one ``backward`` call,
whose ``inputs`` are its parameters. Separate calls keep an entry from pushing its gradient down the
input side to a lower entry of another group (that would redo ``I``); within one group (a parameter
used at two depths) a lower entry's pre-hook puts back the gradient kept in ``I`` (the sum ``B``
would see), so nothing counts twice; every entry gets that pre-hook, which also undoes a second
run of a tensor's gradient hook (``register_hook`` on an entry's output, applied in ``I``). Each parameter's ``AccumulateGrad`` then gets the same sum, once
per microbatch, as under a whole backward: the gradients are ``B``'s.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightCall", "WeightPlan", "plan_weights", "run_weight_calls"]


@dataclass
class WeightCall:
    """One ``torch.autograd.backward`` of a ``W``: from ``edges`` with ``grads`` into ``params``;
    ``clamp``: entries whose gradient is put back to ``I``'s (an entry below another of its group
    gets the upper one's share again; a gradient hook on an entry's output runs again)."""

    edges: list[GradientEdge | torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor | None] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    clamp: list[tuple[Node, tuple[Any, ...]]] = field(default_factory=list)


@dataclass
class _Group:
    params: list[torch.Tensor] = field(default_factory=list)
    entries: list[Node] = field(default_factory=list)
    seeds: list[tuple[GradientEdge, torch.Tensor]] = field(default_factory=list)


class WeightPlan:
    """The groups of a microbatch's parameters; :meth:`capturing` keeps the entries' gradients
    during ``I``, :meth:`calls` makes ``W`` of them."""

    def __init__(self, groups: list[_Group]) -> None:
        self.groups = groups
        self.kept: dict[Node, tuple[Any, ...]] = {}

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Within: the gradient arriving at each entry is kept (pre-hooks, removed on exit)."""
        kept = self.kept

        def hook_for(node: Node) -> Any:
            def hook(grad_outputs: tuple[Any, ...]) -> None:
                kept[node] = grad_outputs
            return hook

        handles = [n.register_prehook(hook_for(n)) for g in self.groups for n in g.entries]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def calls(self) -> list[WeightCall]:
        """The ``W``: one call per group that has a gradient to start from."""
        out = []
        for g in self.groups:
            call = WeightCall(params=g.params)
            for node in g.entries:
                grads = self.kept.get(node)
                if grads is None:  # I never reached it (no gradient flows there)
                    continue
                for k, gr in enumerate(grads):
                    if gr is not None:
                        call.edges.append(GradientEdge(node, k))
                        call.grads.append(gr)
                call.clamp.append((node, grads))
            for edge, gr in g.seeds:
                call.edges.append(edge)
                call.grads.append(gr)
            if call.edges:
                out.append(call)
        self.kept = {}
        return out


def _find(parent: dict[Node, Node], n: Node) -> Node:
    root = n
    while parent[root] is not root:
        root = parent[root]
    while parent[n] is not root:  # path compression
        parent[n], n = root, parent[n]
    return root


def _walk(root_nodes: Sequence[Node], input_nodes: set[Node]) -> tuple[dict[Node, bool], dict[Node, list[Node]]]:
    """Every node below ``root_nodes``: whether an input node is reachable from it, and its children."""
    reaches: dict[Node, bool] = {}
    children: dict[Node, list[Node]] = {}
    stack: list[tuple[Node, bool]] = [(n, False) for n in root_nodes]
    while stack:
        node, done = stack.pop()
        if done:
            reaches[node] = node in input_nodes or any(reaches[c] for c in children[node])
        elif node not in children:
            kids = [f for f, _ in node.next_functions if f is not None]
            children[node] = kids
            stack.append((node, True))
            stack.extend((c, False) for c in kids if c not in children)
    return reaches, children


def plan_weights(roots: Sequence[torch.Tensor], grads: Sequence[Any], inputs: Sequence[torch.Tensor],
                 params: Sequence[torch.Tensor]) -> WeightPlan:
    """The groups of ``params`` that a backward from ``roots`` (gradients ``grads``, None: ones)
    reaches, with their entries from the side of ``inputs`` and their own roots (module doc)."""
    input_nodes = {get_gradient_edge(t).node for t in inputs}
    root_edges = [get_gradient_edge(r) for r in roots]
    reaches, children = _walk([e.node for e in root_edges], input_nodes)
    parent: dict[Node, Node] = {n: n for n in children}
    entries: dict[Node, None] = {}  # an ordered set
    for node, kids in children.items():
        for c in kids:
            if not reaches[c]:
                if reaches[node]:
                    entries[node] = None
                a, b = _find(parent, node), _find(parent, c)
                if a is not b:
                    parent[a] = b
    by_id = {id(p): p for p in params}
    groups: dict[Node, _Group] = {}
    for node in children:
        if reaches[node]:
            continue
        p = by_id.get(id(getattr(node, "variable", None)))
        if p is not None:
            groups.setdefault(_find(parent, node), _Group()).params.append(p)
    for node in entries:
        g = groups.get(_find(parent, node))
        if g is not None:
            g.entries.append(node)
    for edge, root, gr in zip(root_edges, roots, grads):
        g = groups.get(_find(parent, edge.node)) if not reaches[edge.node] else None
        if g is not None:
            g.seeds.append((edge, gr if gr is not None else torch.ones_like(root)))
    return WeightPlan(list(groups.values()))


def run_weight_calls(calls: Sequence[WeightCall]) -> None:
    """Run a ``W``'s calls in order; the graph is kept until the last one, which frees it."""
    for i, call in enumerate(calls):
        handles = [node.register_prehook(lambda _g, kept=kept: kept) for node, kept in call.clamp]
        try:
            torch.autograd.backward(call.edges, call.grads, inputs=call.params, retain_graph=i < len(calls) - 1)
        finally:
            for h in handles:
                h.remove()
