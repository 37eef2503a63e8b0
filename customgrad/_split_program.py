"""The split program: one backward graph with gradient slots, cut into an input and a weight pass.

A traced single backward (:class:`customgrad._autosplit.TracedSplit`) and a compiled region's
AOTAutograd backward (:mod:`customgrad._compiled_backward`) are the same kind of thing: an aten
graph whose outputs are gradient *slots*, to be cut, for a given choice of which slots the weight
pass computes, into an input pass (the other slots, plus the values the weight pass needs from
it: the *kept* values, handed over as :class:`customgrad._handoff.Kept`) and a weight pass (its
slots, from the graph's inputs and the kept values). :class:`SplitProgram` is that, for both:

- the graph is cleaned first (:func:`clean`), so that every node is a pure function of its
  inputs (the partition relies on it) and work written twice runs once: an in-place metadata
  write on a tensor the graph made (``squeeze_`` inside ``torch.matmul`` of a vector, which
  functionalization keeps) becomes its view; an opaque op that writes into tensors the graph
  made (an out-variant custom op filling an ``empty_like``) becomes an input of every node
  that reads them after it (a :func:`customgrad._partition.written` marker, dropped again by
  ``extract``); repeated pure aten ops are computed once (torch's ``CSEPass``: unsloth's LoRA
  computes ``dY @ B.t()`` for dX and again for dA; opaque ops, random ops and writes are never
  merged). A graph that still writes into one of its inputs is not cut;
- each cut is made by the one partitioner (:func:`customgrad._partition.partition`), with the
  program's recompute rule, and its two passes are built and compiled once, when first asked
  for (the pass cache, :meth:`SplitProgram.cut`): a traced backward builds them as generated
  Python over aten calls, a compiled region with its backend's compiler;
- random ops run in the input pass, all of them, in the graph's order (the draws are those of
  one call of the whole graph there), and what the weight pass needs of them is kept.

Running the passes (who calls them, with which hand-off) is the callers' job: the program only
builds them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from customgrad._partition import Recompute, ancestors, extract, free, partition, written
from customgrad._torch.dispatcher import OpOverload, overload_name, schema_of

__all__ = ["Compiler", "Pass", "ProgramCut", "SplitProgram", "clean", "mutating", "random"]

Compiler = Callable[[fx.GraphModule, list[object]], Callable[..., Sequence[torch.Tensor]]]
"""Compiles one pass's graph module, given example inputs (the graph's, then the kept values'
fake tensors): a traced backward's generated call, or a compiled region's backend compiler."""


class Pass(NamedTuple):
    """One built pass: ``fn(*graph inputs[, *kept]) -> (*gradients, *kept)`` as its compiler
    calls it."""

    fn: Callable[..., Sequence[torch.Tensor]]
    slots: tuple[int, ...]
    """The gradient slot of each of its first outputs."""
    n_kept: int
    """How many values it keeps for the weight pass (after the gradients), or takes."""
    gm: fx.GraphModule
    """The pass's graph, as cut (before compiling)."""

    @property
    def n_ops(self) -> int:
        """Number of operations the pass runs."""
        return sum(1 for n in self.gm.graph.nodes if n.op == "call_function")


class ProgramCut:
    """One cut of a :class:`SplitProgram`: the slots its weight pass computes, and both passes.

    Attributes:
        program: the program it cuts.
        weight: the slots the weight pass computes (the input pass computes the other live ones).
        input_pass: computes the input slots, then returns the kept values.
        weight_pass: takes the graph's inputs, then the kept values; computes ``weight``.
        kept: the values handed over, as nodes of the program's graph.
        recomputed: the nodes the weight pass runs again rather than receiving them.
    """

    __slots__ = ("input_pass", "kept", "program", "recomputed", "weight", "weight_pass")

    def __init__(
        self,
        program: SplitProgram,
        weight: frozenset[int],
        input_pass: Pass,
        weight_pass: Pass,
        kept: tuple[fx.Node, ...],
        recomputed: tuple[fx.Node, ...],
    ) -> None:
        self.program = program
        self.weight = weight
        self.input_pass = input_pass
        self.weight_pass = weight_pass
        self.kept = kept
        self.recomputed = recomputed

    def serves(self, program: SplitProgram, needed: frozenset[int]) -> bool:
        """Whether this cut's weight pass computes every slot of ``needed`` (of ``program``)."""
        return program is self.program and bool(needed) and needed <= self.weight

    def __repr__(self) -> str:
        return f"<cut: weight pass computes slots {sorted(self.weight)}, {len(self.kept)} kept>"


class SplitProgram:
    """A backward graph with gradient slots, cleaned, and its cuts (see the module's docstring).

    Args:
        gm: the graph: ``(*inputs) -> (*slots)`` (a slot may be a constant, such as None).
        live: the slots a pass may compute (the others are never asked for).
        recompute: the recompute rule of every cut (:data:`customgrad._partition.Recompute`).
        compiler: builds each pass (:data:`Compiler`).
        examples: example inputs of the graph, for the compiler (fake or real tensors).
        boxed: the compiler's passes take their inputs as one list, which they empty (a
            compiled region's), rather than as arguments.

    Attributes:
        graph_module: the cleaned graph.
        mutated: nodes that still write in place after the clean-up (then nothing is cut: the
            caller runs the graph whole).
        whole_pass: the pass that computes every live slot, when the caller built it (else
            built from the graph when first asked for, :meth:`whole`).
        failed: the cuts the compiler could not build, with why.
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        live: Iterable[int],
        recompute: Recompute,
        compiler: Compiler,
        examples: Sequence[object] = (),
        boxed: bool = False,
    ) -> None:
        self.boxed = boxed
        self.whole_pass: Pass | None = None
        self.failed: dict[frozenset[int], str] = {}
        # per (slots needed, slots that require grad): those the pass computes, those it leaves
        self.patterns: dict[tuple[frozenset[int], ...], tuple[frozenset[int], frozenset[int]]] = {}
        self.graph_module, self.mutated = clean(gm)
        self.live = frozenset(live)
        self.recompute: Recompute = recompute
        self.compiler = compiler
        self.examples = list(examples)
        nodes = list(self.graph_module.graph.nodes)
        self.outputs: list[Any] = list(self.graph_module.graph.output_node().args[0])  # type: ignore[arg-type]
        self.random = [n for n in nodes if random(n)]
        self.n_ops = sum(1 for n in nodes if n.op == "call_function")
        self._cuts: dict[frozenset[int], ProgramCut] = {}
        self._passes: dict[tuple[frozenset[int], ...], Pass] = {}
        self._lock = threading.RLock()

    # -- the pass cache ----------------------------------------------------------------------
    def cut(self, weight: frozenset[int]) -> ProgramCut:
        """The cut whose weight pass computes the slots ``weight`` (built once, then cached)."""
        found = self._cuts.get(weight)
        if found is None:
            with self._lock:
                found = self._cuts.get(weight) or self._cuts.setdefault(weight, self._cut(weight))
        return found

    def cut_or_none(self, weight: frozenset[int]) -> ProgramCut | None:
        """:meth:`cut`, or None where the compiler could not build it (remembered, with why, in
        :attr:`failed`: that pattern then runs the whole program)."""
        found = self._cuts.get(weight)
        if found is not None:
            return found
        if weight in self.failed:
            return None
        try:
            return self.cut(weight)
        except Exception as e:  # a backend that cannot compile this cut
            self.failed[weight] = f"{type(e).__name__}: {e}"
            return None

    def whole(self) -> Pass:
        """The pass that computes every live slot (:attr:`whole_pass` when the caller gave one:
        a compiled region's own full backward)."""
        return self.whole_pass if self.whole_pass is not None else self.full(self.live)

    def full(self, slots: frozenset[int]) -> Pass:
        """The full pass for ``slots``: computes them, keeps nothing (random ops all drawn)."""
        return self._pass((slots,), slots, ())

    def weight_pass(self, cut: ProgramCut, slots: frozenset[int]) -> Pass:
        """``cut``'s weight pass narrowed to ``slots`` (a subset of ``cut.weight``)."""
        return (
            cut.weight_pass
            if slots == cut.weight
            else self._pass((cut.weight, slots), slots, cut.kept)
        )

    def _pass(
        self, key: tuple[frozenset[int], ...], slots: frozenset[int], kept: tuple[fx.Node, ...]
    ) -> Pass:
        found = self._passes.get(key)
        if found is None:
            with self._lock:
                found = self._passes.get(key)
                if found is None:
                    order = tuple(sorted(slots))
                    results = self._nodes(order)
                    drawn = [] if kept else self.random
                    nodes = ancestors([*results, *drawn], kept)
                    results += [n for n in drawn if n not in results]  # drawn, unused
                    found = self._passes[key] = self._build(nodes, order, results, kept)
        return found

    # -- building ------------------------------------------------------------------------------
    def _nodes(self, slots: Sequence[int]) -> list[Any]:
        return [self.outputs[i] for i in slots]

    def _cut(self, weight: frozenset[int]) -> ProgramCut:
        input_slots = tuple(sorted(self.live - weight))
        weight_slots = tuple(sorted(weight))
        input_outs = self._nodes(input_slots)
        weight_outs = self._nodes(weight_slots)
        c = partition(
            self.graph_module.graph,
            [*(n for n in input_outs if isinstance(n, fx.Node)), *self.random],
            [n for n in weight_outs if isinstance(n, fx.Node)],
            self.recompute,
        )
        kept = c.kept
        nodes = ancestors([*(n for n in input_outs if isinstance(n, fx.Node)), *kept, *self.random])
        input_pass = self._build(nodes, input_slots, [*input_outs, *kept], (), len(kept))
        weight_pass = self._build(c.weight, weight_slots, weight_outs, kept)
        recomputed = tuple(n for n in self.graph_module.graph.nodes if n in c.recomputed)
        return ProgramCut(self, weight, input_pass, weight_pass, kept, recomputed)

    def _build(
        self,
        nodes: Any,
        slots: tuple[int, ...],
        results: Sequence[Any],
        kept: Sequence[fx.Node],
        n_kept: int | None = None,
    ) -> Pass:
        gm = extract(self.graph_module, nodes, results, kept)
        examples = [*self.examples, *(h.meta.get("val") for h in kept)]
        fn = self.compiler(gm, examples)
        return Pass(fn, slots, len(kept) if n_kept is None else n_kept, gm)


# --------------------------------------------------------------------------------------------
# The clean-up


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
