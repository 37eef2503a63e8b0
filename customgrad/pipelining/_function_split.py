"""The automatic split of a plain ``torch.autograd.Function``'s backward in a stage's split backward.

A Function node with edges into the weight side runs once in the input pass (I) and hands W the
weight gradients it returned (:mod:`customgrad.pipelining._backward`). With ``split_functions``
(the default), I first tries to split it as customgrad splits its own ops' single backward
(:mod:`customgrad._autosplit`): ``Function.backward(ctx, *grads)`` is captured with dynamo
(:mod:`customgrad._capture`), with one gradient slot per tensor argument of the forward (the
weight slots: the node's weight-side edges), and cut by the split program. I runs the input
pass and keeps what the weight pass shares with it (a :class:`~customgrad._handoff.Kept`); W runs
the weight pass and sends its gradients along the weight-side edges, summed and cast to each
edge's shape and dtype as the engine does.

The ctx the capture sees is a plain object made from the node at each backward: its saved
tensors, the attributes its forward set, ``needs_input_grad``. dynamo's guards on it (the
attributes' values, the saved tensors' shapes, dtypes and strides, the globals the backward
reads) select the capture per call; a change captures again. A backward that cannot be captured
(a Triton launch, Python side effects, a graph break, a write into a tensor it did not create, a
tensor kept on ctx rather than saved) runs once as before, with its reason logged once per class.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch.autograd.graph import GradientEdge, Node

from customgrad._autosplit import AutoSplitter
from customgrad._capture import INSIDE_TRACE, NOT_COMPILING, Fallback
from customgrad._errors import where
from customgrad._function_ctx import FunctionContext, of_node
from customgrad._handoff import Describe, HandOff, HandOffValue, edge_name, guard
from customgrad._rules import Gradient, OpSpec
from customgrad._signature import Signature
from customgrad._torch.functions import edge_metadata, forward_cls, setup_context_defined
from customgrad._traced_split import Gradients, TracedSplit

__all__ = ["FunctionOnce", "FunctionSplit", "edge_arguments", "split_input"]

log = logging.getLogger("customgrad")

NOT_TENSOR_POSITIONS = Fallback(
    "its forward takes arguments that are not tensors besides tensors that need no gradient, so "
    "its node does not tell which gradient it returns goes along which edge",
    "give the tensors that need no gradient after the others, or make it a customgrad op "
    "(customgrad.from_function)",
)


class _FunctionSpec:
    """What the capture and the split program read of an op, for a Function's backward with its
    tensor arguments named ``arg<position>``."""

    __slots__ = ("name", "signature")

    def __init__(self, cls: type, names: tuple[str, ...], weights: tuple[str, ...]) -> None:
        self.name = f"{cls.__module__}.{cls.__qualname__}"

        def named(*args: Any) -> None:
            """Carries the backward's argument names for ``Signature``; never called."""

        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        named.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter(n, kind) for n in names]
        )
        named.__wrapped__ = cls.backward  # type: ignore[attr-defined]  # for file:line
        schema = f"({', '.join(f'Tensor {n}' for n in names)}) -> Tensor"
        self.signature = Signature(self.name, schema, named, weights)


def _calling(backward: Callable[..., Any], names: tuple[str | None, ...]) -> Callable[..., Any]:
    """``backward`` as a single backward of customgrad's form, ``fn(ctx, saved, *grads) ->
    {name: gradient}``, for the forward's arguments named ``names`` (None: not a tensor). A
    gradient for a non-tensor, or too few gradients, raise (torch raises its own error for
    those): the capture refuses it and the Function runs as written."""
    n_args = len(names)

    def fn(ctx: Any, saved: Any, *grads: Any) -> dict[str, Any]:
        got = backward(ctx, *grads)
        if not isinstance(got, tuple):
            got = (got,)
        if len(got) < n_args:
            raise ValueError("too few gradients")
        out: dict[str, Any] = {}
        for i, g in enumerate(got):
            name = names[i] if i < n_args else None
            if name is not None:
                out[name] = g
            elif g is not None:
                raise ValueError("a gradient for an argument that is not a tensor")
        return out

    return fn


_SPLITTERS: dict[tuple[type, tuple[str | None, ...], tuple[str, ...]], AutoSplitter] = {}
"""The automatic split of each Function class seen, per layout of its arguments (their names,
the weight-side ones): the captures and retry rule of customgrad's own single backwards."""


def _splitter(
    cls: type[torch.autograd.Function], names: tuple[str | None, ...], weights: tuple[str, ...]
) -> AutoSplitter:
    """The splitter of ``cls``'s backward for arguments ``names`` with weights ``weights``.

    The backward is called as a plain function (``cls.backward``): dynamo takes
    ``Function.backward(...)`` for compiled autograd's call."""
    key = (cls, names, weights)
    found = _SPLITTERS.get(key)
    if found is None:
        tensors = tuple(n for n in names if n is not None)
        # The capture and the split program read an op's name and signature only.
        spec = cast(OpSpec, _FunctionSpec(cls, tensors, weights))
        found = _SPLITTERS[key] = AutoSplitter(spec, _calling(cls.backward, names), "none")
    return found


class _Sizes:
    """The Python ints a Function's forward kept on ctx (group sizes, ``(start, end)`` bounds of
    experts' rows), as the capture sees them.

    As constants first. Once one changes between backwards (a mixture of experts' routing:
    each change would be a new capture, and the backward would run once after
    :data:`~customgrad._autosplit.RECAPTURES` of them), the capture reads it from a tensor of
    its values instead, saved with the node's tensors (``.tolist()`` in a property of the
    ctx): dynamo makes the sizes unbacked, and each pass reads them from that tensor, so one
    capture serves every value. If that capture is refused (the backward needs them as
    constants: a dimension), they are constants again, from that call on."""

    __slots__ = ("changing", "first", "lifting")

    def __init__(self) -> None:
        self.first: dict[str, object] | None = None
        self.changing: frozenset[str] = frozenset()
        self.lifting = True

    def hand(self, ctx: FunctionContext) -> tuple[FunctionContext, tuple[object, ...]]:
        """The ctx the capture reads and the saved tensors that go with it."""
        saved: tuple[object, ...] = ctx.saved_tensors
        if not self.lifting:
            return ctx, saved
        ints = {k: v for k, v in vars(ctx).items() if _layout(v) is not _NOT_INTS}
        if self.first is None:
            self.first = ints
        changed = {k for k, v in ints.items() if self.first.get(k, v) != v}
        self.changing |= changed
        if not self.changing or not self.changing <= ints.keys():
            return ctx, saved
        lifted = object.__new__(_reading(self.changing))
        held = {k: v for k, v in vars(ctx).items() if k not in self.changing}
        tensors = {k: torch.tensor(_flat(ints[k]), dtype=torch.int64) for k in self.changing}
        held["_cg_sizes"] = tensors
        held["_cg_layouts"] = {k: _layout(ints[k]) for k in self.changing}
        vars(lifted).update(held)
        return lifted, (*saved, *tensors.values())


_NOT_INTS = object()


def _layout(value: object) -> object:
    """How ``value`` nests ints in lists and tuples (None: an int), or ``_NOT_INTS``."""
    if type(value) is int:
        return None
    if type(value) in (list, tuple) and len(value) <= 4096:  # type: ignore[arg-type]
        inner = tuple(_layout(v) for v in value)  # type: ignore[attr-defined]
        return _NOT_INTS if _NOT_INTS in inner else (type(value), inner)
    return _NOT_INTS


def _flat(value: object) -> list[int]:
    if type(value) is int:
        return [value]
    return [i for v in value for i in _flat(v)]  # type: ignore[attr-defined]


def _rebuilt(layout: Any, flat: list[object], at: int = 0) -> tuple[object, int]:
    """The value of ``layout`` from ``flat[at:]``, and where it ends (traced by dynamo)."""
    if layout is None:
        return flat[at], at + 1
    kind, inner = layout
    items = []
    for part in inner:
        item, at = _rebuilt(part, flat, at)
        items.append(item)
    return kind(items), at


@functools.cache
def _reading(names: frozenset[str]) -> type[FunctionContext]:
    """A ctx class whose ``names`` are read back from their tensors."""

    def read(name: str) -> property:
        def get(self: Any) -> object:
            flat = self._cg_sizes[name].tolist()
            return _rebuilt(self._cg_layouts[name], flat)[0]

        return property(get)

    return type("FunctionContext", (FunctionContext,), {n: read(n) for n in sorted(names)})


_NOW = (INSIDE_TRACE, NOT_COMPILING)
"""Why a backward does not split at this call only (another trace, torch.compile off)."""

_SIZES: dict[tuple[type, tuple[str | None, ...], tuple[str, ...]], _Sizes] = {}
"""The ints on ctx of each Function class and layout, as :class:`_Sizes` hands them."""

SPLIT: set[type] = set()
"""The Function classes whose backward split at least once (for :func:`customgrad.summary`)."""


class FunctionSplit:
    """A Function node's split backward between its passes: what W needs besides the values
    its input pass kept (the saved tensors, the output gradients and the weight-side edges),
    and the node's hand-off store, which holds those (:mod:`customgrad._runtime` runs both
    passes on it: the node is not kept for W)."""

    __slots__ = ("_edges", "_grads", "_guard", "_saved", "_split", "_weights", "handoff",
                 "label", "node")  # fmt: skip
    differentiable = None  # every output's gradient is compared (the store's Holder)

    def __init__(
        self,
        node: Node,
        split: TracedSplit,
        saved: tuple[object, ...],
        grads: tuple[torch.Tensor | None, ...],
        edges: list[tuple[str, Node, int]],
    ) -> None:
        self.node = weakref.ref(node)  # for tools that watch W: not kept alive for it
        self.handoff: HandOff[HandOffValue] | None = None
        self._split = split
        self._saved = saved
        self._grads = grads
        self._edges = edges
        self._weights = frozenset(name for name, _, _ in edges)
        cls = forward_cls(node)
        self.label = function_label(cls)
        self._guard = guard(grads, saved, describe_saved(cls, node, saved))

    device = torch.device("cpu")  # (never queued: the queue defers customgrad halves only)

    def owner(self) -> Node | None:
        """The node, while it lives (W runs its weight pass outside the engine)."""
        return self.node()

    def input_pass(self, needed: frozenset[str]) -> Gradients:
        """Run the input pass for the gradients ``needed``, keeping what W shares with it."""
        return self._split.run(self, self._saved, self._grads, needed, True)

    def gradients(self) -> tuple[list[GradientEdge], list[torch.Tensor]]:
        """Run the weight pass (once): the weight-side edges and their gradients."""
        self._guard.check(self.label)
        split, saved, grads = self._split, self._saved, self._grads
        self._saved = self._grads = ()
        result = split.run(self, saved, grads, self._weights, False)  # frees the hand-off
        del saved, grads
        edges: list[GradientEdge] = []
        values: list[torch.Tensor] = []
        for name, fn, nr in self._edges:
            g = result.get(name)
            if not isinstance(g, torch.Tensor):
                continue  # the backward returned None for it: the engine sends nothing either
            meta = edge_metadata(fn, nr)
            if meta is not None:  # as the engine's validation of a node's outputs
                shape, dtype = meta
                if g.shape != shape:
                    g = g.sum_to_size(shape)
                if g.dtype != dtype:
                    g = g.to(dtype)
            edges.append(GradientEdge(fn, nr))
            values.append(g)
        self._edges = []
        return edges, values


class FunctionOnce:
    """What a Function node that ran once in I leaves for W: the weight-side gradients its
    backward returned, with the edges they go along, and the versions of the tensors its
    backward read (its saved tensors and the tensors on its ctx; weak references: W does not
    need them), checked when W takes the gradients."""

    __slots__ = ("_guard", "kept", "label")

    def __init__(self, node: Node, kept: list[tuple[GradientEdge, torch.Tensor]]) -> None:
        self.kept = kept  # the weight-side gradients, with their edges, until W takes them
        cls = forward_cls(node)
        self.label = function_label(cls)
        try:
            saved = tuple(node.saved_tensors)  # type: ignore[attr-defined]
        except RuntimeError:  # freed by its backward: W computes nothing from it
            saved = ()
        attrs = [(k, v) for k, v in vars(node).items() if isinstance(v, torch.Tensor)]
        forward = None if cls is None else cls.forward
        set_at = f"set by {cls.__qualname__ if cls else 'the'}.forward at {where(forward)}"
        self._guard = guard(
            (),
            saved,
            describe_saved(cls, node, saved),
            [v for _, v in attrs],
            lambda k: (f"ctx.{attrs[k][0]}", set_at),
            weak=True,
        )

    device = torch.device("cpu")  # (never queued)

    def owner(self) -> Node | None:
        return None  # it ran in I: W only sends on what it returned

    def gradients(self) -> tuple[list[GradientEdge], list[torch.Tensor]]:
        """The gradients (once), after the version check."""
        self._guard.check(self.label)
        kept, self.kept = self.kept, []
        return [edge for edge, _ in kept], [g for _, g in kept]


def function_label(cls: type | None) -> str:
    """What errors call a plain Function's node."""
    return "a plain autograd.Function" if cls is None else f"{cls.__module__}.{cls.__qualname__}"


def describe_saved(
    cls: type[torch.autograd.Function] | None, node: Node, saved: Sequence[object]
) -> Describe:
    """What names the saved tensors of ``node`` (a Function's: ``saved``) in errors, worked out
    now (the node is not kept for W)."""
    forward = None if cls is None else cls.forward
    where_saved = f"saved by {cls.__qualname__ if cls else 'the'}.forward at {where(forward)}"
    edges = node.next_functions
    names = edge_arguments(cls, node)
    found = [
        f"saved tensor {k}{edge_name(t, edges, names)}"
        for k, t in enumerate(v for v in saved if isinstance(v, torch.Tensor))
    ]
    return lambda k: (found[k], where_saved)


def edge_arguments(cls: type | None, node: Node) -> list[str]:
    """The names of the forward's arguments whose gradients ``node`` (a Function's) sends along
    its edges, in edge order (``input <edge>`` where the node does not tell them)."""
    forward = getattr(cls, "forward", None)
    try:
        params = list(inspect.signature(forward).parameters) if forward else []
    except (TypeError, ValueError):
        params = []
    if cls is not None and not setup_context_defined(cls):
        params = params[1:]  # forward(ctx, ...)
    positions = _positions(node)
    if positions is not None and all(p < len(params) for p in positions):
        return [params[p] for p in positions]
    return [f"input {i}" for i in range(len(node.next_functions))]


def _positions(node: Node) -> tuple[int, ...] | None:
    """The forward's argument positions of the node's edges (its tensor arguments), or None
    when the node does not tell them."""
    needs = node.needs_input_grad  # type: ignore[attr-defined]
    edges = node.next_functions
    if len(edges) == len(needs):
        return tuple(range(len(needs)))
    wanted = tuple(i for i, n in enumerate(needs) if n)
    if len(wanted) == len(edges) and all(fn is not None for fn, _ in edges):
        return wanted
    return None


def split_input(
    node: Node,
    side: tuple[bool, ...],
    grads: tuple[torch.Tensor | None, ...],
    tell: Callable[[type, str], None],
) -> tuple[tuple[Gradient, ...], FunctionSplit] | None:
    """Run the input pass of ``node``'s split backward on ``grads``: the gradients to return
    (one per argument of the forward; None for the weight-side ones) and what W needs, or None
    when it does not split (``tell(cls, why)`` is called with the reason; the caller runs the
    backward as written)."""
    cls = forward_cls(node)
    if cls is None or torch.is_grad_enabled():
        return None  # a create_graph backward: as written
    positions = _positions(node)
    if positions is None:
        tell(cls, NOT_TENSOR_POSITIONS.why)
        return None
    needs = node.needs_input_grad  # type: ignore[attr-defined]
    n_args = len(needs)
    by_pos: list[str | None] = [None] * n_args
    for p in positions:
        by_pos[p] = f"arg{p}"
    names = tuple(by_pos)
    edges: list[tuple[str, Node, int]] = []
    for p, (fn, nr), w in zip(positions, node.next_functions, side):
        if w and needs[p] and fn is not None:
            edges.append((f"arg{p}", fn, nr))
    weights = tuple(name for name, _, _ in edges)
    requires = frozenset(f"arg{p}" for p in positions if needs[p])
    found = of_node(node)
    if found is None:
        return None  # freed: the backward as written raises torch's error
    key = (cls, names, weights)
    splitter = _splitter(cls, names, weights)
    sizes = _SIZES.setdefault(key, _Sizes())
    ctx, saved = sizes.hand(found)
    outcome = splitter.find(ctx, saved, grads, requires)
    if ctx is not found and isinstance(outcome, Fallback) and outcome not in _NOW:
        sizes.lifting = False  # a backward that needs them as constants: as they are, again
        ctx, saved = found, found.saved_tensors
        outcome = splitter.find(ctx, saved, grads, requires)
    if isinstance(outcome, Fallback):
        if outcome.logged:
            tell(cls, outcome.why)
        return None
    needed = requires - frozenset(weights)
    work = FunctionSplit(node, outcome, saved, grads, edges)
    result = work.input_pass(needed)
    SPLIT.add(cls)
    out = tuple(result.get(n) if n is not None and n in needed else None for n in names)
    return out, work
