"""Compiled regions whose backward splits into an input pass (I) and a weight pass (W).

``torch.compile`` turns a region into one autograd node whose backward is one compiled graph:
under a split schedule that graph would run whole in I and again in W (twice the work), and
with torch's default configuration it refuses to run twice at all (donated buffers). Here the
backward graph AOTAutograd hands the backend is cut in three, each compiled by the backend's own
compiler:

- **full**: the graph as it is, for a backward that needs every gradient (``loss.backward()``);
- **I**: the input gradients, plus the values W needs from them (the *hand-off*);
- **W**: the weight gradients, from the saved values, the output gradients and the hand-off.

Which gradients I computes follows the pass: the ones the running pass needs (the autograd
engine says which of the node's edges it uses, as for customgrad ops,
:func:`customgrad._autograd.engine_needs`); W computes the rest. Each such pattern is cut and
compiled once, when first met; the pattern torch's split counts (parameters, and inputs made
from parameters only outside the region: a cast, a transposed tied weight) is cut ahead, in the
first backward. Blocks of one class share one compiled graph whose arguments may hold an
activation in one block and a parameter-made tensor in another: each call gets its own cut.

What W can recompute without FLOPs (views, elementwise ops of saved values) is recomputed in W
rather than kept. The hand-off is keyed by the node (one per microbatch), kept in a weak map so
it goes with the graph if W never runs, and dropped by W. It belongs to the pass that made it:
W reads it only when the engine gives the node the same output gradients as in I (recorded by
a pre-hook the forward puts on the node; AOTAutograd's own copies of them, contiguous or zeros,
are new in each pass), so a pass of another loss never reads it.

What cannot split keeps the full backward, with one log line saying why: CUDA graphs
(``mode="reduce-overhead"``), compiled autograd, tensor-subclass or mutated inputs that require
grad, gradients that do not line up with the node's edges.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import torch
from torch import fx, nn

from customgrad._autograd import engine_needs
from customgrad._compiled_cut import RegionCut, cut_graph
from customgrad._errors import ArgumentTypeError, ArgumentValueError
from customgrad._handoff import HandOff, PassRecord, record_pass, same_pass
from customgrad._origin import ValueOrigin, origin_of
from customgrad._origin import summary as origin_summary
from customgrad._releases import refuse_torch_split
from customgrad._switches import split_enabled
from customgrad._torch.aot import (
    compiled_backward,
    config_patch,
    inductor_compilers,
    tracing_metadata,
)
from customgrad._torch.dispatcher import is_traceable_wrapper_subclass
from customgrad._torch.dynamo import (
    aot_autograd_type,
    compiled_autograd_on,
    compiled_call,
    compiling_locals,
    eager_backends,
    inductor_config,
    lookup_backend,
    optimized_module_type,
    set_compiled_call,
)
from customgrad._torch.engine import current_node, graph_kept
from customgrad._torch.fake import is_fake
from customgrad._torch.functions import is_aot_node

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
    repeated: str | None = None
    """Why some pass computed again what an earlier pass through the same node computed (the
    split ran, but not as one I and one W), or None."""
    _pending: weakref.WeakKeyDictionary[Any, HandOff] = field(
        default_factory=weakref.WeakKeyDictionary, repr=False
    )
    _passes: weakref.WeakKeyDictionary[Any, tuple[Any, ...]] = field(
        default_factory=weakref.WeakKeyDictionary, repr=False
    )
    """Per node: the output gradients the engine passed it for the backward about to run."""
    _input_side_dropped: weakref.WeakKeyDictionary[Any, tuple[bool, ...]] = field(
        default_factory=weakref.WeakKeyDictionary, repr=False
    )
    """Per node: its edges whose gradients the running weight pass keeps (it drops the rest)."""
    _logged: bool = field(default=False, repr=False)
    _logged_repeat: bool = field(default=False, repr=False)

    @contextlib.contextmanager
    def dropping_input_side(self, node: Any, weight_side: tuple[bool, ...]) -> Iterator[None]:
        """While the block runs, ``node``'s backward computes only its ``weight_side`` edges'
        gradients: a weight pass runs the node through an engine call that wants its input
        edges too (a weight it shares with a region before it) but drops what it sends along
        them (its input pass sent those already)."""
        with _LOCK:
            self._input_side_dropped[node] = weight_side
        try:
            yield
        finally:
            with _LOCK:
                self._input_side_dropped.pop(node, None)

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

    def note_repeat(self, reason: str) -> None:
        """Record (and log once) that a pass recomputes work of an earlier pass, and why."""
        with _LOCK:
            self.repeated = reason
            first = not self._logged_repeat
            self._logged_repeat = True
        if first:
            log.warning(
                "customgrad.compile: compiled region %s runs its full backward in a pass where "
                "it would split: %s",
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
        if self.repeated:
            text += f"; some pass ran the full backward: {self.repeated}"
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
    fn = compiled_backward(node)
    for _ in range(8):  # through wrappers (torch._dynamo.disable keeps __wrapped__)
        if fn is None or isinstance(fn, _Backward):
            break
        fn = getattr(fn, "__wrapped__", None)
    return fn.region if isinstance(fn, _Backward) else None


# --------------------------------------------------------------------------------------------
# Running it


@dataclass
class _Cut:
    """One way to cut the backward: its compiled I and W graphs, and which edges W computes."""

    input_fn: Callable[[list[Any]], Any]
    weight_fn: Callable[[list[Any]], Any]
    plan: RegionCut
    later: tuple[bool, ...]
    """One entry per edge of the node (the region's tensor inputs): whether W computes its
    gradient (I computes the others)."""

    def serves_later(self, needed: Sequence[bool]) -> bool:
        """Whether this cut's W computes every gradient a pass needing ``needed`` uses."""
        return any(needed) and all(w or not n for n, w in zip(needed, self.later))


def _engine_grads(region: CompiledRegion, node: Any, tangents: Sequence[Any]) -> list[Any] | None:
    """The output gradients the autograd engine passed to ``node`` for the running pass (None
    for "no gradient"), as its pre-hook (:class:`_PassRecorder`) saw them; None when unknown.

    They are the same tensors in an input pass and in the weight pass it hands off to, where
    AOTAutograd's copies for the compiled graph (``tangents``: a contiguous copy of an expanded
    or transposed gradient, zeros for an output that got none) are new in each pass. A pre-hook
    registered after the recorder could replace them: each tangent must be one of the recorded
    gradients, or a copy AOTAutograd would make of one (of the same shape into other strides,
    or zeros for a missing one); otherwise the pass is unknown.
    """
    with _LOCK:
        seen = region._passes.pop(node, None)
    if seen is None:
        return None
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
            return None  # a tangent that is no recorded gradient nor a copy of one
        del unmatched[k]
    return grads


class _CompiledKept(NamedTuple):
    """What a region's input pass keeps for its weight pass (a :class:`HandOff`'s value): the
    I/W pair whose input graph made it, whether the hand-off's record is of the gradients the
    engine passed (else of AOTAutograd's copies, ``tangents``), and the kept values."""

    cut: _Cut
    from_engine: bool
    tangents: PassRecord
    kept: list[Any]


def _made_by(handoff: HandOff, engine: Sequence[Any] | None, tangents: Sequence[Any]) -> bool:
    """Whether the running pass (its engine gradients, or where unknown AOTAutograd's copies) is
    the pass that made ``handoff``: the gradients compared are the ones the autograd engine
    passed to the node (:func:`_engine_grads`); where they are unknown, the ones the compiled
    backward got (AOTAutograd's copies: then a pass whose gradients AOTAutograd copies does not
    match and recomputes, logged)."""
    value: _CompiledKept = handoff.value
    if value.from_engine and engine is not None:
        return handoff.made_by(engine)
    return same_pass(value.tangents, tangents)


class _PassRecorder:
    """A pre-hook on a region's autograd node: records the output gradients the engine passes
    to the node, just before its backward runs (the pass the backward belongs to)."""

    __slots__ = ("node", "region")

    def __init__(self, region: CompiledRegion, node: Any) -> None:
        self.region = weakref.ref(region)
        self.node = weakref.ref(node)

    def __call__(self, grads: tuple[Any, ...]) -> None:
        region, node = self.region(), self.node()
        if region is not None and node is not None:
            with _LOCK:
                region._passes[node] = grads


_WALK = 4


def _watch(region: CompiledRegion, outputs: Any, earlier: Sequence[Any]) -> None:
    """Put a :class:`_PassRecorder` on the autograd node a compiled forward just made (reached
    from its outputs within a few view nodes; not an input's, ``earlier``, which an output that
    is an input, or a view of one, leads to)."""
    outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    seen: set[int] = set()
    for o in outs:
        fn = o.grad_fn if isinstance(o, torch.Tensor) else None
        for _ in range(_WALK):
            if fn is None or any(fn is e for e in earlier):
                break
            if is_aot_node(fn):
                if id(fn) not in seen:
                    seen.add(id(fn))
                    fn.register_prehook(_PassRecorder(region, fn))
                break
            nexts = fn.next_functions
            fn = nexts[0][0] if nexts else None


def _watching(region: CompiledRegion, compiled: Any) -> Any:
    """``compiled`` (the callable dynamo runs for a graph) with its node watched per call."""

    @functools.wraps(compiled)
    def run(*args: Any) -> Any:
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
    """The compiled backward AOTAutograd calls (boxed): full, I or W, picked per call.

    A pass that needs every gradient that requires grad runs the full graph. A pass that
    needs some runs the I graph of the cut "these now, the rest later" (compiled once per such
    pattern, when first met) and keeps the hand-off; the next pass through the node with the
    same output gradients that needs only what that cut left for later runs its W graph.
    """

    def __init__(
        self,
        region: CompiledRegion,
        full: Callable[[list[Any]], Any],
        n_outputs: int,
        n_edges: int,
        cuts: Sequence[_Cut],
        make_cut: Callable[[tuple[bool, ...]], _Cut | None] | None = None,
    ) -> None:
        self._boxed_call = True  # in the instance's __dict__: wrappers (functools.wraps) keep it
        self.region = region
        self.full = full
        self.n_outputs = n_outputs
        self.n_edges = n_edges
        self.cuts: dict[tuple[bool, ...], _Cut | None] = {c.later: c for c in cuts}
        self.make_cut = make_cut
        self.tangents: list[int] = cuts[0].plan.tangents if cuts else []

    def __call__(self, args: list[Any]) -> Any:
        region = self.region
        node = current_node()
        tangents = [args[i] for i in self.tangents if i < len(args)]
        engine = _engine_grads(region, node, tangents) if node is not None else None
        mode, cut = self._mode(node, args, engine)
        if cut is None:
            with _LOCK:
                region.runs["full"] += 1
                if node is not None:
                    region._pending.pop(node, None)
            return self.full(args)
        plan = cut.plan
        grads: list[Any] = [None] * self.n_outputs
        if mode == "input":
            refuse_torch_split(f"customgrad.compile region {region.name}")  # torch 2.11, 2.12
            seen = record_pass([args[i] for i in plan.tangents if i < len(args)])
            out = list(cut.input_fn(args))
            n = len(plan.input_positions)
            for j, g in zip(plan.input_positions, out[:n]):
                grads[j] = g
            kept = out[n:]
            size = sum(t.untyped_storage().nbytes() for t in kept if isinstance(t, torch.Tensor))
            made = seen if engine is None else record_pass(engine)
            handoff = HandOff(made, "compiled", _CompiledKept(cut, engine is not None, seen, kept))
            with _LOCK:
                if graph_kept():  # a later pass can come through this node
                    region._pending[node] = handoff
                    region.handoff_bytes = size
                region.runs["input"] += 1
            return grads
        with _LOCK:
            found = region._pending.pop(node, None)
            region.runs["weight"] += 1
        if found is not None:
            args.extend(found.value.kept)
            del found
        for j, g in zip(plan.weight_positions, cut.weight_fn(args)):
            grads[j] = g
        return grads

    def _mode(
        self, node: Any, args: Sequence[Any], engine: Sequence[Any] | None
    ) -> tuple[str, _Cut | None]:
        """``("input", cut)``, ``("weight", cut)`` or ``("full", None)`` for the running pass."""
        if (self.make_cut is None and not self.cuts) or not split_enabled():
            return "full", None
        region = self.region
        if node is None:
            region.fall_back(
                "no autograd node is running its backward (compiled autograd traces it whole)"
            )
            return "full", None
        edges = node.next_functions
        if len(edges) != self.n_edges:
            region.fall_back(f"its node has {len(edges)} edges for {self.n_edges} tensor inputs")
            return "full", None
        requires = [fn is not None for fn, _ in edges]
        needed = [fn is not None and engine_needs(fn) for fn, _ in edges]
        with _LOCK:
            handoff = region._pending.get(node)
            kept_side = region._input_side_dropped.get(node)
        if kept_side is not None:  # the running weight pass drops the rest
            needed = [n and k for n, k in zip(needed, kept_side)]
        if handoff is not None:
            tangents = [args[i] for i in self.tangents if i < len(args)]
            cut_made = handoff.value.cut
            if _made_by(handoff, engine, tangents) and cut_made.serves_later(needed):
                return "weight", cut_made
            with _LOCK:
                region._pending.pop(node, None)
            if any(needed) and cut_made.serves_later(needed):
                region.note_repeat(
                    "a pass needing only the gradients its input pass left for later came with "
                    "other output gradients than that input pass (another loss, or gradients "
                    "replaced by a hook), so it computes them from its own"
                )
        if needed == requires or not any(needed):
            return "full", None
        later = tuple(r and not n for r, n in zip(requires, needed))
        cut = self._cut_for(later)
        return ("input", cut) if cut is not None else ("full", None)

    def _cut_for(self, later: tuple[bool, ...]) -> _Cut | None:
        with _LOCK:
            if later in self.cuts:
                return self.cuts[later]
        cut = self.make_cut(later) if self.make_cut is not None else None
        with _LOCK:
            self.cuts[later] = cut
        return cut


# --------------------------------------------------------------------------------------------
# The backend


def _kind(x: Any) -> bool | None:
    if not isinstance(x, torch.Tensor):
        return None
    return isinstance(x, nn.Parameter)


def _subclass_input(example_inputs: Sequence[Any]) -> bool:
    return any(
        isinstance(x, torch.Tensor)
        and not isinstance(x, nn.Parameter)
        and (is_traceable_wrapper_subclass(x) or type(x) not in (torch.Tensor,))
        and not is_fake(x)
        for x in example_inputs
    )


def _no_donated_buffers() -> None:
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
        outs = list(gm.graph.output_node().args[0])  # type: ignore[arg-type]
        positions = [j for j, k in enumerate(self.kinds) if k is not None]
        if reason is None and len(outs) != len(self.kinds):
            reason = (
                f"its backward has {len(outs)} outputs for {len(self.kinds)} inputs (AOTAutograd "
                "deduplicated or regrouped them)"
            )

        def later_of(kinds: Sequence[bool | None]) -> tuple[bool, ...]:
            return tuple(bool(kinds[j]) and isinstance(outs[j], fx.Node) for j in positions)

        full = self.compile_one(gm, example_inputs, **kwargs)
        by_history = later_of(_weights_by_history(self.kinds)) if reason is None else ()
        first = cut_graph(gm, self._is_weight(by_history)) if reason is None else reason
        if isinstance(first, str):
            region.fall_back(first)
            return _Backward(region, _boxed(full), len(self.kinds), len(positions), [])
        cuts = [self._cut(first, by_history, example_inputs, kwargs)]
        self._describe(gm, first)
        params_only = later_of(self.kinds)
        if params_only != by_history:
            plan = cut_graph(gm, self._is_weight(params_only))
            if not isinstance(plan, str):
                cuts.append(self._cut(plan, params_only, example_inputs, kwargs))

        def make_cut(later: tuple[bool, ...]) -> _Cut | None:
            return self._later_cut(gm, example_inputs, kwargs, later)

        return _Backward(region, _boxed(full), len(self.kinds), len(positions), cuts, make_cut)

    def _is_weight(self, later: Sequence[bool]) -> list[bool | None]:
        """Per region input: True where W computes the gradient, False where I does, None for
        an input that is not a tensor."""
        flags = iter(later)
        return [None if k is None else next(flags) for k in self.kinds]

    def _later_cut(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        kwargs: dict[str, Any],
        later: tuple[bool, ...],
    ) -> _Cut | None:
        """The cut whose W computes the gradients of ``later``, compiled when a pass first
        needs it (blocks of one class share a graph whose inputs hold activations in one block
        and weights made from parameters in another)."""
        plan = cut_graph(gm, self._is_weight(later))
        if isinstance(plan, str):
            self.region.note_repeat(plan)
            return None
        try:
            cut = self._cut(plan, later, example_inputs, kwargs)
        except Exception as e:  # the backend could not compile it here: run the full graph
            self.region.note_repeat(
                f"the backend could not compile its cut for this pattern of gradients "
                f"({type(e).__name__}: {e})"
            )
            return None
        if self.region.input_pass is None:
            self._describe(gm, plan)
        return cut

    def _describe(self, gm: fx.GraphModule, plan: RegionCut) -> None:
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
        plan: RegionCut,
        later: tuple[bool, ...],
        example_inputs: Sequence[Any],
        kwargs: dict[str, Any],
    ) -> _Cut:
        input_fn = self.compile_one(plan.input_gm, list(example_inputs), **kwargs)
        weight_examples = [*example_inputs, *(h.meta.get("val") for h in plan.handoff)]
        weight_fn = self.compile_one(plan.weight_gm, weight_examples, **kwargs)
        return _Cut(_boxed(input_fn), _boxed(weight_fn), plan, later)


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


def _region_label(gm: fx.GraphModule) -> str:
    """The class of the module whose frame dynamo compiled (``Block``), else of the first
    module the graph calls, else "compiled function"."""
    frame = compiling_locals()  # forward(self, ...), or _call_for's call(*args) of call_impl
    module = frame.get("self", getattr(frame.get("call_impl"), "__self__", None))
    if isinstance(module, nn.Module):
        for cls in type(module).__mro__:  # past FSDP2's generated FSDP<Block> class
            if not cls.__module__.startswith("torch.distributed"):
                return cls.__qualname__
        return type(module).__qualname__
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
            self.inductor_config = inductor_config(mode, options, dynamic)

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
        region = CompiledRegion(name=f"{_region_label(gm)} (graph {next(self.counter)})")
        _register(region)
        kinds = [_kind(x) for x in example_inputs]
        reason = None
        if _subclass_input(example_inputs):
            reason = "a tensor-subclass input (its gradient is flattened into inner tensors)"
        names = _dynamo_input_names(gm)
        with config_patch(donated_buffer=False, enable_autograd_cache=False):
            if self.backend == "inductor":
                compiled = self._inductor(gm, example_inputs, region, kinds, reason, names)
            else:
                compiled = self._aot(gm, example_inputs, region, kinds, reason, names)
        _no_donated_buffers()
        return _watching(region, compiled)

    def _inductor(
        self,
        gm: fx.GraphModule,
        example_inputs: list[Any],
        region: CompiledRegion,
        kinds: list[bool | None],
        reason: str | None,
        names: list[str],
    ) -> Any:
        compile_fx, compile_fx_inner = inductor_compilers()

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
        AotAutograd = aot_autograd_type()
        aot_eager, boxed_nop = eager_backends()

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


def _user_forward(module: nn.Module) -> bool:
    """Whether the module's ``forward`` is the user's code (a frame dynamo compiles)."""
    forward = getattr(type(module), "forward", None)
    return not str(getattr(forward, "__module__", "torch.")).startswith("torch.")


def _calls(call_impl: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kw: Any) -> Any:
        return call_impl(*args, **kw)

    return call


_CODES: weakref.WeakKeyDictionary[type, Any] = weakref.WeakKeyDictionary()


def _call_for(module: nn.Module) -> Callable[..., Any]:
    """``module._call_impl`` in a function whose code object is its class's own, for modules
    whose ``forward`` is torch's own (``nn.Linear``, ``nn.Sequential``): dynamo skips torch's
    frames, so compiling ``_call_impl`` as ``nn.Module.compile`` does would compile nothing.
    Dynamo traces this function's frame, inlining ``_call_impl`` (hooks included) and
    ``forward``; it keeps compiled graphs per code object: modules of one class share theirs,
    and other classes never evict them.
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
    if isinstance(backend, aot_autograd_type()):
        return backend
    if isinstance(backend, str):
        if backend in SUPPORTED_BACKENDS:
            return backend
        try:
            found = lookup_backend(backend)
        except Exception:
            found = None
        if isinstance(found, aot_autograd_type()):
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
    if isinstance(module, optimized_module_type()):
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
        if compiled_call(module) is not None:
            raise ArgumentTypeError(
                MSG_TWICE.format(got=label, how="its _compiled_call_impl is set")
            )
        # as nn.Module.compile does: dynamo skips _call_impl's own frame, so the module's hooks
        # (FSDP2's, any torch._dynamo.disable'd one) run outside the graph, and compiles
        # forward's frame, whose code object blocks of one class share
        call = module._call_impl if _user_forward(module) else _call_for(module)
        compiled = torch.compile(call, backend=compiled_backend, **kwargs)
        compiled._customgrad_compiled = True
        set_compiled_call(module, compiled)
        return module
    return torch.compile(module, backend=compiled_backend, **kwargs)  # type: ignore[return-value]
