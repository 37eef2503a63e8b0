"""The weight pass (W) of a stage's split backward: :func:`stage_backward_weight`, and the
engine calls it is made of.

W sends what :func:`customgrad.pipelining.stage_backward_input` left in its
:class:`~customgrad.pipelining._split_state.SplitState` through the engine, one call per
:class:`customgrad._split_plan.WeightCall`: the deferred customgrad weight halves, the weight
work of plain Functions that ran or split in I, and the nodes of I run again for their weight
side (native intermediates asked for it, :func:`ask_weight_sides`; Functions and compiled
regions clamped to it, :func:`weight_side_only`; every routed node by its W route).
:func:`send_gradients` runs ``torch.autograd.backward`` from gradients computed before it ran
(handed over from I), without copying those bound for a leaf (the weight-gradient queue's W
sends its work with it too).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeAlias, cast

import torch
from torch.autograd.function import FunctionCtx
from torch.autograd.graph import GradientEdge, Node

from customgrad._record import record_of
from customgrad._routing import routing
from customgrad._split_plan import Watch, WeightCall, is_leaf_accumulator, is_native, reach
from customgrad._torch.engine import input_shape
from customgrad._torch.functions import skipping
from customgrad.pipelining._split_state import Resend, SplitState, runtime_errors, state_of

__all__ = [
    "Grads",
    "ask_weight_sides",
    "send_gradients",
    "stage_backward_weight",
    "weight_side_only",
]

Grads: TypeAlias = tuple[torch.Tensor | None, ...]
_NOTHING = contextlib.nullcontext()


def weight_side_only(side: tuple[bool, ...]) -> Callable[[Grads, Grads], Grads]:
    """A post-hook that drops what a node sends along the edges ``side`` does not mark."""

    def hook(grad_inputs: Grads, grad_outputs: Grads) -> Grads:
        return tuple(g if w else None for g, w in zip(grad_inputs, side))

    return hook


class _Ctx(FunctionCtx):
    """The ctx of the two Functions below, with what their forwards keep on it."""

    ask: Callable[[], None]
    holder: list[list[torch.Tensor]]


class _Asking(torch.autograd.Function):
    """A node whose backward runs ``ask()``: an engine call made only to run it, whose
    ``inputs=`` name the edges ``ask`` wants gradients on (see :func:`ask_weight_sides`)."""

    @staticmethod
    def forward(ctx: _Ctx, ask: Callable[[], None], anchor: torch.Tensor) -> torch.Tensor:
        ctx.ask = ask
        return anchor.new_zeros(())

    @staticmethod
    def backward(ctx: _Ctx, grad: torch.Tensor) -> tuple[None, None]:
        ctx.ask()
        return None, None


def ask_weight_sides(
    asked: list[tuple[Node, tuple[bool, ...], tuple[torch.Tensor | None, ...]]],
    roots: list[GradientEdge],
    values: list[torch.Tensor],
    watch: Watch | None = None,
) -> bool:
    """Call each node of ``asked`` (node, which of its edges lead to the weight side,
    the gradients that reached it in I) for its weight-side outputs only; append each to
    ``roots``/``values`` with its edge. False (nothing done) where torch does not say what
    shape a node on those edges takes (``_input_metadata``, read as torch's own
    ``autograd.backward`` reads it for a ``GradientEdge``).

    A native node computes an output only where the running engine call wants its edge's node
    (``task_should_compute_output``). Run inside an engine call whose ``inputs=`` are exactly
    those edges, and that reaches none of them (its only path leads to a fresh anchor), the
    node computes its weight-side outputs and nothing along its input edges, even where those
    lead to the same weights (a weight it shares with a layer before it, where an engine call
    from the node itself would compute its input gradient again, as torch's weight pass does).
    The engine reaches no node of the stage's graph: no hook fires (the nodes the outputs go
    to run later, once, in the call these gradients join), and the node's own hooks already
    fired in I. Any other output it computes anyway is dropped (I sent it already). An output
    that broadcast in the forward (a bias) is summed to its edge's shape, as the engine does
    with what a node returns (a leaf's accumulator takes it as it is: the hand-over does).
    """
    wanted: dict[tuple[Node, int], torch.Size | None] = {}
    for node, side, grads in asked:
        if not is_native(node) and any(g is None for g in grads):
            return False  # the engine would hand a Function's backward zeros there
        for (fn, nr), weight in zip(node.next_functions, side):
            if weight and fn is not None:
                if is_leaf_accumulator(fn):
                    wanted[fn, nr] = None
                else:
                    shape = input_shape(fn, nr)
                    if shape is None:
                        return False
                    wanted[fn, nr] = shape
    if not wanted:
        return True

    def ask() -> None:
        for node, side, grads in asked:
            if not any(g is not None for g in grads):
                continue
            # A customgrad node computes what its W route says; a native one what the running
            # engine call wants.
            with contextlib.nullcontext() if watch is None else watch(node):
                if is_native(node):
                    outputs = list(cast(Callable[..., Sequence[Any]], node)(*grads))
                else:
                    apply = cast(Callable[..., Sequence[Any]], getattr(node, "apply"))  # noqa: B009
                    outputs = _edge_outputs(node, apply(*grads))
            for (fn, nr), weight in zip(node.next_functions, side):
                g = outputs.pop(0)
                if weight and fn is not None and g is not None:
                    shape = wanted[fn, nr]
                    if shape is not None and g.shape != shape:
                        g = g.sum_to_size(shape)
                    roots.append(GradientEdge(fn, nr))
                    values.append(g)
                del g  # send_gradients must hold the only references (see there)

    anchor = torch.zeros((), requires_grad=True)
    with torch.enable_grad():
        out = _Asking.apply(ask, anchor)  # type: ignore[no-untyped-call]
    edges = [GradientEdge(fn, nr) for fn, nr in wanted]
    torch.autograd.grad(
        [out],
        [anchor, *edges],  # type: ignore[arg-type]
        [torch.zeros(())],
        allow_unused=True,
    )
    return True


def _edge_outputs(node: Node, outputs: Sequence[Any]) -> list[Any]:
    """What a customgrad node's backward returned, one per edge (``next_functions``): its
    backward returns one gradient per argument of its Function, the non-Tensor ones included
    (the kernel and the call first, then the flattened arguments)."""
    record = record_of(node)
    assert record is not None
    return [outputs[2 + i] for i, meta in enumerate(record.metas) if meta is not None]


class _HandOver(torch.autograd.Function):
    """A node whose backward returns gradients computed before it ran, one per leaf input.

    The autograd engine lets a leaf's ``AccumulateGrad`` keep an incoming gradient as ``.grad``
    only when nothing else references it; gradients passed to ``torch.autograd.backward`` as
    ``grad_tensors`` are referenced by the caller (and the engine's graph root), so each is
    copied into a new ``.grad``: a weight-sized copy per weight. Returned from a node's backward,
    they are not.
    """

    @staticmethod
    def forward(ctx: _Ctx, holder: list[list[torch.Tensor]], *leaves: torch.Tensor) -> torch.Tensor:
        ctx.holder = holder
        return leaves[0].new_zeros(())

    @staticmethod
    def backward(ctx: _Ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, *ctx.holder.pop())


def send_gradients(
    roots: list[GradientEdge],
    values: list[torch.Tensor],
    inputs: list[torch.Tensor] | None = None,
    retain_graph: bool = False,
) -> None:
    """``torch.autograd.backward(roots, values, ...)``, emptying ``values``: gradients bound for
    a leaf's accumulator become its ``.grad`` without a copy when the caller holds no other
    reference to them (see :class:`_HandOver`); hooks and accumulation are the engine's."""
    leaves: list[torch.Tensor] = []
    handed: list[torch.Tensor] = []
    other_roots: list[torch.Tensor | GradientEdge] = []
    other_values: list[torch.Tensor] = []
    grad: torch.Tensor | None = None
    for edge, grad in zip(roots, values):
        if is_leaf_accumulator(edge.node):
            leaves.append(edge.node.variable)  # type: ignore[attr-defined]
            handed.append(grad)
        else:
            other_roots.append(edge)
            other_values.append(grad)
    values.clear()
    grad = None  # no reference left here to what is handed over
    if leaves:
        with torch.enable_grad():
            out = _HandOver.apply([handed], *leaves)  # type: ignore[no-untyped-call]
        del handed
        other_roots.append(out)
        other_values.append(torch.zeros_like(out))
    if other_roots:
        torch.autograd.backward(
            other_roots,  # type: ignore[arg-type]
            grad_tensors=other_values,
            inputs=inputs,
            retain_graph=retain_graph,
        )


def stage_backward_weight(
    weights: Iterator[torch.nn.Parameter] | Iterable[torch.Tensor],
    param_groups: list[dict[str, object]],
    retain_graph: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """Compute the weights' gradients (W) that :func:`stage_backward_input` set aside.

    Gradients accumulate into ``.grad`` through the autograd engine in one call: one
    accumulation per weight, tensor hooks and post-accumulate-grad hooks fire once each, as in
    a full backward (torch's own ``stage_backward_weight`` fires no post-accumulate-grad hooks).

    Args:
        weights: the stage's weights (e.g. ``module.parameters()``).
        param_groups: what :func:`stage_backward_input` returned; usable once.
        retain_graph: keep the graph's buffers for another backward through it.

    Returns:
        Each weight's ``.grad`` as it was when W started, as torch 2.13's
        ``stage_backward_weight`` returns it: ``None`` for a weight without a gradient yet,
        else the tensor W then accumulates into.

    Raises:
        SplitStateError: ``param_groups`` were already used, or came from somewhere else.
    """
    with runtime_errors():
        weight_list = [w for w in weights if isinstance(w, torch.Tensor)]
        grads_before = tuple(w.grad for w in weight_list)
        state = state_of(param_groups)
        state.done = True
        try:
            _run_weight_pass(state, retain_graph)
        finally:
            state.clear()
        return grads_before


def _run_weight_pass(state: SplitState, retain_graph: bool) -> None:
    # Only nodes the plan deferred hand work over (their routes name this state), so every
    # piece of deferred work belongs to one of the plan's calls.
    plan = state.plan
    calls = plan.weight_calls
    last = len(calls) - 1
    with routing(plan.weight_routes):
        for i, call in enumerate(calls):
            _run_weight_call(state, i, call, retain_graph or i < last)


def _run_weight_call(state: SplitState, index: int, call: WeightCall, retain_graph: bool) -> None:
    """W's engine call number ``index`` (see :class:`customgrad._split_plan.WeightCall`): the
    Function nodes it runs again in calls of their own first, then its pieces of weight work
    and the nodes it asks for their weight side, sent through the engine in one call."""
    plan = state.plan
    for group, skip_again in state.asked_once.pop(index, []):
        with skipping(skip_again):
            _run_again(state, group)
    roots: list[GradientEdge] = []
    values: list[torch.Tensor] = []
    skip = state.skip.pop(index, [])
    clamp = call.clamp
    work = state.work.pop(index, [])
    if call.asked:
        asked = [(n, plan.weight_side_edges(n), state.captured.pop(n, ())) for n in call.asked]
        if not ask_weight_sides(asked, roots, values, state.watching):
            # torch does not say what the weight side takes: the engine runs them, clamped
            work = [*(Resend.of(n, grads) for n, _, grads in asked), *work]
            clamp = [*call.asked, *clamp]
            skip = [n for n in skip if n not in clamp]
        del asked
    watch = state.watching
    while work:
        piece = work.pop(0)  # send_gradients must hold the only references (see there)
        owner = None if watch is None else piece.owner()
        watching = _NOTHING if watch is None or owner is None else watch(owner)
        with watching, torch.no_grad():  # as inside the engine
            edges, grads = piece.gradients()
        roots.extend(edges)
        values.extend(grads)
        del piece, edges, grads, owner, watching
    if not roots:
        return
    # A plain Function or customgrad intermediate whose input edges lead to this call's leaves
    # (a weight it shares with a layer before it) sends its input gradients again: drop them
    # (I sent them already). Native ones were asked for their weight side only, above.
    handles = [n.register_hook(weight_side_only(plan.weight_side_edges(n))) for n in clamp]
    leaves = [v for n in call.leaves if isinstance(v := getattr(n, "variable", None),
                                                     torch.Tensor)]  # fmt: skip
    try:
        with skipping(skip):
            send_gradients(roots, values, inputs=leaves or None, retain_graph=retain_graph)
    finally:
        for h in handles:
            h.remove()


def _run_again(state: SplitState, nodes: list[Node]) -> None:
    """Run the Function nodes of I whose backward returned no gradient for a weight-side edge
    (it asks the engine what the pass needs, as a compiled region's does) again, from the
    output gradients that reached them in I, in an engine call of their own that accumulates
    only the leaves below their weight-side edges: they then compute those edges' gradients
    (W drops what they send along their other edges, which I sent already), and their input
    gradient too only where their input edges lead to those leaves as well (a layer below
    them uses the same weight: the engine cannot want one of two edges that lead to one leaf).
    The Functions the call reaches below them compute nothing (the caller skips them)."""
    roots: list[GradientEdge] = []
    values: list[torch.Tensor] = []
    starts: list[Node] = []
    handles = []
    for node in nodes:
        side = state.plan.weight_side_edges(node, regions=False)  # (I sent those into regions)
        grads = state.captured.pop(node, ())
        roots += [GradientEdge(node, i) for i, g in enumerate(grads) if g is not None]
        values += [g for g in grads if g is not None]
        starts += [fn for (fn, _), w in zip(node.next_functions, side) if w and fn is not None]
        handles.append(node.register_hook(weight_side_only(side)))
        del grads
    leaves = [
        v
        for n in reach(starts, set())
        if is_leaf_accumulator(n) and isinstance(v := getattr(n, "variable", None), torch.Tensor)
    ]
    try:
        if roots and leaves:
            send_gradients(roots, values, inputs=leaves, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
