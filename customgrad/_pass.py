"""What one backward call of a customgrad node computes: its pass plan and what it sees.

A :class:`PassPlan` is decided once per (op, arguments that require grad, arguments the pass
needs): the phase, which registered functions run, what is left for a later pass and whether
this pass keeps what it computed for it (:func:`keeps_for_later`). Its runner, the plan
executed (which calls the registered functions, refuses in-place writes, validates, applies the
run-once rule and keeps or frees the hand-off), is written by :mod:`customgrad._codegen`. The
functions a backward calls see a :class:`BackwardContext`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from customgrad._errors import MissingRegistrationError
from customgrad._handoff import NO_HANDOFF
from customgrad._record import NodeRecord
from customgrad._rules import BackwardContext, OpSpec, Phase
from customgrad._runtime import keep_shared, shared_of
from customgrad._torch.engine import graph_kept, graph_task_id
from customgrad._user_calls import _call_user, _Watch

if TYPE_CHECKING:
    from customgrad._autosplit import AutoSplitter, TracedSplit
    from customgrad._routing import DeferTarget

__all__ = [
    "BackwardContext",
    "BackwardObserver",
    "PassPlan",
    "Phase",
    "auto_split",
    "keeps_for_later",
    "pass_plan",
]

BackwardObserver = Callable[[str, Phase, "BackwardContext", object], None]
"""Called as ``observer(label, phase, ctx, result)`` after each registered backward function
runs (``label``: ``"backward"``, ``"backward_input"``, ``"backward_weight"``,
``"backward_shared"``, or ``"backward (traced input part)"`` and the like for an automatic
split; ``result``: what the function returned, as it returned it)."""


_grad_enabled = torch.is_grad_enabled
_graph_task_id = graph_task_id


# --------------------------------------------------------------------------------------------
# What a backward function sees


class _Shared:
    """``ctx.shared`` of one backward call: computed at most once, kept for a later pass."""

    __slots__ = ("computed", "grads", "keep", "record", "saved", "value", "watch")

    def __init__(
        self,
        record: NodeRecord,
        saved: object,
        grads: tuple[object, ...],
        watch: _Watch,
        keep: bool,
    ) -> None:
        self.record = record
        self.saved = saved
        self.grads = grads
        self.watch = watch
        self.keep = keep
        self.value: Any = shared_of(record, grads)
        self.computed = False  # by this call (not handed over from an earlier pass)

    def get(self, ctx: BackwardContext) -> object:
        if self.value is NO_HANDOFF:
            spec = self.record.op
            fn = spec.rules.backward_shared
            if fn is None:
                raise MissingRegistrationError(
                    f"{spec.name}: ctx.shared was read, but no shared work is registered. "
                    f"Register the work both halves need:\n\n"
                    f"    @{spec.name.split('::')[1]}.register_backward_shared\n"
                    f"    def _(ctx, saved, grad):\n"
                    f"        return grad @ saved.w_down      # read as ctx.shared\n"
                )
            nondiff = spec.rules.nondifferentiable
            self.value = _call_user(ctx, "shared", fn, self.saved, self.grads, self.watch, nondiff)
            self.computed = True
            if self.keep:
                keep_shared(self.record, self.grads, self.value)
        return self.value


def keeps_for_later(plan: PassPlan, target: DeferTarget | None) -> bool:
    """Whether a pass keeps what it computed for the node's later pass: when gradients that
    require grad are left for a later pass and that pass can come (the graph is retained, or a
    route defers the weight half to ``target``). A non-retaining partial pass frees everything
    at once."""
    if target is not None:
        return bool(plan.later_weight) and bool(plan.needed)
    return bool(plan.later_weight or plan.later_input) and bool(plan.needed) and graph_kept()


class PassPlan(NamedTuple):
    """What one backward call of a node computes, from which arguments require grad and which
    the pass needs (argument names)."""

    phase: Phase
    needed: frozenset[str]
    need_input: frozenset[str]
    need_weight: frozenset[str]
    later_weight: frozenset[str]
    """Weights that require grad but that this pass does not compute (a later pass will, or a
    route takes them)."""
    later_input: frozenset[str]
    """Non-weight arguments that require grad but that this pass does not compute."""
    ctx: BackwardContext
    """The backward functions' context for this plan when the op registers no shared work
    (a context is read-only then, so every call with this plan shares one)."""
    requires: frozenset[str]
    """Every argument of the node that requires grad (``needed | later_weight | later_input``)."""
    key: tuple[int, int]
    """(arguments that require grad, arguments needed) as bit masks (bit ``i``: argument
    ``i``): the plan's key among its op's plans and runners."""


def pass_plan(
    spec: OpSpec, requires: frozenset[str], needed: frozenset[str], key: tuple[int, int]
) -> PassPlan:
    """The plan for a call where ``requires`` require grad and the pass needs ``needed``
    (``key``: the same as argument bit masks)."""
    sig = spec.signature
    need_weight = needed & sig.weight_set
    need_input = needed - sig.weight_set
    if needed >= requires or (need_weight and need_input):
        phase: Phase = "full"
    else:
        phase = "weight" if need_weight else "input"
    later = requires - needed
    later_weight = later & sig.weight_set
    later_input = later - sig.weight_set
    ctx = BackwardContext(spec, phase, needed)
    return PassPlan(
        phase,
        needed,
        need_input,
        need_weight,
        later_weight,
        later_input,
        ctx,
        requires,
        key,
    )


def auto_split(
    record: NodeRecord,
    auto: AutoSplitter,
    make_ctx: Callable[[frozenset[str]], BackwardContext],
    saved: object,
    grads: tuple[object, ...],
    requires: frozenset[str],
) -> TracedSplit | None:
    """The node's traced split (``auto``: the op's ``AutoSplitter``), or None to call
    the single backward as it is. ``requires``: the arguments of the node that require grad."""
    if _grad_enabled() and _graph_task_id() != -1:
        # A create_graph backward (double backward): call the backward as written, so its
        # gradients are differentiable exactly as the user wrote them.
        return None
    split = record.traced
    layout = _layout_of(grads)
    if split is None or layout != record.traced_grads:
        # A node's first backward, or a backward of a retained graph with output gradients of
        # another layout (other strides select another trace).
        split = auto.select(make_ctx, saved, grads, requires)
        record.traced = split if split is not None else False
        record.traced_grads = layout
    return split or None  # type: ignore[return-value]  # what select chose: a TracedSplit


def _layout_of(grads: tuple[Any, ...]) -> Any:
    """What of the output gradients selects a trace besides the saved values: their shapes,
    strides and dtypes (a key that holds no tensor)."""
    if len(grads) == 1:
        (g,) = grads
        if type(g) is torch.Tensor:
            return (g.shape, g.stride(), g.dtype)
    return tuple(
        (g.shape, g.stride(), g.dtype)
        if isinstance(g, torch.Tensor)
        else tuple((t.shape, t.stride(), t.dtype) if isinstance(t, torch.Tensor) else t for t in g)
        if isinstance(g, list)
        else g
        for g in grads
    )
