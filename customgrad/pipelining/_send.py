"""Sending gradients through the autograd engine for the weight pass.

:func:`send_gradients` runs ``torch.autograd.backward`` from gradients computed before it ran
(handed over from I), without copying those bound for a leaf; :func:`ask_weight_sides` calls
nodes of I again for their weight-side outputs only, inside an engine call that wants exactly
those; :func:`weight_side_only` is the post-hook that drops what a node run again sends along
its other edges.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, cast

import torch
from torch.autograd.function import FunctionCtx
from torch.autograd.graph import GradientEdge, Node

from customgrad._record import record_of
from customgrad._split_plan import is_leaf_accumulator, is_native
from customgrad._torch.engine import input_shape
from customgrad.pipelining._split_state import Watch

__all__ = ["Grads", "ask_weight_sides", "send_gradients", "weight_side_only"]

Grads: TypeAlias = tuple[torch.Tensor | None, ...]


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
