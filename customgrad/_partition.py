"""The one partitioner: cutting a backward's FX graph into an input pass and a weight pass.

The split program (:mod:`customgrad._split_program`) uses it for both kinds of graph customgrad
splits: a traced single backward and a compiled region's AOTAutograd backward. Given the
graph's outputs each pass must produce, :func:`partition` says which nodes each pass runs and what the
input pass hands to the weight pass:

- a node only the input pass's outputs need runs in the input pass, one only the weight pass's
  outputs need in the weight pass, and one no output needs nowhere;
- a node both need runs once, in the input pass, and is handed over (*kept*) where the weight
  pass reads it; a shared node that costs no FLOPs by torch's formulas (views, elementwise ops,
  reductions: :func:`cheap`, the one recompute rule) may be run again in the weight pass
  instead (:data:`Recompute` says which).

So FLOPs(input) + FLOPs(weight) == FLOPs(whole graph) by torch's FLOP formulas, always.
:func:`extract` builds a pass's graph from the original's nodes (as AOTAutograd's
``_extract_graph_with_inputs_outputs`` does for its forward and backward), the kept values as
extra inputs of the weight pass.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx as fx

from customgrad._flops import formula_of
from customgrad._torch.dispatcher import OpOverload, schema_of

__all__ = [
    "REBUILD_DEPTH",
    "Partition",
    "Recompute",
    "ancestors",
    "cheap",
    "partition",
    "extract",
    "free",
    "rebuildable",
    "written",
]

_FREE_OPS = ("placeholder", "get_attr")


def free(node: fx.Node) -> bool:
    """Available in every pass without computing: an input of the graph, or a constant."""
    return node.op in _FREE_OPS


def cheap(node: fx.Node) -> bool:
    """The recompute rule: safe to run again and free by torch's FLOP formulas (a view, an
    elementwise op); opaque kernels (cost unknown), random ops and writes never are."""
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, OpOverload) or target.namespace not in ("aten", "prims"):
        return False
    if schema_of(target).is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return formula_of(target) is None


def ancestors(roots: Iterable[fx.Node], stop: Iterable[fx.Node] = ()) -> set[fx.Node]:
    """The nodes ``roots`` are computed from (themselves included), not past ``stop`` or the
    graph's inputs."""
    stopped = set(stop)
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen or node in stopped or free(node):
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def written(t: torch.Tensor, writer: object) -> torch.Tensor:
    """``t`` once ``writer`` wrote into it: in a graph, makes an opaque op's write an input of
    the nodes that read ``t`` after it (see :func:`customgrad._split_program.clean`); :func:`extract` drops
    it again."""
    return t


@dataclass(frozen=True)
class Partition:
    """Where :func:`partition` put each node.

    Attributes:
        input: the nodes the input pass runs.
        weight: the nodes the weight pass runs (recomputed ones included).
        kept: what the input pass hands to the weight pass, in graph order.
        recomputed: shared nodes the weight pass runs again instead of receiving them.
    """

    input: frozenset[fx.Node]
    weight: frozenset[fx.Node]
    kept: tuple[fx.Node, ...]
    recomputed: frozenset[fx.Node]


REBUILD_DEPTH = 8
"""How many cheap ops deep :func:`rebuildable` looks for the graph's inputs."""


def rebuildable(node: fx.Node, memo: dict[fx.Node, bool], depth: int = 0) -> bool:
    """Whether ``node`` can be rebuilt from the graph's inputs with :func:`cheap` ops only."""
    found = memo.get(node)
    if found is None:
        found = free(node) or (
            depth < REBUILD_DEPTH
            and cheap(node)
            and all(rebuildable(a, memo, depth + 1) for a in node.all_input_nodes)
        )
        memo[node] = found
    return found


Recompute = Literal["none", "cheap", "from_inputs"]
"""Which shared nodes the weight pass runs again instead of receiving them: none; every
:func:`cheap` one (keeping what it reads that is not cheap: ``recompute="cheap"`` of a traced
backward); or only cheap chains that rebuild them from the graph's inputs (nothing new is kept
for them: a compiled region's policy)."""


def partition(
    graph: fx.Graph,
    input_outputs: Iterable[fx.Node],
    weight_outputs: Iterable[fx.Node],
    recompute: Recompute = "none",
) -> Partition:
    """Partition ``graph`` into an input pass producing ``input_outputs`` and a weight pass producing
    ``weight_outputs`` (see the module's docstring and :data:`Recompute`)."""
    rule: Callable[[fx.Node], bool] | None = None
    if recompute == "cheap":
        rule = cheap
    elif recompute == "from_inputs":
        memo: dict[fx.Node, bool] = {}

        def rule(node: fx.Node) -> bool:
            return rebuildable(node, memo)

    weight_outs = [n for n in weight_outputs if not free(n)]
    in_input = ancestors(input_outputs)
    in_weight = ancestors(weight_outs)
    shared = in_input & in_weight
    weight_only = in_weight - in_input
    # Shared nodes the weight pass reads: outputs of it, or inputs of its own nodes.
    todo = [n for n in shared if n in weight_outs or any(u in weight_only for u in n.users)]
    keep: set[fx.Node] = set()
    again: set[fx.Node] = set()
    while todo:
        node = todo.pop()
        if node in keep or node in again:
            continue
        if rule is not None and rule(node):
            again.add(node)
            todo.extend(n for n in node.all_input_nodes if n in shared)
        else:
            keep.add(node)
    kept = tuple(n for n in graph.nodes if n in keep)
    return Partition(frozenset(in_input), frozenset(weight_only | again), kept, frozenset(again))


def extract(
    gm: fx.GraphModule,
    nodes: Iterable[fx.Node],
    outputs: Sequence[fx.node.Argument],
    kept: Sequence[fx.Node] = (),
) -> fx.GraphModule:
    """A graph module of ``gm``'s placeholders, then ``kept`` as further inputs, running
    ``nodes`` (in ``gm``'s order; constants they read come along) and returning ``outputs``
    (nodes of ``gm``, or constants such as None). :func:`written` markers are dropped (the
    order of ``gm`` keeps each write before its readers)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = graph.node_copy(n)
    for h in kept:
        p = graph.placeholder(f"kept_{h.name}")
        p.meta = dict(h.meta)
        env[h] = p
    run = set(nodes)
    wanted = {o for o in outputs if isinstance(o, fx.Node)}
    for n in gm.graph.nodes:
        if n in env or n.op in ("placeholder", "output"):
            continue
        if n.target is written and n in run:
            env[n] = env[n.args[0]]
        elif n in run or (n.op == "get_attr" and (n in wanted or any(u in run for u in n.users))):
            env[n] = graph.node_copy(n, env.__getitem__)
    out = graph.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outputs))
    # Which outputs are tensors the caller sees (inductor reads it from a backward graph).
    out.meta["user_visible_output_idxs"] = [
        i for i, o in enumerate(outputs) if isinstance(o, fx.Node)
    ]
    graph.lint()
    return fx.GraphModule(gm, graph)
