"""Read a stage's autograd graph: which nodes the input pass runs and where weight work hangs off.

The input pass (I) of a split backward runs every node that leads to a stage input. Each such
node may also have edges into the part of the graph that only leads to weights; the gradients
sent along those edges are the weight pass's (W) work. This module finds, for one stage:

- ``exec_input``: the nodes I runs;
- the *intermediates*: nodes of ``exec_input`` with at least one edge into the weight side;
- which intermediates are customgrad nodes that can hand their weight half to W directly
  (*deferrable*), and how the others group, so that W can run each group from the gradients I
  saw arrive at its intermediates without touching another group's weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import Node

from customgrad import _autograd

__all__ = ["Analysis", "analyse", "grad_node", "weight_edge_mask"]


def grad_node(t: torch.Tensor) -> Node | None:
    """The node a gradient for ``t`` flows into: its ``grad_fn``, or its ``AccumulateGrad``."""
    if not t.requires_grad:
        return None
    if t.grad_fn is not None:
        return t.grad_fn
    return torch.autograd.graph.get_gradient_edge(t).node


def weight_edge_mask(node: Any) -> tuple[bool, ...] | None:
    """For a customgrad node, which of its ``next_functions`` carry a weight argument's grad.

    Returns ``None`` for any other node.
    """
    op = getattr(node, "_cg_op", None)
    if op is None:
        return None
    sig = op._sig
    slots = _autograd._slots(sig, node._cg_lens)
    metas = node._cg_meta
    is_weight = [False] * len(metas)
    for name in sig.weight_set:
        start, n = slots[name]
        for j in range(start, start + (1 if n is None else n)):
            is_weight[j] = True
    return tuple(w for w, m in zip(is_weight, metas) if m is not None)


@dataclass
class Analysis:
    """What one stage's graph looks like to a split backward.

    Attributes:
        exec_input: nodes the input pass runs.
        deferrable: customgrad intermediates whose weight half can be handed to W whole.
        groups: the other intermediates, grouped so that no two groups reach a common node on
            the weight side; each entry is ``(intermediates, weight accumulator nodes)``.
        direct: stage-output edges that only lead to weights (the input pass never sees them).
    """

    exec_input: set[Node] = field(default_factory=set)
    deferrable: set[Node] = field(default_factory=set)
    groups: list[tuple[list[Node], list[Node]]] = field(default_factory=list)
    direct: list[int] = field(default_factory=list)


def _children(node: Node) -> Iterable[Node]:
    for fn, _ in node.next_functions:
        if fn is not None:
            yield fn


def _postorder(roots: Sequence[Node], stop: set[Node]) -> list[Node]:
    """Every node reachable from ``roots``, children before parents (iterative DFS)."""
    seen: set[Node] = set()
    order: list[Node] = []
    for root in roots:
        if root in seen:
            continue
        seen.add(root)
        stack: list[tuple[Node, Any]] = [(root, iter(() if root in stop else _children(root)))]
        while stack:
            node, it = stack[-1]
            for child in it:
                if child not in seen:
                    seen.add(child)
                    stack.append((child, iter(() if child in stop else _children(child))))
                    break
            else:
                stack.pop()
                order.append(node)
    return order


def analyse(
    output_nodes: Sequence[Node],
    input_nodes: set[Node],
    weight_nodes: set[Node],
) -> Analysis:
    """Classify the graph under ``output_nodes`` for a split into an input and a weight pass.

    Args:
        output_nodes: the nodes the stage outputs' gradients flow into.
        input_nodes: the nodes of the stage inputs the input pass captures gradients at.
        weight_nodes: the ``AccumulateGrad`` nodes of the stage's weights.
    """
    order = _postorder(output_nodes, input_nodes)
    leads_in: set[Node] = set()
    leads_w: set[Node] = set()
    for node in order:
        if node in weight_nodes:
            leads_w.add(node)
        if node in input_nodes:
            continue  # a stage boundary: what lies past a stage input is not this stage's
        for child in _children(node):
            if child in input_nodes or child in leads_in:
                leads_in.add(node)
            if child in leads_w:
                leads_w.add(node)

    def w_side(fn: Node | None) -> bool:
        return fn is not None and fn not in leads_in and fn not in input_nodes and fn in leads_w

    result = Analysis(exec_input=leads_in)
    plain: list[Node] = []
    for node in order:
        if node not in leads_in:
            continue
        edges = node.next_functions
        if not any(w_side(fn) for fn, _ in edges):
            continue
        mask = weight_edge_mask(node)
        if mask is not None and _cleanly_split(edges, mask, leads_in, input_nodes, w_side):
            result.deferrable.add(node)
        else:
            plain.append(node)
    result.groups = _group(plain, w_side, weight_nodes)
    result.direct = [
        i for i, node in enumerate(output_nodes) if node not in leads_in and w_side(node)
    ]
    return result


def _cleanly_split(
    edges: Sequence[tuple[Node | None, int]],
    mask: Sequence[bool],
    leads_in: set[Node],
    input_nodes: set[Node],
    w_side: Any,
) -> bool:
    """Whether a customgrad node's weight edges are all weight-side and its others all input-side.

    Only then does "input half now, weight half later" cover exactly what the passes need.
    """
    for (fn, _), is_weight in zip(edges, mask):
        if fn is None:
            continue
        input_side = fn in leads_in or fn in input_nodes
        if is_weight and input_side:
            return False  # the input pass needs this "weight" gradient now
        if not is_weight and w_side(fn):
            return False  # a non-weight argument whose gradient only W can use
    return True


def _group(
    intermediates: list[Node], w_side: Any, weight_nodes: set[Node]
) -> list[tuple[list[Node], list[Node]]]:
    """Union intermediates whose weight-side subgraphs share a node."""
    owner: dict[Node, int] = {}
    parent = list(range(len(intermediates)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, node in enumerate(intermediates):
        stack: list[Node] = [fn for fn, _ in node.next_functions if fn is not None and w_side(fn)]
        while stack:
            fn = stack.pop()
            j = owner.get(fn)
            if j is not None:
                ri, rj = find(i), find(j)
                if ri != rj:
                    parent[rj] = ri
                continue
            owner[fn] = i
            stack.extend(c for c in _children(fn) if w_side(c))
    members: dict[int, list[Node]] = {}
    for i, node in enumerate(intermediates):
        members.setdefault(find(i), []).append(node)
    weights: dict[int, list[Node]] = {}
    for fn, i in owner.items():
        if fn in weight_nodes:
            weights.setdefault(find(i), []).append(fn)
    return [(nodes, weights.get(root, [])) for root, nodes in members.items()]
