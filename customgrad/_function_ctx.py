"""A ``torch.autograd.Function``'s ctx, as customgrad records it and hands it to the backward.

Two places call a Function's ``backward`` themselves: an op made with ``from_function``, whose
kernel runs the forward with a :class:`ForwardContext` that records what it keeps, and the
stage's split of a plain Function's node, which reads what torch's ctx kept (:func:`of_node`).
Both hand the backward a :class:`FunctionContext`. The pipeline imports this module alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from customgrad._errors import UnsupportedError, where

__all__ = ["ForwardContext", "FunctionContext", "of_node"]


class FunctionContext:
    """The ``ctx`` of a Function's ``backward``: the saved tensors, the attributes ``forward``
    set, and ``needs_input_grad`` for the running pass. A plain object, so that dynamo (which
    captures the backward for the automatic split) reads and guards each attribute."""

    def __init__(
        self,
        saved: tuple[object, ...],
        attrs: Mapping[str, object],
        needs_input_grad: tuple[bool, ...],
    ) -> None:
        for name, value in attrs.items():  # dynamo traces setattr (torch 2.11: not update)
            setattr(self, name, value)
        self.saved_tensors = saved
        self.needs_input_grad = needs_input_grad


def of_node(node: torch.autograd.graph.Node) -> FunctionContext | None:
    """What the forward of a Function's ``node`` kept (torch's ctx is the node), or None when its
    saved tensors were freed."""
    try:
        saved = tuple(node.saved_tensors)  # type: ignore[attr-defined]
    except RuntimeError:
        return None
    attrs = {k: v for k, v in vars(node).items() if k != "apply"}
    return FunctionContext(saved, attrs, node.needs_input_grad)  # type: ignore[attr-defined]


class ForwardContext:
    """The ``ctx`` of a Function's ``forward`` (or ``setup_context``) run as an op's kernel:
    records what it keeps (``_cg_saved``, ``_cg_attrs``, ``_cg_nondiff``: names no forward sets)
    instead of keeping it."""

    _cg: tuple[str, Callable[..., object]]
    _cg_saved: tuple[torch.Tensor | None, ...]
    _cg_attrs: dict[str, object]
    _cg_nondiff: list[torch.Tensor]
    needs_input_grad: tuple[bool, ...]

    def __init__(
        self, needs_input_grad: tuple[bool, ...], qualname: str, fn: Callable[..., object]
    ) -> None:
        object.__setattr__(self, "_cg", (qualname, fn))
        object.__setattr__(self, "_cg_saved", ())
        object.__setattr__(self, "_cg_attrs", {})
        object.__setattr__(self, "_cg_nondiff", [])
        object.__setattr__(self, "needs_input_grad", needs_input_grad)

    def __setattr__(self, name: str, value: object) -> None:
        self._cg_attrs[name] = value

    def __getattr__(self, name: str) -> object:  # what forward set, read back
        attrs = object.__getattribute__(self, "_cg_attrs")
        if name in attrs:
            return attrs[name]
        raise AttributeError(name)

    def save_for_backward(self, *tensors: torch.Tensor | None) -> None:
        object.__setattr__(self, "_cg_saved", tensors)

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        self._cg_nondiff.extend(tensors)

    def set_materialize_grads(self, value: bool) -> None:
        """Accepted; customgrad always passes a gradient (zeros for unused outputs)."""

    def mark_dirty(self, *tensors: torch.Tensor) -> None:
        qualname, fn = self._cg
        raise UnsupportedError(
            f"{qualname}: the Function's forward calls ctx.mark_dirty: it modifies an input in "
            f"place, which customgrad ops do not differentiate through. Return a new tensor "
            f"instead, or keep this Function as it is. (forward defined at {where(fn)})"
        )
