"""Compiled regions whose backward splits into an input pass (I) and a weight pass (W).

``torch.compile`` turns a region into one autograd node whose backward is one compiled graph:
under a split schedule that graph would run whole in I and again in W (twice the work), and
with torch's default configuration it refuses to run twice at all (donated buffers). Here the
backward graph AOTAutograd hands the backend is cut in three, each compiled by the backend's own
compiler:

- **full**: the graph as it is, for a backward that needs every gradient (``loss.backward()``);
- **I**: the input gradients, plus the values W needs from them (the *hand-off*);
- **W**: the weight gradients, from the saved values, the output gradients and the hand-off.

Weights are the region's parameters, and the inputs made from parameters only outside it (a
cast, a transposed tied weight), as torch's split counts them; when there are such inputs a
second I/W pair, with parameters only as weights, serves calls where they are activations.

What W can recompute without FLOPs (views, elementwise ops of saved values) is recomputed in W
rather than kept. At run time the node asks the autograd engine which of its edges the running
pass uses (as customgrad ops do, :func:`customgrad._autograd.engine_needs`) and runs full, I or
W. The hand-off is keyed by the node (one per microbatch), kept in a weak map so it goes with
the graph if W never runs, and dropped by W.

What cannot split keeps the full backward, with one log line saying why: CUDA graphs
(``mode="reduce-overhead"``), compiled autograd, tensor-subclass or mutated inputs that require
grad, gradients that do not line up with the node's edges.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import fx, nn
from torch.utils.weak import WeakIdKeyDictionary

from customgrad._autograd import engine_needs
from customgrad._errors import ArgumentTypeError, ArgumentValueError
from customgrad._origin import ValueOrigin, origin_of
from customgrad._origin import summary as origin_summary
from customgrad._switches import split_enabled

__all__ = ["CompiledRegion", "GraphInfo", "compile", "region_of", "regions"]

log = logging.getLogger("customgrad")

_M = TypeVar("_M")

SUPPORTED_BACKENDS = ("inductor", "aot_eager")

MSG_NOT_CALLABLE = """\
customgrad.compile: expected an nn.Module or a callable to compile, got {got}. Pass the block \
(or the whole stage) itself:

    customgrad.compile(block)                      # compiles in place, returns block
    for block in model.layers: customgrad.compile(block)
"""

MSG_BACKEND = """\
customgrad.compile: backend {got} does not go through AOTAutograd, so its backward cannot be \
split into an input and a weight pass. Supported: "inductor" (the default), "aot_eager" (for \
debugging), or an AOTAutograd backend made with torch._dynamo.backends.common.aot_autograd(...):

    customgrad.compile(block)                        # inductor
    customgrad.compile(block, backend="aot_eager")   # debugging
"""

MSG_MODE = """\
customgrad.compile: mode={mode!r} and options={options!r} are inductor's settings; backend \
{got} takes neither. Drop them, or compile with inductor:

    customgrad.compile(block, mode="max-autotune")   # backend="inductor", the default
"""

MSG_TWICE = """\
customgrad.compile: {got} is already compiled ({how}). Compile it once, with \
customgrad.compile only, on the module itself (not torch.compile's OptimizedModule):

    customgrad.compile(block)          # instead of block.compile() / torch.compile(block)
"""

# aten ops W may recompute rather than keep: no FLOPs, nothing random, no mutation.
_VIEWS = {
    "alias", "as_strided", "detach", "expand", "permute", "reshape", "select", "slice",
    "squeeze", "t", "transpose", "unsqueeze", "view", "_unsafe_view", "_reshape_alias",
}  # fmt: skip
_RECOMPUTE_DEPTH = 8


# --------------------------------------------------------------------------------------------
# What explain_split and the summary read


@dataclass
class GraphInfo:
    """One piece of a split backward: which gradients it computes and what it keeps for W."""

    computes: tuple[str, ...]
    """The gradients the graph outputs, by the region's input names."""
    nodes: int
    """Number of operations in the graph."""


@dataclass(eq=False)
class CompiledRegion:
    """One compiled backward customgrad has seen: split (I and W graphs) or fallen back (why)."""

    name: str
    """A readable label: the compiled module's class and the graph's number."""
    status: str = "split"
    """``"split"``, or ``"fallback"`` (the full backward runs in each pass that reaches it)."""
    reason: str | None = None
    """Why the region fell back, or None."""
    input_pass: GraphInfo | None = None
    """The graph run in I (input gradients and the hand-off)."""
    weight_pass: GraphInfo | None = None
    """The graph run in W (weight gradients)."""
    handoff: tuple[str, ...] = ()
    """The values I keeps for W (one set per microbatch between its I and its W), by FX name."""
    recomputed: tuple[str, ...] = ()
    """The values W recomputes (no FLOPs) rather than keeping them from I, by FX name."""
    kept: tuple[ValueOrigin, ...] = ()
    """:attr:`handoff` with where the user's code made each value (module, source line)."""
    recomputed_origins: tuple[ValueOrigin, ...] = ()
    """:attr:`recomputed` with where the user's code made each value."""
    handoff_bytes: int = 0
    """Bytes the last I pass kept for W."""
    runs: dict[str, int] = field(default_factory=lambda: {"full": 0, "input": 0, "weight": 0})
    """How many times each graph ran."""
    _pending: weakref.WeakKeyDictionary[Any, _HandOff] = field(
        default_factory=weakref.WeakKeyDictionary, repr=False
    )
    _logged: bool = field(default=False, repr=False)

    def pending(self) -> int:
        """Number of microbatches whose I ran and whose W has not yet (hand-offs held)."""
        with _LOCK:
            return len(self._pending)

    def fall_back(self, reason: str) -> None:
        """Mark the region as running its full backward, logging why once."""
        with _LOCK:
            self.status = "fallback"
            self.reason = reason
            first = not self._logged
            self._logged = True
        if first:
            log.warning(
                "customgrad.compile: compiled region %s runs its full backward in each pass "
                "(no input/weight split): %s",
                self.name,
                reason,
            )

    def describe(self) -> str:
        """One line: what runs in I and in W and what is kept, or why it fell back."""
        if self.status == "fallback":
            return f"fell back to its full backward in each pass: {self.reason}"
        if self.input_pass is None or self.weight_pass is None:
            return "split, not compiled yet (its backward has not run)"
        kept = "nothing"
        if self.kept:
            kept = f"{len(self.kept)} value{'s' if len(self.kept) > 1 else ''}"
        text = (
            f"split: I runs a graph of {self.input_pass.nodes} ops for "
            f"{', '.join(self.input_pass.computes) or 'no input'}; W runs a graph of "
            f"{self.weight_pass.nodes} ops for {', '.join(self.weight_pass.computes) or 'no weight'}; "
            f"I keeps {kept} for W ({self.handoff_bytes} bytes per microbatch)"
        )
        if self.kept:
            text += f": {origin_summary(self.kept)}"
        recomputed = self.recomputed_origins
        if recomputed:
            n = len(recomputed)
            text += (
                f"; W recomputes {n} value{'s' if n > 1 else ''} ({origin_summary(recomputed)}; "
                "no FLOPs)"
            )
        return text


_LOCK = threading.Lock()
_REGIONS: list[weakref.ref[CompiledRegion]] = []


def _register(region: CompiledRegion) -> None:
    with _LOCK:
        _REGIONS[:] = [r for r in _REGIONS if r() is not None]
        _REGIONS.append(weakref.ref(region))


def regions() -> list[CompiledRegion]:
    """Every compiled backward still alive that a :func:`compile`\\ d module produced."""
    with _LOCK:
        live = [r() for r in _REGIONS]
    return [r for r in live if r is not None]


def region_of(node: Any) -> CompiledRegion | None:
    r"""The compiled region whose backward ``node`` runs (a ``CompiledFunctionBackward`` of a
    :func:`compile`\ d module, once its backward was compiled), else None."""
    cls = getattr(node, "_forward_cls", None)
    fn = getattr(cls, "compiled_bw", None)
    for _ in range(8):  # through wrappers (torch._dynamo.disable keeps __wrapped__)
        if fn is None or isinstance(fn, _Backward):
            break
        fn = getattr(fn, "__wrapped__", None)
    return fn.region if isinstance(fn, _Backward) else None


# --------------------------------------------------------------------------------------------
# Cutting the backward graph


@dataclass
class _Plan:
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
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return None


def _free(node: fx.Node) -> bool:
    """Whether ``node`` costs no FLOPs: a view or an elementwise op, nothing random or in place."""
    if node.op in ("placeholder", "get_attr"):
        return True
    if node.op != "call_function":
        return False
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
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
    return isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable


def _plan(gm: fx.GraphModule, is_weight: Sequence[bool | None]) -> _Plan | str:
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
    return _Plan(input_gm, weight_gm, ipos, wpos, hand, recomputed, tangents)


def _example(node: fx.Node) -> Any:
    return node.meta.get("val")


# --------------------------------------------------------------------------------------------
# Running it


@dataclass
class _Cut:
    """One way to cut the backward: its compiled I and W graphs, and which edges are weights."""

    input_fn: Callable[[list[Any]], Any]
    weight_fn: Callable[[list[Any]], Any]
    plan: _Plan
    edge_weight: list[bool | None]
    """One entry per edge of the node (the region's tensor inputs): weight, input, or None."""

    def kinds_needed(self, needed: Sequence[bool]) -> tuple[bool, bool]:
        """(an input's gradient needed, a weight's gradient needed) for the engine's needs."""
        need_input = need_weight = False
        for need, weight in zip(needed, self.edge_weight):
            if need and weight is not None:
                need_weight |= weight
                need_input |= not weight
        return need_input, need_weight


class _HandOff:
    """What an input pass kept for the weight pass of the same node, and the output
    gradients) it was made with: a pass with other output gradients (another loss through the
    same graph) never reads it."""

    __slots__ = ("cut", "kept", "tangents")

    def __init__(
        self, cut: _Cut, tangents: list[tuple[int, weakref.ref[Any]]], kept: list[Any]
    ) -> None:
        self.cut = cut  # the I/W pair whose input graph made it
        self.tangents = tangents
        self.kept = kept

    def made_with(self, args: Sequence[Any]) -> bool:
        return all(i < len(args) and ref() is args[i] for i, ref in self.tangents)


class _Backward:
    """The compiled backward AOTAutograd calls (boxed): full, I or W, picked per call.

    ``cuts`` holds one cut, or two when a region input was told a weight by its history
    (:func:`_weights_by_history`): the same compiled graph may serve a call where that input
    is an activation, which the second cut (parameters only are weights) splits.
    """

    def __init__(
        self,
        region: CompiledRegion,
        full: Callable[[list[Any]], Any],
        n_outputs: int,
        cuts: Sequence[_Cut],
        late_cut: Callable[[], _Cut | None] | None = None,
    ) -> None:
        self._boxed_call = True  # in the instance's __dict__: wrappers (functools.wraps) keep it
        self.region = region
        self.full = full
        self.n_outputs = n_outputs
        self.cuts = list(cuts)
        # compiled outside a backward (dynamic shapes): the cut by the first node's history,
        # made at its first backward
        self.late_cut = late_cut

    def __call__(self, args: list[Any]) -> Any:
        region = self.region
        mode, cut = self._mode(args)
        node = torch._C._current_autograd_node()
        if cut is None:
            with _LOCK:
                region.runs["full"] += 1
                if node is not None:
                    region._pending.pop(node, None)
            return self.full(args)
        plan = cut.plan
        grads: list[Any] = [None] * self.n_outputs
        if mode == "input":
            made_with = [(i, weakref.ref(args[i])) for i in plan.tangents]  # before args clear
            out = list(cut.input_fn(args))
            n = len(plan.input_positions)
            for j, g in zip(plan.input_positions, out[:n]):
                grads[j] = g
            kept = out[n:]
            size = sum(t.untyped_storage().nbytes() for t in kept if isinstance(t, torch.Tensor))
            with _LOCK:
                region._pending[node] = _HandOff(cut, made_with, kept)
                region.handoff_bytes = size
                region.runs["input"] += 1
            return grads
        with _LOCK:
            handoff = region._pending.pop(node, None)
            region.runs["weight"] += 1
        if handoff is not None:
            args.extend(handoff.kept)
            del handoff
        for j, g in zip(plan.weight_positions, cut.weight_fn(args)):
            grads[j] = g
        return grads

    def _mode(self, args: Sequence[Any]) -> tuple[str, _Cut | None]:
        """``("input", cut)``, ``("weight", cut)`` or ``("full", None)`` for the running pass."""
        if not self.cuts or not split_enabled():
            return "full", None
        region = self.region
        node = torch._C._current_autograd_node()
        if node is None:
            region.fall_back(
                "no autograd node is running its backward (compiled autograd traces it whole)"
            )
            return "full", None
        edges = node.next_functions
        if len(edges) != len(self.cuts[0].edge_weight):
            region.fall_back(
                f"its node has {len(edges)} edges for {len(self.cuts[0].edge_weight)} tensor inputs"
            )
            return "full", None
        needed = [fn is not None and engine_needs(fn) for fn, _ in edges]
        with _LOCK:
            handoff = region._pending.get(node)
        if handoff is not None and handoff.made_with(args):
            # this microbatch's I ran: W with the same cut, if the pass needs weights only
            need_input, need_weight = handoff.cut.kinds_needed(needed)
            if need_weight and not need_input:
                return "weight", handoff.cut
        elif handoff is not None:  # another pass's (another loss's output gradients)
            with _LOCK:
                region._pending.pop(node, None)
        with _LOCK:
            late, self.late_cut = self.late_cut, None
        if late is not None:
            cut = late()
            if cut is not None:
                self.cuts.insert(0, cut)
        for cut in self.cuts:
            need_input, need_weight = cut.kinds_needed(needed)
            if need_input and not need_weight:
                return "input", cut
            # without I's hand-off, W runs alone only if it needs none (the first stage's
            # input needs no gradient, a Linear alone); else the full graph
            if need_weight and not need_input and not cut.plan.handoff:
                return "weight", cut
        return "full", None


# --------------------------------------------------------------------------------------------
# The backend


def _kind(x: Any) -> bool | None:
    if not isinstance(x, torch.Tensor):
        return None
    return isinstance(x, nn.Parameter)


def _subclass_input(example_inputs: Sequence[Any]) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return any(
        isinstance(x, torch.Tensor)
        and not isinstance(x, nn.Parameter)
        and (is_traceable_wrapper_subclass(x) or type(x) not in (torch.Tensor,))
        and not _is_fake(x)
        for x in example_inputs
    )


def _is_fake(x: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)


def _no_donated_buffers() -> None:
    """Record "no donated buffers" where AOTAutograd's backward checks it.

    With ``donated_buffer=False`` while compiling, AOTAutograd leaves ``bw_donated_idxs`` at
    None, and its backward (which reads the global flag, True by default) takes None for "some"
    when the graph is retained (``retain_graph=True``, as the input pass does) after a first
    backward that was not. The metadata it checks is the tracing context's, except with
    tensor-subclass inputs (an outer one, out of reach: there a full backward before the first
    split one still meets torch's donated-buffer error).
    """
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None)
    if meta is not None and meta.bw_donated_idxs is None:
        meta.bw_donated_idxs = []


def _mutated_grad_input() -> bool:
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None)
    if meta is None:
        return False
    return any(
        (info.mutates_data or info.mutates_metadata) and info.requires_grad
        for info in meta.input_info
    ) or bool(meta.tokens or meta.num_outputs_rng_offset)


class _SplitCompiler:
    """Wraps a backend's backward compiler: compiles full, I and W with it."""

    def __init__(
        self,
        region: CompiledRegion,
        kinds: list[bool | None],
        compile_one: Callable[..., Any],
        reason: str | None,
    ) -> None:
        self.region = region
        self.kinds = kinds
        self.compile_one = compile_one
        self.reason = reason

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        region = self.region
        reason = self.reason
        _no_donated_buffers()
        if reason is None:
            cudagraphs = kwargs.get("cudagraphs")
            if cudagraphs is not None and bool(getattr(cudagraphs, "value", cudagraphs)):
                reason = 'CUDA graphs (mode="reduce-overhead") replay one recorded backward'
            elif _mutated_grad_input():
                reason = "it mutates an input that requires grad, or threads effect/RNG state"
        by_history = _weights_by_history(self.kinds)
        variants = [by_history] + ([self.kinds] if by_history != self.kinds else [])
        plans: list[_Plan | str] = [
            reason if reason is not None else _plan(gm, kinds) for kinds in variants
        ]
        full = self.compile_one(gm, example_inputs, **kwargs)
        if isinstance(plans[0], str):
            region.fall_back(plans[0])
            return _Backward(region, _boxed(full), len(self.kinds), [])
        cuts = [
            self._cut(plan, kinds, example_inputs, kwargs)
            for plan, kinds in zip(plans, variants)
            if not isinstance(plan, str)
        ]
        self._describe(gm, cuts[0].plan)
        late = None
        if torch._C._current_autograd_node() is None:  # compiled ahead of its first backward

            def late() -> _Cut | None:
                return self._late_cut(gm, example_inputs, kwargs, [c.edge_weight for c in cuts])

        return _Backward(region, _boxed(full), len(self.kinds), cuts, late)

    def _late_cut(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        kwargs: dict[str, Any],
        known: list[list[bool | None]],
    ) -> _Cut | None:
        """The cut by the running node's history, if it differs from the known ones."""
        kinds = _weights_by_history(self.kinds)
        if [k for k in kinds if k is not None] in known:
            return None
        plan = _plan(gm, kinds)
        if isinstance(plan, str):
            return None
        try:
            cut = self._cut(plan, kinds, example_inputs, kwargs)
            self._describe(gm, plan)
            return cut
        except Exception as e:  # the backend could not compile it here: the other cuts serve
            log.warning(
                "customgrad.compile: compiled region %s: could not compile the cut for weights "
                "made outside it (%s: %s); calls with them run the full backward in W",
                self.region.name,
                type(e).__name__,
                e,
            )
            return None

    def _describe(self, gm: fx.GraphModule, plan: _Plan) -> None:
        """What explain_split and the summary say of the region: the cut it runs first."""
        region = self.region
        names = _input_names(gm, self.kinds)
        region.input_pass = GraphInfo(
            tuple(names[j] for j in plan.input_positions), _count(plan.input_gm)
        )
        region.weight_pass = GraphInfo(
            tuple(names[j] for j in plan.weight_positions), _count(plan.weight_gm)
        )
        region.handoff = tuple(h.name for h in plan.handoff)
        region.recomputed = tuple(n.name for n in plan.recomputed)
        region.kept = tuple(origin_of(h) for h in plan.handoff)
        region.recomputed_origins = tuple(origin_of(n) for n in plan.recomputed)

    def _cut(
        self,
        plan: _Plan,
        kinds: list[bool | None],
        example_inputs: Sequence[Any],
        kwargs: dict[str, Any],
    ) -> _Cut:
        input_fn = self.compile_one(plan.input_gm, list(example_inputs), **kwargs)
        weight_examples = [*example_inputs, *(_example(h) for h in plan.handoff)]
        weight_fn = self.compile_one(plan.weight_gm, weight_examples, **kwargs)
        edge_weight: list[bool | None] = [k for k in kinds if k is not None]
        return _Cut(_boxed(input_fn), _boxed(weight_fn), plan, edge_weight)


_HISTORY_NODES = 64


def _weights_by_history(kinds: list[bool | None]) -> list[bool | None]:
    """``kinds`` with the tensor inputs made from parameters only counted as weights.

    A weight can reach a region as a plain tensor made from a parameter outside it (cast to
    another dtype, transposed for a tied head, normalized): its gradient goes to parameters
    only, so torch's split computes it in W. Told from the autograd history of the node whose
    backward is being compiled (AOTAutograd compiles it lazily, inside the first backward):
    an edge whose history reaches only ``nn.Parameter`` leaves, within a few nodes, is a
    weight. The same compiled graph may later serve a node where that input is an activation:
    the pass then needs gradients of both kinds at once and runs the full graph (never a
    wrong gradient).
    """
    node = torch._C._current_autograd_node()
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


def _count(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")


def _input_names(gm: fx.GraphModule, kinds: Sequence[bool | None]) -> list[str]:
    names = getattr(gm, "_customgrad_input_names", None)
    if isinstance(names, list) and len(names) == len(kinds):
        return names
    return [f"{'weight' if k else 'input'} {j}" for j, k in enumerate(kinds)]


def _boxed(fn: Any) -> Callable[[list[Any]], Any]:
    if getattr(fn, "_boxed_call", False):
        return fn  # type: ignore[no-any-return]

    def call(args: list[Any]) -> Any:
        values = list(args)
        args.clear()
        return fn(*values)

    return call


def _dynamo_input_names(gm: fx.GraphModule) -> list[str]:
    names = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        source = n.meta.get("grapharg")
        label = getattr(getattr(source, "source", None), "name", None)
        text = label() if callable(label) else label
        names.append(_readable(str(text)) if text else n.name)
    return names


_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight -> its compiled module's class


def _region_label(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    """The class of the compiled module the graph's weights belong to, e.g. ``Block``."""
    with _LOCK:
        for x in example_inputs:
            if isinstance(x, nn.Parameter) and x in _OWNERS:
                return str(_OWNERS[x])
    for n in gm.graph.nodes:
        stack = n.meta.get("nn_module_stack")
        if stack:
            _, cls = next(iter(stack.values()))
            name = getattr(cls, "__qualname__", None) or str(cls).rsplit(".", 1)[-1]
            return str(name)
    return "compiled function"


def _readable(source: str) -> str:
    """``L['self']._modules['fc1']._parameters['weight']`` -> ``fc1.weight``."""
    import re

    if source.startswith("L['args']"):
        index = re.findall(r"\[(\d+)\]", source)
        return f"input {index[0]}" if index else "input"
    parts = [p for p in re.findall(r"\['([^']+)'\]", source) if p not in ("self", "call_impl")]
    return ".".join(parts) if parts else source


class _Backend:
    """The ``torch.compile`` backend :func:`compile` installs: one per compiled module."""

    def __init__(self, backend: Any, mode: str | None, options: Any, dynamic: Any):
        self.backend = backend
        self.counter = itertools.count()
        self.inductor_config: dict[str, Any] = {}
        if backend == "inductor":
            from torch import _TorchCompileInductorWrapper

            self.inductor_config = _TorchCompileInductorWrapper(mode, options, dynamic).config

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
        region = CompiledRegion(
            name=f"{_region_label(gm, example_inputs)} (graph {next(self.counter)})"
        )
        _register(region)
        kinds = [_kind(x) for x in example_inputs]
        reason = None
        if _subclass_input(example_inputs):
            reason = "a tensor-subclass input (its gradient is flattened into inner tensors)"
        names = _dynamo_input_names(gm)
        with torch._functorch.config.patch(donated_buffer=False, enable_autograd_cache=False):
            if self.backend == "inductor":
                compiled = self._inductor(gm, example_inputs, region, kinds, reason, names)
            else:
                compiled = self._aot(gm, example_inputs, region, kinds, reason, names)
        _no_donated_buffers()
        return compiled

    def _inductor(
        self,
        gm: fx.GraphModule,
        example_inputs: list[Any],
        region: CompiledRegion,
        kinds: list[bool | None],
        reason: str | None,
        names: list[str],
    ) -> Any:
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner(g: fx.GraphModule, ex: Sequence[Any], **kw: Any) -> Any:
            if not kw.get("is_backward"):
                return compile_fx_inner(g, ex, **kw)
            g._customgrad_input_names = names  # type: ignore[assignment]
            return _SplitCompiler(region, kinds, compile_fx_inner, reason)(g, ex, **kw)

        return compile_fx(
            gm, example_inputs, inner_compile=inner, config_patches=dict(self.inductor_config)
        )

    def _aot(
        self,
        gm: fx.GraphModule,
        example_inputs: list[Any],
        region: CompiledRegion,
        kinds: list[bool | None],
        reason: str | None,
        names: list[str],
    ) -> Any:
        from torch._dynamo.backends.common import AotAutograd
        from torch._dynamo.backends.debugging import aot_eager, boxed_nop

        backend = self.backend
        if backend == "aot_eager":
            bw = boxed_nop
        else:
            assert isinstance(backend, AotAutograd)
            bw = backend.kwargs.get("bw_compiler") or backend.kwargs["fw_compiler"]

        def bw_compiler(g: fx.GraphModule, ex: Sequence[Any]) -> Any:
            g._customgrad_input_names = names  # type: ignore[assignment]
            return _SplitCompiler(region, kinds, bw, reason)(g, ex)

        if backend == "aot_eager":
            return aot_eager(gm, example_inputs, bw_compiler=bw_compiler)
        return AotAutograd(**{**backend.kwargs, "bw_compiler": bw_compiler})(gm, example_inputs)


def _calls(call_impl: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kw: Any) -> Any:
        return call_impl(*args, **kw)

    return call


_CODES: weakref.WeakKeyDictionary[type, Any] = weakref.WeakKeyDictionary()


def _call_for(module: nn.Module) -> Callable[..., Any]:
    """``module._call_impl`` in a function whose code object is its class's own.

    Dynamo keeps compiled graphs per code object (at most ``recompile_limit`` each): blocks of
    one class share theirs, as ``torch.compile(block)`` does, and other classes never evict
    them. (``nn.Module.compile`` compiles ``Module._call_impl`` itself, a frame dynamo skips.)
    """
    call = _calls(module._call_impl)
    cls = type(module)
    with _LOCK:
        code = _CODES.get(cls)
        if code is None:
            code = _CODES[cls] = call.__code__.replace(co_name=f"call_{cls.__name__}")
    call.__code__ = code
    return call


_BACKENDS: dict[tuple[Any, ...], _Backend] = {}


def _backend_for(backend: Any, mode: str | None, options: Any, dynamic: Any) -> _Backend:
    """One backend object per setting: dynamo reuses a compiled graph only for the same
    backend object, so blocks of one class compiled alike share their compiled code."""
    key = (id(backend) if not isinstance(backend, str) else backend, mode, repr(options), dynamic)
    with _LOCK:
        found = _BACKENDS.get(key)
        if found is None:
            found = _BACKENDS[key] = _Backend(backend, mode, options, dynamic)
        return found


def _resolve_backend(backend: Any) -> Any:
    from torch._dynamo.backends.common import AotAutograd

    if isinstance(backend, AotAutograd):
        return backend
    if isinstance(backend, str):
        if backend in SUPPORTED_BACKENDS:
            return backend
        from torch._dynamo.backends.registry import lookup_backend

        try:
            found = lookup_backend(backend)
        except Exception:
            found = None
        if isinstance(found, AotAutograd):
            return found
    raise ArgumentValueError(MSG_BACKEND.format(got=_describe(backend)))


def _describe(value: object) -> str:
    if isinstance(value, str):
        return repr(value)
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    return f"{type(value).__name__} {name}" if name else f"{type(value).__name__}"


def compile(module: _M, **torch_compile_kwargs: Any) -> _M:
    """Compile ``module`` in place with ``torch.compile``, with a backward that splits.

    Like ``nn.Module.compile``, the module keeps its identity (so torch's zero-bubble
    schedules accept the stage: no ``OptimizedModule``) and its next calls run compiled. Each
    compiled region's backward is cut into an input-gradient graph (I) and a weight-gradient
    graph (W), compiled by the same backend: under torch's or customgrad's
    ``stage_backward_input`` / ``stage_backward_weight`` nothing is computed twice, and a full
    ``loss.backward()`` runs the uncut graph. What cannot split runs its full backward in each
    pass that reaches it, with one log line (logger ``"customgrad"``) saying why.

    Args:
        module: an ``nn.Module`` (compiled in place) or a function (a compiled function is
            returned). Per block (regional compile) or a whole stage; customgrad ops inside
            are compiled with the rest.
        **torch_compile_kwargs: what ``torch.compile`` takes: ``backend`` (``"inductor"``,
            the default; ``"aot_eager"``; or an AOTAutograd backend), ``mode``, ``options``,
            ``dynamic``, ``fullgraph``, ...

    Returns:
        ``module`` itself, compiled (for a function: the compiled function).

    Raises:
        ArgumentTypeError: ``module`` is neither an ``nn.Module`` nor callable, or an
            ``OptimizedModule`` (already ``torch.compile``\\ d).
        ArgumentValueError: the backend does not go through AOTAutograd.

    Example:
        >>> import torch, customgrad
        >>> block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
        >>> block = customgrad.compile(block, backend="aot_eager")
        >>> block(torch.randn(2, 4)).sum().backward()
    """
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(module, OptimizedModule):
        raise ArgumentTypeError(
            MSG_TWICE.format(got="this OptimizedModule", how="by torch.compile(module)")
        )
    if not callable(module):
        raise ArgumentTypeError(MSG_NOT_CALLABLE.format(got=_describe(module)))
    kwargs = dict(torch_compile_kwargs)
    backend = _resolve_backend(kwargs.pop("backend", "inductor"))
    mode = kwargs.pop("mode", None)
    options = kwargs.pop("options", None)
    if backend != "inductor" and (mode not in (None, "default") or options):
        got = _describe(torch_compile_kwargs["backend"])
        raise ArgumentValueError(MSG_MODE.format(got=got, mode=mode, options=options))
    compiled_backend = _backend_for(backend, mode, options, kwargs.get("dynamic"))
    label = type(module).__qualname__ if isinstance(module, nn.Module) else _describe(module)
    if isinstance(module, nn.Module):
        if module._compiled_call_impl is not None:
            raise ArgumentTypeError(
                MSG_TWICE.format(got=label, how="its _compiled_call_impl is set")
            )
        with _LOCK:
            for p in module.parameters():
                _OWNERS[p] = label
        call = _call_for(module)
        module._compiled_call_impl = torch.compile(call, backend=compiled_backend, **kwargs)
        return module
    return torch.compile(module, backend=compiled_backend, **kwargs)  # type: ignore[return-value]
