"""Calling the registered backward functions: in-place writes refused, ``differentiable=False``
and residuals made to raise if differentiated again."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias

import optree
import torch
from torch.autograd.function import FunctionCtx

from customgrad._errors import (
    DoubleBackwardError,
    MutationError,
    where,
)
from customgrad._rules import Half, OpSpec
from customgrad._saving import SAVED
from customgrad._triton import raise_if_raw_launch
from customgrad._validate import HALF_NAMES

if TYPE_CHECKING:
    from customgrad._pass import BackwardContext

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_VERSION = itertools.repeat("_version")
_NO_VERSION = itertools.repeat(None)


def _watched_values(saved: Any, grads: tuple[Any, ...]) -> tuple[Any, ...]:
    """The output gradients, then the saved values (leaves of a saved pytree)."""
    if type(saved) is tuple:
        return (*grads, *saved)
    if saved is None:
        return grads
    if isinstance(saved, _Tensor):
        return (*grads, saved)
    return (*grads, *optree.tree_leaves(saved, none_is_leaf=True, namespace=SAVED))


def _raise_mutation(
    spec: OpSpec,
    half: Half,
    fn: Callable[..., Any],
    values: tuple[Any, ...],
    before: list[Any],
    n_grads: int,
) -> None:
    """Raise :class:`MutationError` for the first value whose version moved (if one did)."""
    saved_tensors = 0
    for i, (v, version) in enumerate(zip(values, before)):
        is_grad = i < n_grads
        if not is_grad and isinstance(v, _Tensor):
            saved_tensors += 1
        if version is not None and v._version != version:
            what = f"the gradient of output {i}" if is_grad else f"saved tensor {saved_tensors - 1}"
            label = HALF_NAMES[half]
            raise MutationError(
                f"{spec.name}: {label} modified {what} in place (its version went from "
                f"{version} to {v._version}). The other half of a split backward may still "
                f"need it, and autograd may share it with other nodes. Compute out of place "
                f"(grad = grad * s, not grad.mul_(s)). ({label} defined at {where(fn)})"
            )


_Watch: TypeAlias = "tuple[tuple[Any, ...], list[Any], int]"
"""What a backward function must not write to in place (the output gradients and the saved
values), their version counters before the node's backward ran, and the number of output
gradients: what a pass's runner reads before the registered functions run
(``customgrad._codegen.watch_lines``), which :func:`_call_user` checks."""


def _call_user(
    ctx: BackwardContext,
    half: Half,
    fn: Callable[..., Any],
    saved: Any,
    grads: tuple[Any, ...],
    watch: _Watch,
    nondiff: frozenset[Half],
) -> Any:
    """Call one registered backward function; refuse in-place writes to grads or saved values
    (:class:`MutationError` when ``fn`` moved a version counter that ``watch`` read before)."""
    if nondiff and half in nondiff and torch.is_grad_enabled():
        with torch.no_grad():
            result = fn(ctx, saved, *grads)
        anchors = _requiring_grad(grads, saved)
        if anchors:
            result = _delay_error(ctx.op, half, fn, result, anchors)
    else:
        try:
            result = fn(ctx, saved, *grads)
        except Exception as e:  # a raw Triton launch on fake tensors (torch.compile)?
            raise_if_raw_launch(e, ctx.op.name, HALF_NAMES[half], fn)
            raise
    # Did ``fn`` move a version counter? (checked here, not in a method: one frame less)
    values = watch[0]
    if [*map(getattr, values, _VERSION, _NO_VERSION)] != watch[1]:
        _raise_mutation(ctx.op, half, fn, values, watch[1], watch[2])
    return result


def _requiring_grad(grads: tuple[Any, ...], saved: Any) -> list[torch.Tensor]:
    """The output gradients and saved tensors that require grad (in double backward)."""
    tree: Any = (grads, saved)
    leaves: list[Any] = optree.tree_leaves(tree, none_is_leaf=True, namespace=SAVED)
    return [t for t in leaves if isinstance(t, _Tensor) and t.requires_grad]


class _RaiseIfDifferentiated(torch.autograd.Function):
    """An alias of a tensor whose backward raises: for what autograd cannot differentiate (a
    ``differentiable=False`` backward's gradients, a residual). Unlike torch's
    ``once_differentiable``, the node has edges to the tensors the value was computed from
    (``anchors``), so ``autograd.grad`` with respect to them runs it and raises, instead of
    pruning it and returning a silently wrong gradient."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, msg: str, value: torch.Tensor, *anchors: torch.Tensor
    ) -> torch.Tensor:
        ctx.msg = msg  # type: ignore[attr-defined]
        return value.view_as(value)

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: torch.Tensor | None) -> NoReturn:
        raise DoubleBackwardError(ctx.msg)  # type: ignore[attr-defined]


def _raises_if_differentiated(msg: str, t: torch.Tensor, anchors: list[torch.Tensor]) -> Any:
    if not (t.is_floating_point() or t.is_complex()):
        return t
    return _RaiseIfDifferentiated.apply(msg, t, *anchors)  # type: ignore[no-untyped-call]


def _delay_error(
    spec: OpSpec, half: Half, fn: Callable[..., Any], result: Any, anchors: list[torch.Tensor]
) -> Any:
    """Make the gradients in ``result`` raise if anyone differentiates them (double backward)."""
    if not isinstance(result, dict):
        return result
    label = HALF_NAMES[half]
    msg = (
        f"{spec.name}: {label} was registered with differentiable=False, so its gradients "
        f"cannot be differentiated again (double backward, gradient penalties). Register a "
        f"differentiable {label}, written with differentiable torch ops. ({label} defined at "
        f"{where(fn)})"
    )
    out: dict[Any, Any] = {}
    for name, g in result.items():
        if isinstance(g, _Tensor):
            g = _raises_if_differentiated(msg, g, anchors)
        elif isinstance(g, (list, tuple)):
            g = [
                _raises_if_differentiated(msg, t, anchors) if isinstance(t, _Tensor) else t
                for t in g
            ]
        out[name] = g
    return out


MSG_RESIDUAL_DOUBLE_BACKWARD = """\
{op}: double backward (create_graph=True, gradient penalties) reached residual {name!r}, which \
the kernel computed in the forward: autograd sees it as a constant, so the gradient through it \
would be silently wrong. Save the inputs and recompute it in the backward with differentiable \
torch ops if you need double backward; otherwise register the backward with \
differentiable=False to declare the op once differentiable. (kernel defined at {loc})"""


def _residual_slots(saved: Any, residuals: tuple[Any, ...], names: tuple[str, ...]) -> Any:
    """For each residual that ``save_for_backward`` kept as it is: its position among the saved
    tensors (in the order :func:`_save` saves them) and its name; None when there is none."""
    tensors = [
        t
        for t in optree.tree_leaves(saved, none_is_leaf=True, namespace=SAVED)
        if isinstance(t, _Tensor)
    ]
    slots = tuple(
        (i, name) for i, t in enumerate(tensors) for r, name in zip(residuals, names) if t is r
    )
    return slots or None


def _guard_residuals(
    spec: OpSpec, saved: Any, grads: tuple[Any, ...], slots: tuple[tuple[int, str], ...]
) -> Any:
    """``saved`` with each residual replaced by an alias whose backward raises (in double
    backward, where the backward builds a graph).

    A residual depends on the op's inputs, not on the output gradients: its alias hangs off the
    saved tensors that require grad, so double backward with respect to the output gradients
    alone still works; only when no saved tensor requires grad does it hang off the gradients.
    """
    anchors = _requiring_grad((), saved) or _requiring_grad(grads, None)
    if not anchors:
        return saved
    names = dict(slots)
    leaves, treespec = optree.tree_flatten(saved, none_is_leaf=True, namespace=SAVED)
    k = 0
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, _Tensor):
            name = names.get(k)
            if name is not None:
                msg = MSG_RESIDUAL_DOUBLE_BACKWARD.format(
                    op=spec.name, name=name, loc=where(spec.signature.fn)
                )
                leaves[i] = _raises_if_differentiated(msg, leaf, anchors)
            k += 1
    return optree.tree_unflatten(treespec, leaves)
