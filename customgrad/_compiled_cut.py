"""Cutting a compiled region's backward graph into an input part (I) and a weight part (W).

AOTAutograd hands a backend the backward of a compiled region as one FX graph whose outputs are
one gradient per region input. :func:`cut_graph` cuts it, for a given choice of which inputs' gradients
W computes, into the I graph (the other gradients, plus the values W needs from them: the
*hand-off*) and the W graph (its gradients from the backward's inputs and the hand-off). What W
can rebuild without FLOPs (views, elementwise ops of saved values) it recomputes rather than keep.
Nothing here runs a graph: :mod:`customgrad._compile` compiles and runs the pieces.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from customgrad._torch.dispatcher import OpOverload, schema_of

__all__ = ["Plan", "cut_graph", "example_of"]

# aten ops W may recompute rather than keep: no FLOPs, nothing random, no mutation.
_VIEWS = {
    "alias", "as_strided", "detach", "expand", "permute", "reshape", "select", "slice",
    "squeeze", "t", "transpose", "unsqueeze", "view", "_unsafe_view", "_reshape_alias",
}  # fmt: skip
_RECOMPUTE_DEPTH = 8


@dataclass
class Plan:
    input_gm: fx.GraphModule
    weight_gm: fx.GraphModule
    input_positions: list[int]
    weight_positions: list[int]
    handoff: list[fx.Node]
    recomputed: list[fx.Node]
    tangents: list[int]
    """Positions of the output gradients among the backward's arguments."""


def _ancestors(roots: Iterable[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _op_name(node: fx.Node) -> str | None:
    target = node.target
    if isinstance(target, OpOverload):
        return schema_of(target).name.split("::")[-1]
    return None


def _free(node: fx.Node) -> bool:
    """Whether ``node`` costs no FLOPs: a view or an elementwise op, nothing random or in place."""
    if node.op in ("placeholder", "get_attr"):
        return True
    if node.op != "call_function":
        return False
    target = node.target
    if not isinstance(target, OpOverload) or schema_of(target).is_mutable:
        return False
    if torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return _op_name(node) in _VIEWS or torch.Tag.pointwise in target.tags


def _recomputable(node: fx.Node, memo: dict[fx.Node, bool], depth: int = 0) -> bool:
    """Whether W can rebuild ``node`` from the backward's inputs with free ops only."""
    if node in memo:
        return memo[node]
    ok = node.op == "placeholder" or (
        depth < _RECOMPUTE_DEPTH
        and _free(node)
        and all(_recomputable(a, memo, depth + 1) for a in node.all_input_nodes)
    )
    memo[node] = ok
    return ok


def _subgraph(
    gm: fx.GraphModule, keep: set[fx.Node], extra: Sequence[fx.Node], outputs: Sequence[Any]
) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = graph.node_copy(n)
    for h in extra:
        p = graph.placeholder(f"handoff_{h.name}")
        p.meta = dict(h.meta)
        env[h] = p
    for n in gm.graph.nodes:
        if n in keep and n not in env and n.op not in ("placeholder", "output"):
            env[n] = graph.node_copy(n, env.__getitem__)
    out = graph.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outputs))
    out.meta["user_visible_output_idxs"] = [
        i for i, o in enumerate(outputs) if isinstance(o, fx.Node)
    ]
    graph.lint()
    return fx.GraphModule(gm, graph)


def _is_mutating(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, OpOverload) and schema_of(target).is_mutable


def cut_graph(gm: fx.GraphModule, is_weight: Sequence[bool | None]) -> Plan | str:
    """Cut ``gm`` (outputs: one gradient per region input) into I and W, or say why not.

    ``is_weight[j]`` is True for a weight's gradient, False for an input's, None for a
    non-tensor input (always a None gradient).
    """
    out_node = gm.graph.output_node()
    outs = list(out_node.args[0])  # type: ignore[arg-type]
    if len(outs) != len(is_weight):
        return (
            f"its backward has {len(outs)} outputs for {len(is_weight)} inputs (AOTAutograd "
            "deduplicated or regrouped them)"
        )
    if any(_is_mutating(n) for n in gm.graph.nodes):
        return "its backward graph mutates a tensor in place"
    ipos = [j for j, o in enumerate(outs) if isinstance(o, fx.Node) and is_weight[j] is False]
    wpos = [j for j, o in enumerate(outs) if isinstance(o, fx.Node) and is_weight[j]]
    a_i = _ancestors(outs[j] for j in ipos)
    a_w = _ancestors(outs[j] for j in wpos)
    w_only = {n for n in a_w if n not in a_i and n.op != "placeholder"}
    memo: dict[fx.Node, bool] = {}
    handoff: dict[fx.Node, None] = {}
    recompute: set[fx.Node] = set()

    def need(a: fx.Node) -> None:
        if a.op == "placeholder" or a in w_only or a in recompute or a in handoff:
            return
        if _recomputable(a, memo):
            stack = [a]
            while stack:
                n = stack.pop()
                if n.op != "placeholder" and n not in recompute:
                    recompute.add(n)
                    stack.extend(n.all_input_nodes)
        else:
            handoff[a] = None

    for n in w_only:
        for a in n.all_input_nodes:
            need(a)
    for j in wpos:
        need(outs[j])
    hand = [n for n in gm.graph.nodes if n in handoff]
    input_gm = _subgraph(gm, a_i, (), [outs[j] for j in ipos] + hand)
    weight_gm = _subgraph(gm, w_only | recompute, hand, [outs[j] for j in wpos])
    recomputed = [n for n in gm.graph.nodes if n in recompute]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tangents = [i for i, n in enumerate(placeholders) if n.name.startswith("tangents")]
    return Plan(input_gm, weight_gm, ipos, wpos, hand, recomputed, tangents)


def example_of(node: fx.Node) -> Any:
    return node.meta.get("val")
