"""The split planner: reading a stage's autograd graph, and planning a split backward's passes.

A split backward runs an input pass (I: the gradients of the stage inputs, and every activation
gradient inside the stage) and later a weight pass (W: the weights' gradients).
:func:`plan_input_pass` decides, for one stage's graph, what I runs:

- customgrad nodes on the activation side hand their weight half to W (*deferred*): they run in
  I for their input half (or only to hand over the work, when no input of theirs needs a
  gradient, as in a pipeline's first stage);
- I runs every node that leads to a stage input or to a deferred node (:attr:`executed`), and
  tells each routed node among them (a customgrad node's record, a compiled region's
  ``RegionNode``: one rule for both) which of its edges the pass uses (a route), so that no
  node has to ask the engine; W's route tells routed intermediates to compute their weight side;
- plain ``torch.autograd.Function`` nodes of I with edges into the weight side (Liger-Kernel's,
  unsloth's, any ``torch.library.custom_op``'s) run *once* (:attr:`InputPassPlan.once`): their
  backward computes every gradient whatever the pass needs, so I keeps the weight-side
  gradients it returned (a post-hook sees them all) and W sends those on instead of calling the
  backward again, which torch's split does (twice the kernels, and wrong gradients for a
  backward that writes its output gradient in place);
- other nodes of I with edges into the weight side (native ops; plain Functions with
  ``run_once=False``) are *intermediates*: I records the gradients that reach them, and W runs
  them again from those (torch's split does the same), in engine calls where nothing below
  their input edges is wanted, so that they compute their weight-side outputs only
  (:class:`WeightCall`). A native intermediate whose input edges do lead to its call's weights
  (a weight it shares with a layer before it) is *asked* instead: W calls it itself, where
  only its weight-side edges are wanted.

``customgrad.pipelining.stage_backward_input``/``_weight`` and the weight-gradient queue both
plan with it (the queue keeps native weight work in I and defers only customgrad weight halves
whose weights nothing else in I touches), and ``customgrad.graph.explain_split`` reports with it.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import Node

from customgrad._compiled_region import CompiledRegion, RegionNode, region_node
from customgrad._record import NodeRecord, record_of
from customgrad._routing import DeferTarget, Route, Routed
from customgrad._torch.engine import ACCUMULATE_GRAD
from customgrad._torch.functions import forward_cls, is_aot_node

_ACCUMULATE: type = ACCUMULATE_GRAD
_target = operator.itemgetter(0)  # the node of a (node, input_nr) edge
"""The node class that accumulates a leaf's gradient into ``.grad``."""

__all__ = [
    "STATE_KEY",
    "InputPassPlan",
    "StageSplit",
    "Watch",
    "WeightCall",
    "WeightIntoRegion",
    "children",
    "grad_node",
    "is_leaf_accumulator",
    "is_native",
    "plan_input_pass",
    "postorder",
    "runs_once",
    "reach",
    "stage_split",
    "weights_into_regions",
]


Watch = Callable[[Node], contextlib.AbstractContextManager[object]]
"""What runs around each piece of weight work W runs outside the engine, by its node (the
tools count its FLOPs to that node)."""

STATE_KEY = "customgrad_split"
"""The key of the split state in the ``param_groups`` a split input pass returns."""


class StageSplit(Protocol):
    """What a stage's split input pass left for its weight pass, as the tools read it before W
    runs (``customgrad.pipelining.stage_backward_input``'s state, found by
    :func:`stage_split`): the one seam ``explain_split`` and ``summary()`` read."""

    def deferred_nodes(self) -> set[Node]:
        """The customgrad nodes whose weight half went to W."""

    def split_functions(self) -> set[int]:
        """The ``id`` of each plain Function node whose backward split (weight work in W)."""

    def once_functions(self) -> set[int]:
        """The ``id`` of each plain Function node that ran once in I (W sends on what it
        returned)."""

    def watch(self, watch: Watch) -> None:
        """Have W run ``watch(node)`` around each piece of weight work it runs outside the
        engine (deferred weight halves, split Functions' weight passes, nodes it calls)."""


def stage_split(param_groups: object) -> StageSplit | None:
    """The split state a split input pass left in its ``param_groups`` (None for anything
    else, such as torch's own ``param_groups``)."""
    if isinstance(param_groups, list) and len(param_groups) == 1:
        first = param_groups[0]
        state = first.get(STATE_KEY) if isinstance(first, dict) else None
        if state is not None:
            return cast(StageSplit, state)  # (what only customgrad's input pass puts there)
    return None


def grad_node(t: torch.Tensor) -> Node | None:
    """The node a gradient for ``t`` flows into: its ``grad_fn``, or its ``AccumulateGrad``."""
    if not t.requires_grad:
        return None
    if t.grad_fn is not None:
        return t.grad_fn
    return torch.autograd.graph.get_gradient_edge(t).node


def is_native(node: Node) -> bool:
    """Whether ``node`` is one of torch's own (C++) nodes, not a Python ``autograd.Function``'s:
    its backward computes an output only where the running engine call wants one."""
    return not isinstance(node, BackwardCFunction)


def runs_once(node: Node) -> bool:
    """Whether ``node`` is a plain ``torch.autograd.Function``'s (a ``torch.library.custom_op``'s
    included): one backward that computes every gradient it returns whatever the running pass
    needs. Not customgrad's nodes (they split) nor AOTAutograd's compiled regions (they have
    their own split)."""
    return forward_cls(node) is not None and record_of(node) is None and not is_aot_node(node)


def is_leaf_accumulator(node: Node) -> bool:
    """Whether ``node`` accumulates a leaf tensor's gradient into its ``.grad``."""
    return not node.next_functions and hasattr(node, "variable")


def children(node: Node) -> Iterator[Node]:
    """The nodes ``node`` sends gradients to."""
    for fn, _ in node.next_functions:
        if fn is not None:
            yield fn


def postorder(roots: Iterable[Node], stop: Iterable[Node] = ()) -> list[Node]:
    """Every node reachable from ``roots``, children before parents; nothing past ``stop``."""
    return _walk(list(roots), set(stop))[0]


class _Edges(dict[Node, list[Node | None]]):
    """Each node's edge targets (as :func:`_walk` records them), read off the graph when
    first asked for; none past ``stop``."""

    def __init__(self, stop: set[Node]) -> None:
        super().__init__()
        self.stop = stop

    def __missing__(self, node: Node) -> list[Node | None]:
        kids = [] if node in self.stop else [*map(_target, node.next_functions)]
        self[node] = kids
        return kids


def reach(
    starts: Iterable[Node], stop: set[Node], cut: Mapping[Node, Sequence[Node]] | None = None
) -> set[Node]:
    """Nodes reachable from ``starts`` (included), not past ``stop``; a node in ``cut`` leads
    only to ``cut[node]``."""
    return _reach_in(_Edges(stop), starts, cut)


@dataclass
class WeightCall:
    """One autograd engine call of W: work whose weight sides share no node with another
    call's, and where no intermediate the engine runs has input edges leading to this call's
    leaves (except plain Functions, see ``clamp``).

    The engine computes a node's output along an edge when the edge's node leads to what the
    call accumulates (``inputs=``). An intermediate run again in W must therefore not share a
    call with what lies below its input edges (the layers before it): there its input gradient
    would be computed again. Calls keep them apart (torch's weight pass runs one call per
    parameter group for the same reason); work whose weight sides meet (a shared weight) stays
    in one call, so that each leaf accumulates once and its hooks fire once; when such work
    lies below an intermediate of the call, the work in between joins the call too.

    Attributes:
        intermediates: nodes the engine runs again from the gradients that reached them in I.
        asked: native and customgrad intermediates whose input edges lead to this call's
            leaves (a weight shared with a layer before them, where torch's weight pass
            computes their input gradient again): W calls each itself, from the gradients that
            reached it in I, where only its weight-side edges are wanted (a native node computes
            what the running engine call wants, a customgrad node what its route says), and
            sends what it returns on those edges into the call; the engine never runs them.
        deferred: records of the customgrad nodes whose handed-over weight halves go here.
        once: plain Function nodes that ran once in I: the weight-side gradients they returned
            there go here.
        direct: positions of the roots that lead only to weights.
        leaves: the leaf accumulators the call fills.
        clamp: intermediates the engine runs whose input edges do lead to this call's leaves
            (plain ``autograd.Function``\\ s run with ``run_once=False`` and compiled regions,
            which compute what they compute whatever the engine wants); W drops what they send
            along those edges, which I already sent. Other nodes in between run with no
            gradient (natives compute nothing; W makes the Functions among them return nothing,
            :func:`customgrad._torch.functions.skipping`) and may run again in their own call,
            so every call but the last keeps the graph.
    """

    intermediates: list[Node] = field(default_factory=list)
    asked: list[Node] = field(default_factory=list)
    deferred: list[NodeRecord] = field(default_factory=list)
    once: list[Node] = field(default_factory=list)
    direct: list[int] = field(default_factory=list)
    leaves: list[Node] = field(default_factory=list)
    clamp: list[Node] = field(default_factory=list)


@dataclass
class InputPassPlan:
    """What :func:`plan_input_pass` decided for one stage's graph.

    Attributes:
        executed: the nodes I runs (stage inputs' and leaf accumulators it accumulates
            included).
        deferred: customgrad nodes whose weight half goes to W, with where it goes.
        intermediates: nodes of I with edges into the weight side that W runs again (only with
            ``defer_native``); :meth:`weight_side_edges` tells which of their edges W needs.
        once: plain Function nodes of I with edges into the weight side that run once, in I
            (only with ``defer_native`` and ``run_once``): W sends on the weight-side gradients
            they returned in I.
        direct: positions of the roots that lead only to weights (W starts there).
        targets: the nodes I must run beyond the stage inputs (deferred customgrad nodes, and
            without ``defer_native`` the leaf accumulators I fills).
        weight_leaves: the leaf accumulators W fills (only with ``defer_native``).
        input_routes: a route for every routed node I runs (customgrad nodes and compiled
            regions' nodes alike, :class:`customgrad._routing.Routed`).
        weight_routes: routes for W: deferred nodes compute nothing, routed intermediates
            (customgrad and compiled) only their weight-side edges.
        weight_side: the nodes W runs (they lead only to leaf accumulators; I does not run
            them).
        weight_calls: how W sends its work through the engine (see :class:`WeightCall`).
        into_regions: plain Function nodes of :attr:`once` whose edges (by position) lead
            into a compiled region I runs, whose backward sends what they carry only to its
            weight side (:func:`weights_into_regions`; a weight cast inside the region before
            the Function's graph break), with the region's node each leads into: weight-side
            edges all the same. The Function's split leaves their gradients to W, which sends
            them into the region's own weight pass (the region is an intermediate of the same
            call); where the Function runs as written, the engine gives them to the region in I
            and W re-sends them with the region's other output gradients.
        regions: the compiled regions' nodes I runs.
    """

    executed: set[Node] = field(default_factory=set)
    deferred: dict[Node, DeferTarget] = field(default_factory=dict)
    intermediates: list[Node] = field(default_factory=list)
    once: list[Node] = field(default_factory=list)
    direct: list[int] = field(default_factory=list)
    targets: list[Node] = field(default_factory=list)
    weight_leaves: list[Node] = field(default_factory=list)
    input_routes: dict[Routed, Route] = field(default_factory=dict)
    weight_routes: dict[Routed, Route] = field(default_factory=dict)
    weight_side: set[Node] = field(default_factory=set)
    weight_calls: list[WeightCall] = field(default_factory=list)
    into_regions: dict[Node, dict[int, Node]] = field(default_factory=dict)
    regions: list[RegionNode] = field(default_factory=list)

    def weight_side_edges(self, node: Node, regions: bool = True) -> tuple[bool, ...]:
        """For each edge of ``node``, whether it leads into the weight side (or, with
        ``regions``, carries only a weight's gradient into a compiled region I runs:
        :attr:`into_regions`)."""
        side = self.weight_side
        into = self.into_regions.get(node) if regions else None
        if into is None:
            return tuple(fn is not None and fn in side for fn, _ in node.next_functions)
        return tuple(
            (fn is not None and fn in side) or k in into
            for k, (fn, _) in enumerate(node.next_functions)
        )


@dataclass(frozen=True)
class WeightIntoRegion:
    """An edge of a node I runs whose gradient goes (through views) into a compiled region that
    sends it only to weights, while I runs the region for its other gradients: the gradient
    along that edge is not on the weight side, so I computes it.

    Attributes:
        edge: the node's edge (``next_functions`` position).
        node: the region's autograd node the gradient goes into.
        output: the output of ``node`` whose gradient it is.
        region: the compiled region.
        weights: the region's inputs the gradient reaches (weights, by name).
    """

    edge: int
    node: Node
    output: int
    region: CompiledRegion
    weights: tuple[str, ...]


def weights_into_regions(
    plan: InputPassPlan, node: Node, edges: Sequence[bool] | None = None
) -> list[WeightIntoRegion]:
    """The edges of ``node`` (a node of I; only those ``edges`` marks, if given) whose gradient
    goes into a compiled region that I runs and whose backward sends that gradient only to the
    region's weight-side edges (a weight cast or transposed inside the region, given to a
    Function that runs eagerly after the region's graph break). Read once the region's
    backward has compiled (at its first run); none before."""
    found: list[WeightIntoRegion] = []
    executed, side = plan.executed, plan.weight_side

    def weight(t: Node) -> bool:  # W's, or a weight the queue's I accumulates (its leaf)
        t = _through_views(t, 0, side)[0]
        return t in side or (t in executed and is_leaf_accumulator(t))

    for k, (fn, nr) in enumerate(node.next_functions):
        if fn is None or (edges is not None and not edges[k]):
            continue
        # through views made again outside the region (a transpose of its cast)
        fn, nr = _through_views(fn, nr, side)
        held = region_node(fn)
        if held is None or fn not in executed:
            continue
        region = held.region
        slots = region.reaches.get(nr)
        if not slots:
            continue
        reached = [
            (t, j)
            for (t, _), j in zip(fn.next_functions, region.edge_slots)
            if t is not None and j in slots
        ]
        if reached and all(weight(t) for t, _ in reached):
            names = region.input_names
            weights = tuple(names[j] if j < len(names) else f"input {j}" for _, j in reached)
            found.append(WeightIntoRegion(k, fn, nr, region, weights))
    return found


def _through_views(fn: Node, nr: int, stop: set[Node]) -> tuple[Node, int]:
    """The edge a gradient along ``(fn, nr)`` goes on to through native nodes with one edge
    (views, casts), not past ``stop`` nor into a compiled region."""
    while fn not in stop and is_native(fn) and region_node(fn) is None:
        nexts = fn.next_functions
        child = nexts[0][0] if len(nexts) == 1 else None
        if child is None:
            break
        fn, nr = child, nexts[0][1]
    return fn, nr


def _walk(roots: Sequence[Node], stop: set[Node]) -> tuple[list[Node], dict[Node, list[Any]]]:
    """Every node under ``roots`` in postorder (children first), and each node's edge targets
    in ``next_functions`` order (None where an edge takes no gradient; none past ``stop``)."""
    edges: dict[Node, list[Any]] = {}
    order: list[Node] = []
    for root in roots:
        if root in edges:
            continue
        kids = [] if root in stop else [*map(_target, root.next_functions)]
        edges[root] = kids
        stack: list[tuple[Node, list[Any], int]] = [(root, kids, 0)]
        while stack:
            node, kids, i = stack.pop()
            n = len(kids)
            while i < n:
                child = kids[i]
                i += 1
                if child is not None and child not in edges:
                    grand = [] if child in stop else [*map(_target, child.next_functions)]
                    edges[child] = grand
                    stack.append((node, kids, i))
                    stack.append((child, grand, 0))
                    break
            else:
                order.append(node)
    return order, edges


def _reach_in(
    edges: dict[Node, list[Any]], starts: Iterable[Node], cut: Mapping[Node, Any] | None = None
) -> set[Node]:
    """Nodes reachable from ``starts`` along ``edges``; a node in ``cut`` leads only to
    ``cut[node]``."""
    seen: set[Node] = set()
    stack = [n for n in starts if n is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        kids = cut[node] if cut is not None and node in cut else edges[node]
        for k in kids:
            if k is not None and k not in seen:
                stack.append(k)
    return seen


def _bits(mask: int) -> Iterator[int]:
    """The positions of the set bits of ``mask``."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def plan_input_pass(
    roots: Sequence[Node],
    input_nodes: set[Node],
    target_of: Callable[[NodeRecord], DeferTarget | None],
    *,
    defer_native: bool,
    run_once: bool = True,
) -> InputPassPlan:
    """Plan the input pass of a split backward over the graph under ``roots``.

    Args:
        roots: the nodes the outputs' gradients flow into.
        input_nodes: the nodes of the stage inputs (I computes their gradients; the graph is
            not followed past them).
        target_of: for a customgrad node, where its weight half may go, or None to keep it.
        defer_native: True for customgrad's split (W also re-runs native nodes' weight work);
            False for the weight-gradient queue (native weight work stays in I, so a customgrad
            node defers only when nothing else in I reaches its weights).
        run_once: with ``defer_native``, plain Function nodes of I with edges into the weight
            side run once, in I (:attr:`InputPassPlan.once`); False: W runs them again, as
            torch's split does.
    """
    g = _survey(roots, input_nodes)
    # Candidates: customgrad nodes on the activation side (reached without crossing a
    # customgrad node's weight edges) with weight edges that need a gradient.
    activation = _reach_in(g.edges, roots, {n: others for n, (others, _) in g.split.items()})
    candidates: dict[Node, DeferTarget] = {}
    for node, (_, weights) in g.split.items():
        if weights and node in activation:
            target = target_of(g.records[node])
            if target is not None:
                candidates[node] = target
    executed, live_leaves = _settle(g, roots, candidates, defer_native)
    plan = InputPassPlan(executed=executed, deferred=candidates)
    plan.weight_side = {n for n in g.leads_w if n not in executed}
    plan.regions = [cast(RegionNode, g.routed[n]) for n in g.regions if n in executed]
    if defer_native and run_once and plan.regions:
        _plan_into_regions(plan, g)
    plan.targets = [n for n in g.order if n in candidates or n in live_leaves]
    for node, holder in g.routed.items():
        if node in executed:
            needed = tuple(
                fn is not None and (fn in executed or fn in input_nodes) for fn in g.edges[node]
            )
            plan.input_routes[holder] = Route(needed=needed, defer=candidates.get(node))
    if defer_native:
        _plan_weight_pass(plan, g, roots, run_once)
    return plan


class _Graph:
    """A stage's graph as :func:`plan_input_pass` reads it: the nodes in postorder, their edge
    targets, the customgrad nodes' records (with their non-weight and weight edge targets),
    the routed nodes, the leaf accumulators, and the nodes that lead to one."""

    __slots__ = ("edges", "input_nodes", "leads_w", "leaves", "order", "records", "regions",
                 "routed", "split")  # fmt: skip

    def __init__(
        self, order: list[Node], edges: dict[Node, list[Node | None]], input_nodes: set[Node]
    ) -> None:
        self.order, self.edges, self.input_nodes = order, edges, input_nodes
        self.records: dict[Node, NodeRecord] = {}
        self.routed: dict[Node, Routed] = {}
        self.split: dict[Node, tuple[list[Node], list[Node]]] = {}
        self.leaves: list[Node] = []
        self.leads_w: set[Node] = set()
        self.regions: list[Node] = []


def _survey(roots: Sequence[Node], input_nodes: set[Node]) -> _Graph:
    order, edges = _walk(roots, input_nodes)
    g = _Graph(order, edges, input_nodes)
    records, routed, split, leaves, leads_w = g.records, g.routed, g.split, g.leaves, g.leads_w
    for node in order:  # (locals in the loop: it runs per node of the stage, per microbatch)
        kids = edges[node]
        if node in input_nodes:
            continue
        if not kids and type(node) is _ACCUMULATE:
            leaves.append(node)
            leads_w.add(node)
            continue
        record = record_of(node)
        if record is not None:
            others: list[Node] = []
            weights: list[Node] = []
            for fn, is_weight in zip(kids, record.edge_is_weight()):
                if fn is not None:
                    (weights if is_weight else others).append(fn)
            records[node] = routed[node] = record
            split[node] = (others, weights)
        elif (held := region_node(node)) is not None:
            routed[node] = held
            g.regions.append(node)
        for k in kids:  # (a loop, not any(): no generator per node)
            if k is not None and k in leads_w:
                leads_w.add(node)
                break
    return g


def _plan_into_regions(plan: InputPassPlan, g: _Graph) -> None:
    """:attr:`InputPassPlan.into_regions`, and the regions' outputs whose gradients come in W
    (:attr:`customgrad._compiled_region.RegionNode.loose`). Only into regions that split (a
    region that fell back runs whole in each pass) and whose backward has compiled (at its
    first run: the first backward through a region is planned without it)."""
    executed = plan.executed
    for node in g.order:
        if node in executed and runs_once(node):
            into: dict[int, Node] = {}
            for hit in weights_into_regions(plan, node):
                held = g.routed.get(hit.node)
                if isinstance(held, RegionNode) and hit.region.status == "split":
                    into[hit.edge] = hit.node
                    held.loose = held.loose | {hit.output}
            if into:
                plan.into_regions[node] = into


def _settle(
    g: _Graph, roots: Sequence[Node], candidates: dict[Node, DeferTarget], defer_native: bool
) -> tuple[set[Node], set[Node]]:
    """Drop the candidates that cannot defer, until every one left can: ``(the nodes I runs,
    the leaves the queue's I accumulates)``."""
    edges, input_nodes, split = g.edges, g.input_nodes, g.split
    leaf_set = set(g.leaves)
    while True:
        targets: set[Node] = set(candidates)
        live_leaves: set[Node] = set()
        if not defer_native:
            # The queue's I accumulates every leaf it reaches without crossing a deferring
            # node's weight edges.
            live_cut = {n: split[n][0] for n in candidates}
            live_leaves = _reach_in(edges, roots, live_cut) & leaf_set
            targets |= live_leaves
        executed: set[Node] = set()
        leads_w = g.leads_w
        for node in g.order:
            if node in input_nodes:
                continue
            if node in targets:
                executed.add(node)
                continue
            for k in edges[node]:
                if k is not None and (k in executed or k in input_nodes):
                    executed.add(node)
                    break
        # The weight side: nodes that lead only to leaf accumulators and that I does not run.
        weight_side = {n for n in leads_w if n not in executed and n not in input_nodes}
        bad = []
        for node in candidates:
            others, weights = split[node]
            if not weight_side.issuperset(weights) or not weight_side.isdisjoint(others):
                bad.append(node)  # I needs a "weight" gradient, or W an input one
            elif not defer_native:
                side = _reach_in(edges, weights)
                if not side.isdisjoint(executed) or not side.isdisjoint(input_nodes):
                    bad.append(node)  # its weights also get gradients in I
        if not bad:
            return executed, live_leaves
        for node in bad:
            del candidates[node]


def _plan_weight_pass(
    plan: InputPassPlan, g: _Graph, roots: Sequence[Node], run_once: bool
) -> None:
    """What W runs (customgrad's split): the nodes of I it runs again or whose Functions ran
    once, the roots that lead only to weights, the leaves it fills, its routes and calls."""
    side, executed, edges = plan.weight_side, plan.executed, g.edges
    for node in g.order:
        if (
            node in executed
            and node not in plan.deferred
            and (node in plan.into_regions or any(k is not None and k in side for k in edges[node]))
        ):
            (plan.once if run_once and runs_once(node) else plan.intermediates).append(node)
    plan.direct = [i for i, r in enumerate(roots) if r not in executed and r in g.leads_w]
    plan.weight_leaves = [n for n in g.leaves if n in side]
    for node in plan.deferred:
        plan.weight_routes[g.records[node]] = Route(needed=(False,) * len(edges[node]))
    for node in plan.intermediates:
        if node in g.routed:
            plan.weight_routes[g.routed[node]] = Route(
                needed=tuple(k is not None and k in side for k in edges[node])
            )
    plan.weight_calls = _weight_calls(plan, roots, g.order, edges, g.split, g.records)


def _weight_calls(
    plan: InputPassPlan,
    roots: Sequence[Node],
    order: list[Node],
    edges: dict[Node, list[Any]],
    split: dict[Node, tuple[list[Node], list[Node]]],
    records: dict[Node, NodeRecord],
) -> list[WeightCall]:
    """Group W's work into as few engine calls as possible (see :class:`WeightCall`)."""
    if not plan.intermediates:  # nothing computes input gradients in W: one call
        deferred = [records[n] for n in plan.deferred]
        return [
            WeightCall(
                deferred=deferred, once=plan.once, direct=plan.direct, leaves=plan.weight_leaves
            )
        ]
    side = plan.weight_side
    # Units of work, each with the weight-side nodes it sends gradients to.
    starts: list[list[Node]] = [[k for k in edges[n] if k in side] for n in plan.intermediates]
    starts += [split[n][1] for n in plan.deferred]
    starts += [[k for k in edges[n] if k in side] for n in plan.once]
    for u, n in enumerate(plan.once, len(plan.intermediates) + len(plan.deferred)):
        for region in plan.into_regions.get(n, {}).values():  # with the region's weight work
            starts[u] += [k for k in edges[region] if k in side]
    starts += [[roots[i]] for i in plan.direct]
    group, owner, n_groups = _groups(starts, edges)
    units = [*plan.intermediates, *plan.deferred, *plan.once]
    n_int = len(plan.intermediates)
    reaches, below_units = _below(plan.executed, order, edges, units, group)
    under = [0] * n_groups  # per group: the groups below its intermediates
    for u in range(n_int):
        under[group[u]] |= reaches[u]
    sets = _joined(under, group, reaches, below_units, units, n_int)
    calls, masks, call_of = _first_fit(sets, under)
    for u, node in enumerate(plan.intermediates):
        call = calls[call_of[group[u]]]
        if not reaches[u] & masks[call_of[group[u]]][0]:
            call.intermediates.append(node)
        elif is_native(node) or node in records:
            call.asked.append(node)
        else:
            call.intermediates.append(node)
            call.clamp.append(node)
    for u, node in enumerate(plan.deferred, n_int):
        calls[call_of[group[u]]].deferred.append(records[node])
    for u, node in enumerate(plan.once, n_int + len(plan.deferred)):
        calls[call_of[group[u]]].once.append(node)
    for u, i in enumerate(plan.direct, len(units)):
        calls[call_of[group[u]]].direct.append(i)
    for leaf in plan.weight_leaves:
        unit = owner.get(leaf)
        if unit is not None:
            calls[call_of[group[unit]]].leaves.append(leaf)
    return calls


def _groups(
    starts: list[list[Node]], edges: dict[Node, list[Any]]
) -> tuple[list[int], dict[Node, int], int]:
    """Units whose weight sides meet go together (union-find over the weight-side nodes):
    each unit's group, the unit that first reached each weight-side node, and the count."""
    parent = list(range(len(starts)))

    def find(u: int) -> int:
        while parent[u] != u:
            parent[u] = u = parent[parent[u]]
        return u

    owner: dict[Node, int] = {}
    for u, first in enumerate(starts):
        stack = list(first)
        while stack:
            node = stack.pop()
            other = owner.get(node)
            if other is not None:
                parent[find(other)] = find(u)
                continue
            owner[node] = u
            stack.extend(k for k in edges[node] if k is not None)
    group_ids: dict[int, int] = {}
    group = [group_ids.setdefault(find(u), len(group_ids)) for u in range(len(starts))]
    return group, owner, len(group_ids)


def _below(
    executed: set[Node],
    order: list[Node],
    edges: dict[Node, list[Any]],
    units: list[Node],
    group: list[int],
) -> tuple[list[int], dict[Node, int]]:
    """For each unit, the groups (as bits) below it, through nodes I ran; for each node I ran,
    the units below it. A unit's children that I ran are those of its input edges."""
    group_bit = {node: 1 << group[u] for u, node in enumerate(units)}
    unit_bit = {node: 1 << u for u, node in enumerate(units)}
    below: dict[Node, int] = {}
    below_units: dict[Node, int] = {}
    for node in order:
        if node in executed:
            groups = found = 0
            for k in edges[node]:
                if k is not None and k in executed:
                    groups |= below[k] | group_bit.get(k, 0)
                    found |= below_units[k] | unit_bit.get(k, 0)
            below[node] = groups
            below_units[node] = found
    return [below[node] for node in units], below_units


def _joined(
    under: list[int],
    group: list[int],
    reaches: list[int],
    below_units: dict[Node, int],
    units: list[Node],
    n_int: int,
) -> list[int]:
    """The sets of groups (as bits) that must share a call. A group below its own
    intermediates (a weight shared with a layer before them): its call runs the nodes in
    between, so the groups of the units in between join it, and have their input edges'
    gradients dropped too (each such unit then runs once, from what I recorded)."""
    joined = list(range(len(under)))
    for g, low in enumerate(under):
        if not low >> g & 1 or joined[g] != g:
            continue
        mask = 1 << g
        while True:
            between = 0
            for u in range(n_int):
                if mask >> group[u] & 1 and reaches[u] & mask:
                    between |= below_units[units[u]]
            more = mask
            for u in _bits(between):
                if reaches[u] & mask:
                    more |= 1 << group[u]
            if more == mask:
                break
            mask = more
        for h in _bits(mask):
            old = joined[h]
            joined = [g if r == old else r for r in joined]
    sets: dict[int, int] = {}
    for h, r in enumerate(joined):
        sets[r] = sets.get(r, 0) | 1 << h
    return list(sets.values())


def _first_fit(
    sets: list[int], under: list[int]
) -> tuple[list[WeightCall], list[tuple[int, int]], list[int]]:
    """First fit: a set of groups joins a call when neither lies below the other's
    intermediates. The nodes in between a set's groups that belong to other calls run there
    with no gradient (computing nothing) and again in their own call, which is why every call
    but the last keeps the graph. ``(calls, per call its groups and what lies below them, the
    call of each group)``."""
    calls: list[WeightCall] = []
    masks: list[tuple[int, int]] = []
    call_of = [0] * len(under)
    for mine in sets:
        low = 0
        for h in _bits(mine):
            low |= under[h]
        for c, (have, have_low) in enumerate(masks):
            if not (low & have or have_low & mine):
                masks[c] = (have | mine, have_low | low)
                break
        else:
            c = len(calls)
            masks.append((mine, low))
            calls.append(WeightCall())
        for h in _bits(mine):
            call_of[h] = c
    return calls, masks, call_of
