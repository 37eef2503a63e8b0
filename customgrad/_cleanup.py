"""The graph clean-up every split program runs before it is cut: in-place writes, shared work.

A backward graph customgrad cuts into an input and a weight pass, a traced single backward's
(:mod:`customgrad._autosplit`) or a compiled region's (:mod:`customgrad._compiled_backward`),
goes through :func:`clean` first, so that every node is a pure function of its inputs (the
partition relies on it) and work the graph writes twice runs once:

- an in-place metadata write on a tensor the graph made (``squeeze_`` inside ``torch.matmul``
  of a vector, which functionalization keeps) becomes its out-of-place view;
- an opaque op that writes into tensors the graph made (an out-variant custom op filling an
  ``empty_like``) becomes an input of every node that reads them after it (a :func:`written`
  marker, which :func:`customgrad._partition.extract` drops again), so the partition runs it
  once, before them;
- repeated pure aten ops are computed once (torch's ``CSEPass``): work a backward writes twice
  (unsloth's LoRA computes ``dY @ B.t()`` for dX and again for dA) is shared, run once in the
  input pass and handed to the weight pass. Opaque ops, random ops and writes are never merged.

What still writes in place after it (a write into an input of the graph) is returned by
:func:`clean`: such a graph is not split.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from customgrad._partition import free, written
from customgrad._torch.dispatcher import OpOverload, overload_name, schema_of

__all__ = ["clean", "mutating", "random"]


def clean(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[fx.Node]]:
    """``gm`` rewritten (see the module's docstring) and CSE'd, and the nodes that still write
    in place (empty when it can be cut)."""
    left = mutating(gm)
    if left:
        return gm, left
    from torch.fx.passes.dialect.common.cse_pass import CSEPass, get_CSE_banned_ops

    banned: set[Any] = set(get_CSE_banned_ops())
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if (
            not isinstance(target, OpOverload)
            or target.namespace not in ("aten", "prims")
            or schema_of(target).is_mutable
            or random(node)
        ):
            banned.add(getattr(target, "overloadpacket", target))
    result = CSEPass(banned_ops=banned)(gm)
    return (result.graph_module if result is not None and result.modified else gm), []


def random(node: fx.Node) -> bool:
    """Whether ``node`` draws from a random generator (an aten op tagged nondeterministic_seeded)."""
    target = node.target
    return isinstance(target, OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def mutating(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes that write in place, after rewriting those that need not."""
    found = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and isinstance(n.target, OpOverload)
        and schema_of(n.target).is_mutable
    ]
    if found:
        rewritten = [n for n in found if _pure(n) or _ordered(n)]
        if rewritten:
            gm.recompile()
            found = [n for n in found if n not in rewritten]
    return found


def _ordered(node: fx.Node) -> bool:
    """Make the write of an opaque op into tensors the graph created an input of every node that
    reads them after it. Whether it could."""
    target = node.target
    assert isinstance(target, OpOverload)
    if target.namespace in ("aten", "prims"):
        return False  # functionalized
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    writes: list[fx.Node] = []
    for a, value in zip(schema_of(target).arguments, node.args):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        if not isinstance(value, fx.Node) or free(value):
            return False  # an input of the graph (or not a tensor the graph made)
        made = value.target
        if isinstance(made, OpOverload) and made.is_view:
            return False  # a view: it may write into an input
        if any(order[u] < order[node] for u in value.users if u is not node):
            return False  # read before the write: which value a reader sees depends on order
        writes.append(value)
    if not writes or node.kwargs:
        return False
    graph = node.graph
    for value in writes:
        later = [u for u in value.users if order[u] > order[node]]
        with graph.inserting_after(node):
            after = graph.call_function(written, (value, node))
        after.meta["val"] = value.meta.get("val")
        for u in later:
            u.replace_input_with(value, after)
    return True


def _pure(node: fx.Node) -> bool:
    """Rewrite an in-place metadata write on a tensor the graph created and reads nowhere else
    into its out-of-place view. Whether it could."""
    target = node.target
    assert isinstance(target, OpOverload)
    if target.namespace != "aten" or not node.args:
        return False
    mutated = node.args[0]
    if not isinstance(mutated, fx.Node) or free(mutated) or len(mutated.users) != 1:
        return False
    schema = schema_of(target)
    writes = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if len(writes) != 1 or writes[0] is not schema.arguments[0]:
        return False
    name = target.overloadpacket.__name__
    packet = getattr(torch.ops.aten, name[:-1], None) if name.endswith("_") else None
    twin = getattr(packet, overload_name(target), None)
    if not isinstance(twin, OpOverload) or schema_of(twin).is_mutable or not twin.is_view:
        return False  # only metadata writes (data writes are functionalized)
    node.target = twin
    return True
