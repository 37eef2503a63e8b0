"""The weight pass (W) of a stage's split backward: :func:`stage_backward_weight`.

W sends what :func:`customgrad.pipelining.stage_backward_input` left in its
:class:`~customgrad.pipelining._split_state.SplitState` through the engine, one call per
:class:`customgrad._split_plan.WeightCall`: the deferred customgrad weight halves, the weight
work of plain Functions that ran or split in I, and the nodes of I run again for their weight
side (native intermediates asked for it, Functions and compiled regions clamped to it, every
routed node by its W route).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator

import torch
from torch.autograd.graph import GradientEdge, Node

from customgrad._routing import routing
from customgrad._split_plan import WeightCall, is_leaf_accumulator, reach
from customgrad._torch.functions import skipping
from customgrad.pipelining._function_split import FunctionSplit
from customgrad.pipelining._send import ask_weight_sides, send_gradients, weight_side_only
from customgrad.pipelining._split_state import SplitState, runtime_errors, state_of

__all__ = ["stage_backward_weight"]


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
    """W's engine call number ``index`` (see :class:`customgrad._split_plan.WeightCall`)."""
    plan = state.plan
    roots: list[GradientEdge] = []
    values: list[torch.Tensor] = []
    for group, skip_again in state.asked_once.pop(index, []):
        with skipping(skip_again):
            _run_again(state, group)
    skip = state.skip.pop(index, [])
    clamp = call.clamp
    if call.asked:
        asked = [(n, plan.weight_side_edges(n), state.captured.pop(n, ())) for n in call.asked]
        if not ask_weight_sides(asked, roots, values, state.watch):  # else the engine, clamped
            for node, _, grads in asked:
                state.captured[node] = grads
            call = dataclasses.replace(call, intermediates=[*call.asked, *call.intermediates])
            clamp = [*call.asked, *clamp]
            skip = [n for n in skip if n not in clamp]
        del asked
    for node in call.intermediates:
        grads = state.captured.pop(node, ())
        for i, g in enumerate(grads):
            if g is not None:
                roots.append(GradientEdge(node, i))
                values.append(g)
        del grads
    for i in call.direct:
        node, nr, g = state.direct.pop(i)
        roots.append(GradientEdge(node, nr))
        values.append(g)
    ran = state.once.pop(index, [])
    while ran:
        value = ran.pop(0)  # send_gradients must hold the only references (see there)
        if isinstance(value, FunctionSplit):
            owner = value.node()
            watching = (
                state.watch(owner)
                if state.watch is not None and owner is not None
                else contextlib.nullcontext()
            )
            del owner
            with watching, torch.no_grad():  # its weight pass, as inside the engine
                split_edges, split_grads = value.gradients()
            roots.extend(split_edges)
            values.extend(split_grads)
            del split_edges, split_grads
        else:
            roots.extend(edge for edge, _ in value)
            values.extend(grad for _, grad in value)
        del value  # send_gradients must hold the only references (see there)
    deferred = state.deferred
    if len(state.plan.weight_calls) == 1:  # all of it belongs to this call
        works = [*deferred.values()]
        deferred.clear()
    else:  # in the order I handed them over
        mine = set(call.deferred)
        works = [deferred.pop(r) for r in [r for r in deferred if r in mine]]
    for work in works:
        with torch.no_grad():  # as inside the engine: no graph of the weight halves' own ops
            half_edges, half_grads = work.gradients()
        roots.extend(half_edges)
        values.extend(half_grads)
        del half_edges, half_grads  # send_gradients must hold the only references (see there)
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
        side = state.plan.weight_side_edges(node)
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
