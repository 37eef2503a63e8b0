"""A compiled region's backward, cut into an input pass (I) and a weight pass (W).

``torch.compile`` turns a region into one autograd node whose backward is one compiled graph:
under a split schedule it would run whole in I and again in W, and with torch's default
configuration it refuses to run twice at all (donated buffers). Here the backward graph is a
split program (:class:`customgrad._split_program.SplitProgram`, as a traced single backward
is; its slots are the region's inputs) whose full graph and cuts :class:`SplitCompiler`
compiles with the backend's own compiler. What W can rebuild from the backward's inputs without
FLOPs it recomputes rather than keep.

Which gradients I computes follows the pass, by customgrad nodes' rule: the node's route
(:mod:`customgrad._routing`), else the engine's answer per edge; W computes the rest. Each such
pattern is cut once, when first met; the one torch's split counts (parameters, and inputs made
from parameters only: a cast, a transposed tied weight) is cut ahead. Blocks of one class share
one compiled graph whose inputs may hold an activation in one block and a parameter-made tensor
in another: each call gets its own cut.

The kept values (:class:`customgrad._handoff.Kept`) live on the node's :class:`RegionNode` (the
one hand-off store) until W takes them, by the one ownership rule: only a pass with the output
gradients the engine gave the node in I reads them (AOTAutograd's own copies of them are new in
each pass).

What cannot split keeps the full backward, with one log line saying why: CUDA graphs
(``mode="reduce-overhead"``), compiled autograd, tensor-subclass or mutated inputs that require
grad, gradients that do not line up with the node's edges.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.autograd.graph import Node

from customgrad._compiled_region import (
    ATTR,
    LOCK,
    CompiledRegion,
    GraphInfo,
    RegionNode,
    region_node,
)
from customgrad._handoff import Guard, Kept, guard, nbytes
from customgrad._origin import origin_of
from customgrad._releases import refuse_torch_split
from customgrad._routing import route_for
from customgrad._runtime import Ran, needed_edges, run_program
from customgrad._split_program import Pass, ProgramCut, SplitProgram
from customgrad._switches import split_enabled
from customgrad._torch.aot import is_tangent, tangent_outputs, tracing_metadata
from customgrad._torch.dynamo import compiled_autograd_on
from customgrad._torch.engine import current_node, graph_kept
from customgrad._torch.functions import is_aot_node

__all__ = [
    "SplitCompiler",
    "attach",
    "no_donated_buffers",
    "region_node",
    "region_of",
    "watching",
]


def attach(node: Node, region: CompiledRegion) -> RegionNode:
    """The :class:`RegionNode` of a compiled region's autograd node, made (and registered as the
    node's pre-hook) when the node has none yet."""
    found = region_node(node)
    if found is not None:
        return found
    found = RegionNode(region)
    setattr(node, ATTR, found)
    node.register_prehook(found)
    with LOCK:
        region.nodes.add(found)
    return found


def region_of(node: object) -> CompiledRegion | None:
    r"""The compiled region whose backward ``node`` runs (a ``CompiledFunctionBackward`` of a
    :func:`customgrad.compile`\ d module), else None."""
    found = region_node(node)
    return None if found is None else found.region


def _pass_grads(state: RegionNode, tangents: list[Any]) -> Sequence[Any]:
    """The output gradients of the running pass, for the ownership rule: the ones the engine
    passed to the node, as its :class:`RegionNode` recorded them, where each of AOTAutograd's
    ``tangents`` is one of them or a copy AOTAutograd makes (into other strides, zeros for a
    missing one; a later pre-hook could have replaced them); else ``tangents`` (new in each
    pass: such a weight pass computes for itself, logged)."""
    seen, state.grads = state.grads, None
    if seen is None:
        return tangents
    grads = [g if isinstance(g, torch.Tensor) else None for g in seen]
    ids = {id(g) for g in grads if g is not None}
    unmatched = [g for g in grads if g is None or id(g) not in {id(t) for t in tangents}]
    for t in tangents:
        if not isinstance(t, torch.Tensor) or id(t) in ids:
            continue
        # AOTAutograd copies a gradient only into other strides (the traced ones, which the copy
        # has), and makes zeros for a missing one
        k = next(
            (
                k
                for k, g in enumerate(unmatched)
                if g is None or (g.shape == t.shape and g.stride() != t.stride())
            ),
            None,
        )
        if k is None:
            return tangents  # a tangent that is no recorded gradient nor a copy of one
        del unmatched[k]
    return grads


_WALK = 4


def _watch(region: CompiledRegion, outputs: Any, earlier: Sequence[Any]) -> None:
    """Give the autograd node a compiled forward just made its :class:`RegionNode` (reached from
    its outputs within a few view nodes; not an input's, ``earlier``, which an output that is an
    input, or a view of one, leads to)."""
    outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    for o in outs:
        fn = o.grad_fn if isinstance(o, torch.Tensor) else None
        for _ in range(_WALK):
            if fn is None or any(fn is e for e in earlier):
                break
            if is_aot_node(fn):
                attach(fn, region)
                break
            nexts = fn.next_functions
            fn = nexts[0][0] if nexts else None


def watching(region: CompiledRegion, compiled: Callable[..., object]) -> Callable[..., object]:
    """``compiled`` (the callable dynamo runs for a graph) with its node watched per call."""

    @functools.wraps(compiled)
    def run(*args: object) -> object:
        if not torch.is_grad_enabled():
            return compiled(*args)
        if compiled_autograd_on() and region.status == "split":
            region.fall_back(
                "compiled autograd runs its backward graph itself (whole, in each pass), "
                "not customgrad's split"
            )
        flat = args[0] if len(args) == 1 and isinstance(args[0], list) else args  # boxed
        earlier = [a.grad_fn for a in flat if isinstance(a, torch.Tensor) and a.grad_fn is not None]
        out = compiled(*args)
        _watch(region, out, earlier)
        return out

    return run


class _Backward:
    """The compiled backward AOTAutograd calls (boxed): an adapter of the node's pass to the
    runtime (:func:`customgrad._runtime.run_program`), which runs the full graph, a cut's input
    pass (keeping its values on the node's :class:`RegionNode`) or its weight pass.

    A region that cannot split (no program: CUDA graphs, compiled autograd, ...) runs the full
    graph in every pass.
    """

    def __init__(
        self,
        region: CompiledRegion,
        full: Callable[[list[object]], object],
        positions: list[int],
        n_outputs: int,
        program: SplitProgram | None = None,
        tangents: Sequence[int] = (),
    ) -> None:
        self._boxed_call = True  # in the instance's __dict__: wrappers (functools.wraps) keep it
        self.region = region
        self.full = full
        self.positions = positions  # the slot (region input) of each of the node's edges
        self.n_outputs = n_outputs
        self.program = program
        self.tangents = list(tangents)
        graph = None if program is None else program.graph_module
        self._placeholders = [] if graph is None else list(graph.graph.find_nodes(op="placeholder"))
        if program is not None:  # the runtime's full pass: AOTAutograd's own compiled graph
            assert graph is not None
            program.whole_pass = Pass(full, tuple(range(n_outputs)), 0, graph)  # type: ignore[arg-type]

    def __call__(self, args: list[object]) -> object:
        region = self.region
        node = current_node()
        state = self._state(node)
        if state is None:
            with LOCK:
                region.runs["full"] += 1
            return self.full(args)
        assert self.program is not None
        grads = _pass_grads(state, [args[i] for i in self.tangents if i < len(args)])
        route = None if state.route is None else route_for(state)
        need = needed_edges(node, None if route is None else route.needed, None)
        requires: set[int] = set()
        needed: set[int] = set()
        for e, ((fn, _), slot) in enumerate(zip(node.next_functions, self.positions)):
            if fn is not None:
                requires.add(slot)
                if need is None or need[e]:
                    needed.add(slot)
        if route is None and needed != requires:
            refuse_torch_split(f"customgrad.compile region {region.name}")  # torch 2.11, 2.12
        keep = graph_kept()  # a later pass can come through this node
        saved = self._saved(args) if keep and needed != requires else []  # before args empty
        ran = run_program(
            state,
            self.program,
            grads,
            args,
            frozenset(needed),
            frozenset(requires),
            keep,
            lambda kept: self._guard(saved, kept),
            self._repeat,
        )
        if not keep:
            state.handoff = None  # no pass comes through the node after this one
        return self._outputs(ran)

    def _state(self, node: Any) -> RegionNode | None:
        """The node's :class:`RegionNode`, or None where the pass runs the full graph (the
        region does not split, or this call cannot: the fallback logged)."""
        if self.program is None or not split_enabled():
            return None
        if node is None:
            self.region.fall_back(
                "no autograd node is running its backward (compiled autograd traces it whole)"
            )
            return None
        edges = node.next_functions
        if len(edges) != len(self.positions):
            self.region.fall_back(
                f"its node has {len(edges)} edges for {len(self.positions)} tensor inputs"
            )
            return None
        return attach(node, self.region)

    def _outputs(self, ran: Ran) -> list[Any]:
        """The backward's outputs (one per region input) from what the runtime ran."""
        region = self.region
        out: list[Any] = [None] * self.n_outputs
        if ran.p is not None:
            for j, g in zip(ran.p.slots, ran.outputs):
                out[j] = g
        if ran.mode is not None:
            with LOCK:
                region.runs[ran.mode] += 1
        if ran.cut is not None and region.input_pass is None:
            _describe(region, ran.cut)
        if ran.kept is not None:
            region.handoff_bytes = nbytes(ran.kept.values)
        program = self.program
        if program is not None and program.failed and not region.repeated:
            why = next(iter(program.failed.values()))
            region.note_repeat(
                f"the backend could not compile its cut for this pattern of gradients ({why})"
            )
        return out

    def _repeat(self) -> None:
        self.region.note_repeat(
            "a pass needing only the gradients its input pass left for later came with "
            "other output gradients than that input pass (another loss, or gradients "
            "replaced by a hook), so it computes them from its own"
        )

    def _saved(self, args: list[Any]) -> list[tuple[int, torch.Tensor]]:
        """The saved tensors among the backward's ``args``, with their positions (detached: a
        saved output's tensor leads back to this node, which would hold it in a cycle)."""
        tangents = set(self.tangents)
        return [
            (i, a.detach())
            for i, a in enumerate(args)
            if i not in tangents and isinstance(a, torch.Tensor)
        ]

    def _guard(self, saved: list[tuple[int, torch.Tensor]], kept: Kept) -> Guard:
        """The versions of what W reads besides the output gradients: the saved tensors of
        the region's backward and the values its input pass kept."""
        at = [i for i, _ in saved]
        placeholders = self._placeholders
        names = self.region.input_names
        cut = kept.cut

        def describe(i: int) -> tuple[str, str]:
            if i < len(at):
                node = placeholders[at[i]] if at[i] < len(placeholders) else None
                what = "a saved tensor" if node is None else f"saved tensor {node.name!r}"
                primal = None if node is None else re.fullmatch(r"primals_(\d+)", node.name)
                if primal and int(primal[1]) <= len(names):  # an input of the region, as it is
                    what = f"the region's input {names[int(primal[1]) - 1]!r}"
            else:
                node = cut.kept[i - len(at)]
                what = f"value {node.name!r} the input pass kept"
            origin = None if node is None else origin_of(node)
            if origin is None or not origin.source:
                return what, "made by the region's forward"
            return f"{what} ({origin.where})", f"made at {origin.source}"

        return guard((), None, describe, [*(t for _, t in saved), *kept.values], describe)


def _describe(region: CompiledRegion, cut: ProgramCut) -> None:
    """What explain_split and the summary say of the region: the cut it runs first."""
    names = region.input_names
    region.input_pass = GraphInfo(
        tuple(names[j] for j in cut.input_pass.slots), cut.input_pass.n_ops
    )
    region.weight_pass = GraphInfo(
        tuple(names[j] for j in cut.weight_pass.slots), cut.weight_pass.n_ops
    )
    region.handoff = tuple(h.name for h in cut.kept)
    region.recomputed = tuple(n.name for n in cut.recomputed)
    region.kept = tuple(origin_of(h) for h in cut.kept)
    region.recomputed_origins = tuple(origin_of(n) for n in cut.recomputed)


class SplitCompiler:
    """Wraps a backend's backward compiler: compiles full, and each cut's I and W, with it.
    ``names``: the region's inputs, for reports."""

    def __init__(
        self,
        region: CompiledRegion,
        kinds: list[bool | None],
        compile_one: Callable[..., object],
        reason: str | None,
        names: Sequence[str] = (),
    ) -> None:
        if len(names) != len(kinds):
            names = [f"{'weight' if k else 'input'} {j}" for j, k in enumerate(kinds)]
        region.input_names = tuple(names)
        self.region = region
        self.kinds = kinds
        self.compile_one = compile_one
        self.reason = reason

    def __call__(
        self, gm: fx.GraphModule, example_inputs: Sequence[object], **kwargs: object
    ) -> Callable[[list[object]], object]:
        region = self.region
        reason = self.reason
        no_donated_buffers()
        if reason is None:
            cudagraphs = kwargs.get("cudagraphs")
            if cudagraphs is not None and bool(getattr(cudagraphs, "value", cudagraphs)):
                reason = 'CUDA graphs (mode="reduce-overhead") replay one recorded backward'
            elif _mutated_grad_input():
                reason = "it mutates an input that requires grad, or threads effect/RNG state"
        outs = list(gm.graph.output_node().args[0])  # type: ignore[arg-type]
        positions = [j for j, k in enumerate(self.kinds) if k is not None]
        if reason is None and len(outs) != len(self.kinds):
            reason = (
                f"its backward has {len(outs)} outputs for {len(self.kinds)} inputs (AOTAutograd "
                "deduplicated or regrouped them)"
            )
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        tangents = [i for i, n in enumerate(placeholders) if is_tangent(n)]
        region.edge_slots = tuple(positions)
        region.reaches = _reaches(placeholders, tangents, outs)
        full = _boxed(self.compile_one(gm, list(example_inputs), **kwargs))
        program = None
        if reason is None:
            live = [j for j in positions if isinstance(outs[j], fx.Node)]

            def compiler(g: fx.GraphModule, examples: list[Any]) -> Callable[..., Any]:
                return _boxed(self.compile_one(g, examples, **kwargs))

            program = SplitProgram(gm, live, "from_inputs", compiler, example_inputs, boxed=True)
            if program.mutated:
                reason = "its backward graph mutates a tensor in place"
                program = None
        if program is None:
            assert reason is not None
            region.fall_back(reason)
            return _Backward(region, full, positions, len(self.kinds))
        # The cuts compiled ahead: weights by their history, then parameters only.
        first = frozenset(j for j in program.live if _weights_by_history(self.kinds)[j])
        _describe(region, program.cut(first))
        params = frozenset(j for j in program.live if self.kinds[j])
        if params != first:
            program.cut(params)
        return _Backward(region, full, positions, len(self.kinds), program, tangents)


def _reaches(
    placeholders: list[fx.Node], tangents: list[int], outs: list[Any]
) -> dict[int, frozenset[int]]:
    """:attr:`CompiledRegion.reaches`: per output gradient of the backward graph (by the output
    of the node it is for), the slots whose gradient the graph computes from it."""
    at = tangent_outputs(tracing_metadata())
    if at is None or len(at) != len(tangents):
        return {}
    slots_of: dict[fx.Node, list[int]] = {}
    for j, out in enumerate(outs):
        if isinstance(out, fx.Node):
            slots_of.setdefault(out, []).append(j)
    found: dict[int, frozenset[int]] = {}
    for nr, i in zip(at, tangents):
        seen: set[fx.Node] = set()
        slots: set[int] = set()
        stack = [placeholders[i]]
        while stack:
            node = stack.pop()
            if node not in seen:
                seen.add(node)
                slots.update(slots_of.get(node, ()))
                stack.extend(node.users)
        found[nr] = frozenset(slots)
    return found


def no_donated_buffers() -> None:
    """Record "no donated buffers" where AOTAutograd's backward checks it.

    With ``donated_buffer=False`` while compiling, AOTAutograd leaves ``bw_donated_idxs`` at
    None, and its backward (which reads the global flag, True by default) takes None for "some"
    when the graph is retained (``retain_graph=True``, as the input pass does) after a first
    backward that was not. The metadata it checks is the tracing context's, except with
    tensor-subclass inputs (an outer one, out of reach: there a full backward before the first
    split one still meets torch's donated-buffer error).
    """
    meta = tracing_metadata()
    if meta is not None and meta.bw_donated_idxs is None:
        meta.bw_donated_idxs = []


def _mutated_grad_input() -> bool:
    meta = tracing_metadata()
    if meta is None:
        return False
    return any(
        (info.mutates_data or info.mutates_metadata) and info.requires_grad
        for info in meta.input_info
    ) or bool(meta.tokens or meta.num_outputs_rng_offset)


_HISTORY_NODES = 64


def _weights_by_history(kinds: list[bool | None]) -> list[bool | None]:
    """``kinds`` with the tensor inputs made from parameters only counted as weights.

    A weight can reach a region as a plain tensor made from a parameter outside it (cast to
    another dtype, transposed for a tied head, normalized): its gradient goes to parameters
    only, so torch's split computes it in W. Told from the autograd history of the node whose
    backward is being compiled (AOTAutograd compiles it lazily, inside the first backward):
    an edge whose history reaches only ``nn.Parameter`` leaves, within a few nodes, is a
    weight. This only picks the cut compiled ahead; a call whose pass needs another pattern
    (the same graph serving a block where that input is an activation) gets its own.
    """
    node = current_node()
    if node is None:
        return kinds
    edges = node.next_functions
    tensor_positions = [j for j, k in enumerate(kinds) if k is not None]
    if len(edges) != len(tensor_positions):
        return kinds
    out = list(kinds)
    for j, (fn, _) in zip(tensor_positions, edges):
        if out[j] is False and fn is not None and _only_parameters_behind(fn):
            out[j] = True
    return out


def _only_parameters_behind(root: Any) -> bool:
    seen: set[Any] = set()
    stack = [root]
    leaves = 0
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        if len(seen) > _HISTORY_NODES:
            return False
        variable = getattr(fn, "variable", None)
        if variable is not None:  # AccumulateGrad: a leaf
            if not isinstance(variable, nn.Parameter):
                return False
            leaves += 1
            continue
        stack.extend(f for f, _ in fn.next_functions if f is not None)
    return leaves > 0


def _boxed(fn: Any) -> Callable[[list[Any]], Any]:
    if getattr(fn, "_boxed_call", False):
        return fn  # type: ignore[no-any-return]

    def call(args: list[Any]) -> Any:
        values = list(args)
        args.clear()
        return fn(*values)

    return call
