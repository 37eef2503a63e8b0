"""Validation of what a user's backward returns: a dict of gradients keyed by argument name."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

import torch

from customgrad._errors import GradientTypeError, GradientValueError, where
from customgrad._signature import ArgKind, Signature

__all__ = [
    "HALF_NAMES",
    "Meta",
    "TensorMeta",
    "collect_grads",
    "describe",
    "metas_by_name",
]

TensorMeta: TypeAlias = "tuple[torch.Size, torch.dtype, torch.device] | None"
Meta: TypeAlias = "TensorMeta | list[TensorMeta]"

_Tensor = torch.Tensor
_MISSING: Any = object()
"""A key the registered function did not return (in :func:`customgrad._codegen.check_source`'s lines)."""

HALF_NAMES = {
    "full": "backward",
    "input": "backward_input",
    "weight": "backward_weight",
    "shared": "backward_shared",
}


def describe(value: object) -> str:
    """A short description of a value for error messages."""
    if isinstance(value, torch.Tensor):
        return f"a Tensor of shape {tuple(value.shape)}, dtype {value.dtype}, device {value.device}"
    if value is None:
        return "None"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} items"
    text = " ".join(repr(value).split())
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _check_tensor(
    sig: Signature,
    label: str,
    fn: Callable[..., Any],
    name: str,
    index: int | None,
    grad: object,
    meta: TensorMeta,
) -> Any:
    """``grad`` if it is a valid gradient for an input described by ``meta`` (cast to the
    input's dtype where :func:`_autocast_dtype_ok` allows), else an error."""
    if grad is None:
        return None
    if (
        isinstance(grad, torch.Tensor)
        and meta is not None
        and grad.shape == meta[0]
        and grad.dtype == meta[1]
        and grad.device == meta[2]
    ):
        return grad
    arg = f"'{name}'" if index is None else f"'{name}'[{index}]"
    where_ = where(fn)
    if not isinstance(grad, torch.Tensor):
        raise GradientTypeError(
            f"{sig.qualname}: {label} returned {describe(grad)} as the gradient for {arg}. "
            f"Return a Tensor or None. ({label} defined at {where_})"
        )
    if meta is None:
        raise GradientValueError(
            f"{sig.qualname}: {label} returned a gradient for {arg}, but that input was None. "
            f"Return None for it. ({label} defined at {where_})"
        )
    shape, dtype, device = meta
    if grad.shape != shape:
        raise GradientValueError(
            f"{sig.qualname}: {label} returned a gradient for {arg} of shape "
            f"{tuple(grad.shape)}, but the input has shape {tuple(shape)}. Return a tensor of the "
            f"input's shape, or None{_broadcast_hint(grad.shape, shape)}. "
            f"({label} defined at {where_})"
        )
    if grad.dtype != dtype and not (dtype.is_floating_point or dtype.is_complex):
        raise GradientValueError(
            f"{sig.qualname}: {label} returned a gradient for {arg}, but that input is a "
            f"{dtype} tensor, which has no gradient (only floating-point and complex tensors "
            f"do). Return None for it. ({label} defined at {where_})"
        )
    if grad.dtype != dtype and not _autocast_dtype_ok(grad, dtype):
        raise GradientValueError(
            f"{sig.qualname}: {label} returned a gradient for {arg} of dtype {grad.dtype}, but "
            f"the input has dtype {dtype}. Cast it explicitly (e.g. grad.to({dtype})); customgrad "
            f"never casts silently. ({label} defined at {where_})"
        )
    if grad.device != device:
        raise GradientValueError(
            f"{sig.qualname}: {label} returned a gradient for {arg} on device {grad.device}, but "
            f"the input is on {device}. Return it on the input's device. "
            f"({label} defined at {where_})"
        )
    return grad if grad.dtype == dtype else grad.to(dtype)


def _broadcast_hint(got: torch.Size, shape: torch.Size) -> str:
    """For a gradient of the shape its input broadcasts to (the forward broadcast the input:
    a bias added to a batch), how to reduce it to the input's shape; else nothing."""
    k = len(got) - len(shape)
    if k < 0 or any(a != b and a != 1 for a, b in zip(shape, got[k:])):
        return ""
    dims = [*range(k), *(k + i for i, a in enumerate(shape) if a == 1 and got[k + i] != 1)]
    which = (
        f"the leading dimension{'s' if k > 1 else ''}"
        if len(dims) == k
        else "the dimensions the input was broadcast along"
    )
    return (
        f": the input broadcasts to {tuple(got)}, so sum over {which} "
        f"({', '.join(map(str, dims))}), e.g. grad.sum_to_size({tuple(shape)})"
    )


def _autocast_dtype_ok(grad: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a floating gradient of another floating dtype than its input's comes from a
    backward that ran under autocast, where torch's own rule applies: the autograd engine casts
    every node's gradient to its input's dtype (a compiled backward runs under the forward's
    autocast state, ``torch._functorch.config.backward_pass_autocast``)."""
    return (
        dtype.is_floating_point
        and grad.dtype.is_floating_point
        and torch.is_autocast_enabled(grad.device.type)
    )


def collect_grads(
    sig: Signature,
    half: str,
    fn: Callable[..., object],
    result: object,
    allowed: frozenset[str],
    needed: frozenset[str] | set[str],
    flat_metas: Sequence[TensorMeta],
    slots: Mapping[str, tuple[int, int | None]] | None = None,
) -> dict[str, object]:
    """Validate ``result`` and return the gradients of the ``needed`` arguments: the complete
    check, with the errors (a pass's runner checks a plain dict of valid gradients inline with
    :func:`customgrad._codegen.check_source`'s lines and hands anything else here).

    Args:
        sig: the op's signature.
        half: ``"full"``, ``"input"`` or ``"weight"``: which registered function ran.
        fn: that function, for the error location.
        result: what it returned.
        allowed: argument names it may return.
        needed: argument names whose gradient the running pass needs.
        flat_metas: shape, dtype and device of each flat input (list items inline; None for
            non-tensors): the node record's ``metas``.
        slots: for an op with list arguments, each argument's first flat position and list
            length (None for a single value), as ``_layout._slots`` gives them; None without
            list arguments (then flat positions are the arguments' indices).

    Raises:
        GradientTypeError: for a wrong kind of value.
        GradientValueError: for wrong keys, shapes, dtypes, devices or list lengths.
    """
    return _collect(sig, half, fn, result, allowed, needed, metas_by_name(sig, flat_metas, slots))


def metas_by_name(
    sig: Signature,
    flat_metas: Sequence[TensorMeta],
    slots: Mapping[str, tuple[int, int | None]] | None,
) -> dict[str, Meta]:
    """Each argument's meta by name: a list of item metas for a ``list[Tensor]`` argument."""
    if slots is None:
        return {name: flat_metas[i] for name, i in sig.index.items()}
    return {
        name: flat_metas[start] if n is None else list(flat_metas[start : start + n])
        for name, (start, n) in slots.items()
    }


def _collect(
    sig: Signature,
    half: str,
    fn: Callable[..., object],
    result: object,
    allowed: frozenset[str],
    needed: frozenset[str] | set[str],
    metas: Mapping[str, Meta],
) -> dict[str, Any]:
    label = HALF_NAMES[half]
    if not isinstance(result, dict):
        example = ", ".join(f"{n!r}: grad_{n}" for n in sig.names if n in allowed)
        raise GradientTypeError(
            f"{sig.qualname}: {label} must return a dict of gradients keyed by argument name, "
            f"but returned {describe(result)}. Return {{{example}}} (None for a gradient that "
            f"is zero). ({label} defined at {where(fn)})"
        )
    out: dict[str, Any] = {}
    for name, grad in result.items():
        if name not in allowed:
            _raise_bad_key(sig, label, fn, name, allowed)
        meta = metas[name]
        if isinstance(meta, list):
            if grad is None:
                if name in needed:
                    out[name] = None
                continue
            if not isinstance(grad, (list, tuple)):
                raise GradientTypeError(
                    f"{sig.qualname}: {label} returned {describe(grad)} as the gradient for "
                    f"'{name}', a list[Tensor] argument. Return a list with one Tensor or None per "
                    f"item. ({label} defined at {where(fn)})"
                )
            if len(grad) != len(meta):
                raise GradientValueError(
                    f"{sig.qualname}: {label} returned {len(grad)} gradients for '{name}', but the "
                    f"input list has {len(meta)} items. Return one Tensor or None per item. "
                    f"({label} defined at {where(fn)})"
                )
            grad = [
                _check_tensor(sig, label, fn, name, i, g, m)
                for i, (g, m) in enumerate(zip(grad, meta))
            ]
        else:
            grad = _check_tensor(sig, label, fn, name, None, grad, meta)
        if name in needed:
            out[name] = grad
    if len(out) != len(needed):
        missing = [n for n in sig.names if n in needed and n not in out]
        listed = ", ".join(repr(n) for n in missing)
        raise GradientValueError(
            f"{sig.qualname}: {label} returned no gradient for {listed}, which this backward pass "
            f"needs. Add {'them' if len(missing) > 1 else 'it'} to the dict (use None for a zero "
            f"gradient), or check ctx.needs_input_grad(name). Returned keys: "
            f"{sorted(map(str, result))}. ({label} defined at {where(fn)})"
        )
    return out


def _raise_bad_key(
    sig: Signature, label: str, fn: Callable[..., Any], name: object, allowed: frozenset[str]
) -> None:
    loc = f"({label} defined at {where(fn)})"
    valid = ", ".join(repr(n) for n in sig.names if n in allowed)
    if not isinstance(name, str) or name not in sig.index:
        raise GradientValueError(
            f"{sig.qualname}: {label} returned a gradient for unknown argument {name!r}. "
            f"Valid keys: {valid}. {loc}"
        )
    arg = sig.args[sig.index[name]]
    if arg.kind is ArgKind.OTHER:
        raise GradientTypeError(
            f"{sig.qualname}: {label} returned a gradient for '{name}', a {arg.type_str} "
            f"argument; only Tensor arguments take gradients. Remove the key. {loc}"
        )
    if label == "backward_input":
        raise GradientValueError(
            f"{sig.qualname}: backward_input returned a gradient for weight '{name}'. Weight "
            f"gradients belong in register_backward_weight; return only {valid}. {loc}"
        )
    raise GradientValueError(
        f"{sig.qualname}: backward_weight returned a gradient for '{name}', which is not a "
        f"weight (weights={sig.weights!r}). Input gradients belong in register_backward_input; "
        f"return only {valid}. {loc}"
    )
