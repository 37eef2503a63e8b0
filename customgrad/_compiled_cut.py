"""Cutting a compiled region's backward graph into an input part (I) and a weight part (W).

AOTAutograd hands a backend the backward of a compiled region as one FX graph whose outputs are
one gradient per region input. :func:`cut_graph` cuts it, for a given choice of which inputs' gradients
W computes, into the I graph (the other gradients, plus the values W needs from them: the
*hand-off*) and the W graph (its gradients from the backward's inputs and the hand-off), with
customgrad's one partitioner (:mod:`customgrad._partition`): what W can rebuild from the
backward's inputs without FLOPs (views, elementwise ops of saved values) it recomputes rather
than keep. Nothing here runs a graph: :mod:`customgrad._compile` compiles and runs the pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import fx

from customgrad._partition import cut, extract
from customgrad._torch.aot import is_tangent
from customgrad._torch.dispatcher import OpOverload, schema_of

__all__ = ["RegionCut", "cut_graph"]


@dataclass
class RegionCut:
    """A compiled region's backward graph cut into its input-pass and weight-pass graphs (the
    glossary's "plan" is the pass plan; this is a cut)."""

    input_gm: fx.GraphModule
    weight_gm: fx.GraphModule
    input_positions: list[int]
    weight_positions: list[int]
    handoff: list[fx.Node]
    recomputed: list[fx.Node]
    tangents: list[int]
    """Positions of the output gradients among the backward's arguments."""


def _is_mutating(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, OpOverload) and schema_of(target).is_mutable


def cut_graph(gm: fx.GraphModule, is_weight: Sequence[bool | None]) -> RegionCut | str:
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
    # The one partitioner; W rebuilds from the backward's inputs what costs no FLOPs.
    c = cut(gm.graph, [outs[j] for j in ipos], [outs[j] for j in wpos], "from_inputs")
    hand = list(c.kept)
    input_gm = extract(gm, c.early, [outs[j] for j in ipos] + hand)
    weight_gm = extract(gm, c.late, [outs[j] for j in wpos], hand)
    recomputed = [n for n in gm.graph.nodes if n in c.recomputed]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tangents = [i for i, n in enumerate(placeholders) if is_tangent(n)]
    return RegionCut(input_gm, weight_gm, ipos, wpos, hand, recomputed, tangents)
