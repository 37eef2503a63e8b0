"""Autograd for customgrad ops: one ``torch.autograd.Function`` that knows which pass it is in.

The node's backward asks the autograd engine which of its input edges the running graph task
will use (``torch._C._will_engine_execute_node``). That is what lets torch's split backward
(``stage_backward_input`` then ``stage_backward_weight``) run the input half of a customgrad op in
the first pass and the weight half in the second, with nothing computed twice.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

import optree
import torch
from torch.autograd.graph import GradientEdge

from customgrad._errors import GradientValueError, MissingRegistrationError
from customgrad._signature import ArgKind, Signature
from customgrad._validate import Meta, TensorMeta, collect_flat, collect_grads

if TYPE_CHECKING:
    from customgrad._op import CustomOp

__all__ = [
    "DEFER_RESOLVERS",
    "FORWARD_TAG",
    "BackwardContext",
    "DeferTarget",
    "Phase",
    "apply",
    "engine_needs",
]

log = logging.getLogger("customgrad")

Phase = Literal["full", "input", "weight"]

FORWARD_TAG: contextvars.ContextVar[object | None] = contextvars.ContextVar(
    "customgrad_forward_tag", default=None
)
"""Read when a customgrad op runs forward and stored on its autograd node as ``node._cg_tag``."""


class DeferTarget(Protocol):
    """Where a customgrad op puts its weight-gradient work when a resolver asks it to."""

    def defer(self, node: Any, run: Callable[[], None]) -> None: ...


DEFER_RESOLVERS: list[Callable[[Any], DeferTarget | None]] = []
"""Consulted by every customgrad backward; the first target returned gets the weight work."""

_will_execute: Callable[[Any], bool] | None = getattr(torch._C, "_will_engine_execute_node", None)
_warned_no_engine_query = False

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_functorch_active: Callable[[], bool] | None = getattr(
    torch._C, "_are_functorch_transforms_active", None
)
_unwrap_if_dead: Callable[[Any], Any] | None = getattr(
    getattr(torch._C, "_functorch", None), "unwrap_if_dead", None
)
_OPAQUE_LEAVES = (type(None), bool, int, float, str)

FIND_KERNEL: Any = object()
"""Passed as ``apply``'s kernel when the caller has not looked for a direct kernel."""

# What ``node._cg_saved`` holds when ``save_for_backward`` returned something simple.
_SAVED_NONE: Any = object()  # None
_SAVED_TENSOR: Any = object()  # one Tensor: saved_tensors[0]
_SAVED_TENSORS: Any = object()  # a tuple of Tensors: saved_tensors


def engine_needs(fn: Any) -> bool:
    """Whether the running graph task will use the gradient sent along an edge to ``fn``.

    Any error (outside a backward, a leaf captured by ``autograd.grad``) means "needed".
    """
    global _warned_no_engine_query
    if _will_execute is None:
        if not _warned_no_engine_query:
            _warned_no_engine_query = True
            log.warning(
                "customgrad: this torch has no torch._C._will_engine_execute_node; split "
                "backward falls back to computing every gradient in every pass."
            )
        return True
    try:
        return _will_execute(fn)
    except Exception:
        return True


class BackwardContext:
    """What a customgrad backward function is told about the running pass.

    Attributes:
        op: the :class:`~customgrad.CustomOp` whose backward runs.
        phase: ``"input"`` when the pass needs only non-weight arguments' gradients,
            ``"weight"`` when it needs only weights', ``"full"`` otherwise (every argument that
            requires grad is needed, or some of each kind are).
    """

    __slots__ = ("_needed", "op", "phase")

    def __init__(
        self, op: CustomOp[..., Any], phase: Phase, needed: set[str] | frozenset[str]
    ) -> None:
        self.op = op
        self.phase: Phase = phase
        self._needed = needed

    def needs_input_grad(self, name: str) -> bool:
        """True if argument ``name`` requires grad and the engine will use its gradient now."""
        if name not in self.op._sig.index:
            raise GradientValueError(
                f"{self.op.name}: ctx.needs_input_grad({name!r}): no such argument. "
                f"Arguments: {', '.join(self.op._sig.names)}."
            )
        return name in self._needed

    def __repr__(self) -> str:
        return (
            f"BackwardContext(op={self.op.name!r}, phase={self.phase!r}, "
            f"needed={sorted(self._needed)})"
        )


def _flatten_args(sig: Signature, args: tuple[Any, ...]) -> tuple[tuple[int, ...], list[Any]]:
    """List arguments' items inline, with each list's length."""
    lens: list[int] = []
    flat: list[Any] = []
    for spec, a in zip(sig.args, args):
        if spec.kind is ArgKind.TENSOR_LIST:
            items = list(a)
            lens.append(len(items))
            flat.extend(items)
        else:
            flat.append(a)
    return tuple(lens), flat


def _unflatten_args(sig: Signature, lens: tuple[int, ...], flat: Sequence[Any]) -> tuple[Any, ...]:
    out: list[Any] = []
    pos = 0
    li = 0
    for spec in sig.args:
        if spec.kind is ArgKind.TENSOR_LIST:
            n = lens[li]
            li += 1
            out.append(list(flat[pos : pos + n]))
            pos += n
        else:
            out.append(flat[pos])
            pos += 1
    return tuple(out)


def _slots(sig: Signature, lens: tuple[int, ...] | None) -> dict[str, tuple[int, int | None]]:
    """Map each argument name to (first flat position, list length or None)."""
    if lens is None:
        return sig.flat_slots
    slots: dict[str, tuple[int, int | None]] = {}
    pos = 0
    li = 0
    for spec in sig.args:
        if spec.kind is ArgKind.TENSOR_LIST:
            slots[spec.name] = (pos, lens[li])
            pos += lens[li]
            li += 1
        else:
            slots[spec.name] = (pos, None)
            pos += 1
    return slots


class _CustomGradFunction(torch.autograd.Function):
    """The autograd node of every customgrad op call (ctx is the node)."""

    @staticmethod
    def forward(ctx: Any, op: CustomOp[..., Any], call: list[Any], *flat: Any) -> Any:
        sig = op._sig
        lens: tuple[int, ...] | None = call[0]
        args = flat if lens is None else _unflatten_args(sig, lens, flat)
        kernel = call[2]
        if kernel is FIND_KERNEL:
            kernel = op._direct_kernel(args)
        if kernel is None:
            with torch._C._AutoDispatchBelowAutograd():
                out = sig.call(op._opoverload, args)
        elif sig.kwonly_names:
            out = sig.call(kernel, args)
        else:
            out = kernel(*args)
        save_fn = op._save_fn
        if save_fn is None:  # registrations changed between the check and here
            raise MissingRegistrationError(op._missing_autograd_message())
        saved = save_fn(tuple.__new__(sig.inputs_type, args), out)
        _save(ctx, saved)
        ctx._cg_op = op
        if lens is not None:
            ctx._cg_lens = lens
        ctx._cg_meta = [
            (a.shape, a.dtype, a.device) if isinstance(a, _Tensor) else None for a in flat
        ]
        tag = FORWARD_TAG.get()
        if tag is not None:
            ctx._cg_tag = tag
        if sig.plain_output:
            return out

        if sig.output_is_tuple or sig.output_kinds[0] is ArgKind.TENSOR_LIST:
            outs = out if sig.output_is_tuple else (out,)
            flat_out: list[torch.Tensor] = []
            out_lens: list[int | None] = []
            for kind, o in zip(sig.output_kinds, outs):
                if kind is ArgKind.TENSOR_LIST:
                    out_lens.append(len(o))
                    flat_out.extend(o)
                else:
                    out_lens.append(None)
                    flat_out.append(o)
            ctx._cg_out_lens = out_lens
            call[1] = out_lens
            _mark_outputs(ctx, sig, out_lens, flat_out)
            return tuple(flat_out)
        if sig.output_differentiability is not None and not sig.output_differentiability[0]:
            ctx.mark_non_differentiable(out)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        return _backward(ctx, grads)


def _node_apply(node: Any, *grads: Any) -> Any:
    """What the engine calls to run a customgrad node (``BackwardCFunction.apply``, inlined)."""
    return _backward(node, grads)


# Node attributes that are None unless the forward sets them (one store less per call).
_node_cls: Any = _CustomGradFunction._backward_cls
_node_cls._cg_lens = None
_node_cls._cg_tag = None
_node_cls._cg_out_lens = None

# The engine runs a node by calling its ``apply``; torch's calls ``backward`` through two more
# Python frames. The class is this Function's own node class, made by its metaclass.
_node_cls.apply = _node_apply

_Function_apply: Callable[..., Any] = _CustomGradFunction.apply
# What ``Function.apply`` ends in when no functorch transform is active.
_c_apply: Callable[..., Any] = super(torch.autograd.Function, _CustomGradFunction).apply


def _save(ctx: Any, saved: Any) -> None:
    """Keep what ``save_for_backward`` returned: its tensors through ``ctx.save_for_backward``."""
    if saved is None:
        ctx._cg_saved = _SAVED_NONE
        return
    kind = type(saved)
    if kind is _Tensor or kind is _Parameter:
        ctx.save_for_backward(saved)
        ctx._cg_saved = _SAVED_TENSOR
        return
    if kind is tuple:
        for v in saved:
            k = type(v)
            if k is not _Tensor and k is not _Parameter:
                break
        else:  # a tuple of Tensors: saved_tensors as it is
            ctx.save_for_backward(*saved)
            ctx._cg_saved = _SAVED_TENSORS
            return
        tensor_idx: list[int] = []
        for i, v in enumerate(saved):
            k = type(v)
            if k is _Tensor or k is _Parameter:
                tensor_idx.append(i)
            elif k not in _OPAQUE_LEAVES:
                break
        else:  # a flat tuple of leaves: no pytree needed
            leaves = list(saved)
            if tensor_idx:
                ctx.save_for_backward(*[leaves[i] for i in tensor_idx])
                for i in tensor_idx:
                    leaves[i] = None
            ctx._cg_saved = (leaves, None, tensor_idx)
            return
    leaves, treespec = optree.tree_flatten(saved, none_is_leaf=True)
    tensor_idx = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if tensor_idx:
        ctx.save_for_backward(*[leaves[i] for i in tensor_idx])
        for i in tensor_idx:
            leaves[i] = None
    ctx._cg_saved = (leaves, treespec, tensor_idx)


def _mark_outputs(
    ctx: Any, sig: Signature, out_lens: list[int | None], flat_out: list[torch.Tensor]
) -> None:
    diff = sig.output_differentiability
    if diff is None:
        return
    pos = 0
    marked: list[torch.Tensor] = []
    for d, n in zip(diff, out_lens):
        k = 1 if n is None else n
        if not d:
            marked.extend(flat_out[pos : pos + k])
        pos += k
    if marked:
        ctx.mark_non_differentiable(*marked)


def _regroup_grads(
    sig: Signature, out_lens: list[int | None] | None, grads: tuple[Any, ...]
) -> Any:
    if out_lens is None:
        return grads
    out: list[Any] = []
    pos = 0
    for n in out_lens:
        if n is None:
            out.append(grads[pos])
            pos += 1
        else:
            out.append(list(grads[pos : pos + n]))
            pos += n
    return tuple(out)


def _restore_saved(ctx: Any) -> Any:
    kept = ctx._cg_saved
    if kept is _SAVED_TENSORS:
        return ctx.saved_tensors
    if kept is _SAVED_TENSOR:
        return ctx.saved_tensors[0]
    if kept is _SAVED_NONE:
        return None
    leaves, treespec, tensor_idx = kept
    if tensor_idx:
        leaves = list(leaves)
        for i, t in zip(tensor_idx, ctx.saved_tensors):
            leaves[i] = t
    if treespec is None:
        return tuple(leaves)
    return optree.tree_unflatten(treespec, leaves)


_NO_TARGET: Any = object()


def _backward(ctx: Any, grads: tuple[Any, ...]) -> tuple[Any, ...]:
    op: CustomOp[..., Any] = ctx._cg_op
    sig = op._sig
    will_execute = _will_execute
    if not sig.flat_node or will_execute is None:
        return _backward_general(ctx, grads, _NO_TARGET)
    if DEFER_RESOLVERS:
        target = _resolve_defer(ctx)
        if target is not None:
            return _backward_general(ctx, grads, target)

    # No list arguments or outputs: one bit pair per argument (requires grad, needed now)
    # indexes a cached plan of the pass.
    metas: list[TensorMeta] = ctx._cg_meta
    req = ctx.needs_input_grad  # (op, call, *args)
    next_fns = None
    mask = 0
    bit = 1
    edge = 0
    for m, r in zip(metas, req[2:]):
        if m is not None:
            if r:
                if next_fns is None:
                    next_fns = ctx.next_functions
                try:
                    mask |= bit * 3 if will_execute(next_fns[edge][0]) else bit
                except Exception:  # a leaf captured by autograd.grad: needed
                    mask |= bit * 3
            edge += 1
        bit <<= 2
    plan = sig.backward_plans.get(mask)
    if plan is None:
        plan = _plan(sig, mask)
    phase, needed, need_in, need_w = plan
    out: list[Any] = [None] * (len(metas) + 2)
    if not needed:
        return tuple(out)

    kept = ctx._cg_saved
    saved = ctx.saved_tensors if kept is _SAVED_TENSORS else _restore_saved(ctx)
    bwd = op._backward_fn
    if bwd is not None:
        result = bwd(BackwardContext(op, phase, needed), saved, *grads)
        collect_flat(sig, "full", bwd, result, sig.tensor_set, needed, metas, out)
        return tuple(out)
    bwd_in, bwd_w = op._backward_input_fn, op._backward_weight_fn
    if bwd_in is None or bwd_w is None:
        raise MissingRegistrationError(op._missing_autograd_message())
    bctx = BackwardContext(op, phase, needed)
    if need_in:
        result = bwd_in(bctx, saved, *grads)
        collect_flat(sig, "input", bwd_in, result, sig.input_set, need_in, metas, out)
    if need_w:
        result = bwd_w(bctx, saved, *grads)
        collect_flat(sig, "weight", bwd_w, result, sig.weight_set, need_w, metas, out)
    return tuple(out)


def _plan(
    sig: Signature, mask: int
) -> tuple[Phase, frozenset[str], frozenset[str], frozenset[str]]:
    """``(phase, needed, needed inputs, needed weights)`` for one (requires, needed) mask."""
    requires = frozenset(n for i, n in enumerate(sig.names) if mask >> (2 * i) & 1)
    needed = frozenset(n for i, n in enumerate(sig.names) if mask >> (2 * i + 1) & 1)
    need_w = needed & sig.weight_set
    need_in = needed - sig.weight_set
    if needed >= requires or (need_w and need_in):
        phase: Phase = "full"
    else:
        phase = "weight" if need_w else "input"
    plan = (phase, needed, need_in, need_w)
    sig.backward_plans[mask] = plan
    return plan


def _backward_general(ctx: Any, grads: tuple[Any, ...], target: Any) -> tuple[Any, ...]:
    """Any op: list arguments and outputs, deferred weight work, no engine query."""
    op: CustomOp[..., Any] = ctx._cg_op
    sig = op._sig
    lens = ctx._cg_lens
    metas_flat: list[TensorMeta] = ctx._cg_meta
    req = ctx.needs_input_grad  # (op, call, *flat)
    next_fns = ctx.next_functions

    # Which tensor arguments require grad, and which of those the engine needs now.
    requires: set[str] = set()
    needed: set[str] = set()
    needed_items: set[int] = set()  # flat positions of list items the engine needs now
    if lens is None:
        slots = sig.flat_slots
        metas: dict[str, Meta] = dict(zip(sig.names, metas_flat))
        edge = 0
        will_execute = _will_execute
        for name, m, r in zip(sig.names, metas_flat, req[2:]):
            if m is None:
                continue
            if r:
                requires.add(name)
                if will_execute is None:
                    engine_needs(None)  # warns once that the split falls back to full work
                    needed.add(name)
                else:
                    try:
                        if will_execute(next_fns[edge][0]):
                            needed.add(name)
                    except Exception:  # a leaf captured by autograd.grad: needed
                        needed.add(name)
            edge += 1
    else:
        slots = _slots(sig, lens)
        metas = _metas_by_name(sig, slots, metas_flat)
        edge_of: list[int] = []
        edge = 0
        for m in metas_flat:
            edge_of.append(edge)
            if m is not None:
                edge += 1
        for name in sig.tensor_names:
            start, n = slots[name]
            for j in range(start, start + (1 if n is None else n)):
                if req[j + 2]:
                    requires.add(name)
                    if engine_needs(next_fns[edge_of[j]][0]):
                        needed.add(name)
                        needed_items.add(j)

    out_lens = ctx._cg_out_lens
    out_grads = grads if out_lens is None else _regroup_grads(sig, out_lens, grads)
    result: dict[str, Any] = {}
    if target is _NO_TARGET:
        target = _resolve_defer(ctx) if DEFER_RESOLVERS else None
    deferred = requires & sig.weight_set if target is not None else set()
    if deferred:
        needed -= deferred
    if needed or deferred:
        saved = _restore_saved(ctx)
        if needed:
            result = _run_halves(op, requires, needed, saved, out_grads, metas)
        if deferred and target is not None:
            target.defer(
                ctx, _deferred_runner(ctx, op, requires, deferred, saved, out_grads, metas)
            )

    if lens is None:
        get = result.get
        return (None, None, *[get(n) if r else None for n, r in zip(sig.names, req[2:])])
    flat_grads: list[Any] = [None] * (len(metas_flat) + 2)
    for name, g in result.items():
        start, n = slots[name]
        if n is None:
            if req[start + 2]:
                flat_grads[start + 2] = g
        elif g is not None:  # a list: only the items this pass needs
            for i, gi in enumerate(g):
                if start + i in needed_items:
                    flat_grads[start + i + 2] = gi
    return tuple(flat_grads)


def _metas_by_name(
    sig: Signature, slots: dict[str, tuple[int, int | None]], metas_flat: list[TensorMeta]
) -> dict[str, Meta]:
    metas: dict[str, Meta] = {}
    for name in sig.tensor_names:
        start, n = slots[name]
        metas[name] = metas_flat[start] if n is None else list(metas_flat[start : start + n])
    return metas


def _run_halves(
    op: CustomOp[..., Any],
    requires: set[str] | frozenset[str],
    needed: set[str] | frozenset[str],
    saved: Any,
    out_grads: tuple[Any, ...],
    metas: dict[str, Meta],
) -> dict[str, Any]:
    sig = op._sig
    weights = sig.weight_set
    need_w = needed & weights
    need_in = needed - weights
    if needed >= requires or (need_w and need_in):
        phase: Phase = "full"
    else:
        phase = "weight" if need_w else "input"
    bwd = op._backward_fn
    if bwd is not None:
        ctx = BackwardContext(op, phase, needed)
        result = bwd(ctx, saved, *out_grads)
        return collect_grads(sig, "full", bwd, result, sig.tensor_set, needed, metas)
    bwd_in, bwd_w = op._backward_input_fn, op._backward_weight_fn
    if bwd_in is None or bwd_w is None:
        raise MissingRegistrationError(op._missing_autograd_message())
    ctx = BackwardContext(op, phase, needed)
    if need_in:
        result = bwd_in(ctx, saved, *out_grads)
        grads = collect_grads(sig, "input", bwd_in, result, sig.input_set, need_in, metas)
        if need_w:
            result = bwd_w(ctx, saved, *out_grads)
            grads.update(collect_grads(sig, "weight", bwd_w, result, sig.weight_set, need_w, metas))
        return grads
    result = bwd_w(ctx, saved, *out_grads)
    return collect_grads(sig, "weight", bwd_w, result, sig.weight_set, need_w, metas)


def _resolve_defer(node: Any) -> DeferTarget | None:
    for resolve in DEFER_RESOLVERS:
        target = resolve(node)
        if target is not None:
            return target
    return None


def _deferred_runner(
    node: Any,
    op: CustomOp[..., Any],
    requires: set[str],
    weights: set[str],
    saved: Any,
    out_grads: tuple[Any, ...],
    metas: dict[str, Meta],
) -> DeferredWork:
    """Weight work for later: compute the weight half, then send it along the weight edges."""
    sig = op._sig
    slots = _slots(sig, node._cg_lens)
    edge_of: list[int] = []
    e = 0
    for m in node._cg_meta:
        edge_of.append(e)
        if m is not None:
            e += 1
    edges: list[tuple[str, int | None, Any, int]] = []
    req = node.needs_input_grad
    for name in sorted(weights, key=sig.index.__getitem__):
        start, n = slots[name]
        for i in range(1 if n is None else n):
            j = start + i
            if req[j + 2]:
                fn, idx = node.next_functions[edge_of[j]]
                edges.append((name, None if n is None else i, fn, idx))

    def gradients() -> tuple[list[GradientEdge], list[torch.Tensor]]:
        grads = _run_halves(op, requires, weights, saved, out_grads, metas)
        roots: list[GradientEdge] = []
        values: list[torch.Tensor] = []
        for name, i, fn, idx in edges:
            g = grads.get(name)
            if i is not None and g is not None:
                g = g[i]
            if g is not None and fn is not None:
                roots.append(GradientEdge(fn, idx))
                values.append(g)
        return roots, values

    return DeferredWork(gradients)


class DeferredWork:
    """A customgrad op's deferred weight half, as handed to :meth:`DeferTarget.defer`.

    Calling it computes the weight gradients and sends them along the op's weight edges through
    the engine; :meth:`gradients` only computes them, so that a caller can send the work of many
    ops in one engine call (one accumulation per weight, as in a full backward).
    """

    __slots__ = ("gradients",)

    def __init__(self, gradients: Callable[[], tuple[list[GradientEdge], list[torch.Tensor]]]):
        self.gradients = gradients

    def __call__(self) -> None:
        roots, values = self.gradients()
        if roots:
            torch.autograd.backward(roots, grad_tensors=values)


def apply(op: CustomOp[..., Any], args: tuple[Any, ...], kernel: Any = FIND_KERNEL) -> Any:
    """Run ``op`` under autograd with schema-ordered ``args``; return what the op returns.

    ``kernel`` is what ``op._direct_kernel(args)`` gives, when the caller already knows it.
    """
    sig = op._sig
    if op._save_fn is None or (
        op._backward_fn is None
        and (op._backward_input_fn is None or op._backward_weight_fn is None)
    ):
        raise MissingRegistrationError(op._missing_autograd_message())
    if op._mutates:
        op._check_mutated_no_grad(args)
    if sig.has_lists:
        lens, flat = _flatten_args(sig, args)
        call: list[Any] = [lens, None, kernel]
        out = _CustomGradFunction.apply(op, call, *flat)  # type: ignore[no-untyped-call]
    else:
        call = [None, None, kernel]
        if _functorch_active is None or _unwrap_if_dead is None or _functorch_active():
            out = _Function_apply(op, call, *args)
        else:
            # Function.apply without a functorch transform: unwrap dead wrappers, then apply.
            unwrap = _unwrap_if_dead
            out = _c_apply(op, call, *[unwrap(a) if isinstance(a, _Tensor) else a for a in args])
        if sig.plain_output:
            return out
    if sig.output_is_tuple:
        return _regroup_outputs(sig, out, call[1])
    if sig.output_kinds[0] is ArgKind.TENSOR_LIST:
        return list(out)
    return out


def _regroup_outputs(
    sig: Signature, flat: tuple[torch.Tensor, ...], out_lens: list[int | None] | None
) -> tuple[Any, ...]:
    if out_lens is None or all(n is None for n in out_lens):
        return tuple(flat)
    return tuple(_regroup_grads(sig, out_lens, flat))
