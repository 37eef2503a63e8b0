"""``torch.autograd.Function`` internals: a backward node's Function class, the backward node
class of a Function, and ``apply`` without its functorch wrapper.

- :func:`forward_cls`: the ``Function`` subclass whose backward a node runs
  (``node._forward_cls``), or None for a native node;
- :func:`set_backward_apply`: make a Function's backward nodes run ``apply(node, *grads)``
  (assigns ``Function._backward_cls.apply``), which lets customgrad read the node it runs in
  instead of the ``ctx`` torch hands to ``backward``;
- :func:`plain_apply`: what ``Function.apply`` ends in when no functorch transform is active
  (``torch._C._FunctionBase.apply``), without the Python wrapper's checks;
- :func:`setup_context_defined`: whether a Function overrides ``setup_context``
  (``torch.autograd.function._is_setup_context_defined``);
- :func:`custom_op_of`: the ``torch.library.custom_op`` whose backward a node runs (its Function
  is made in ``torch._library.autograd``, which holds the ``OpOverload`` in a closure).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "custom_op_of",
    "forward_cls",
    "is_aot_node",
    "plain_apply",
    "set_backward_apply",
    "setup_context_defined",
]

_CUSTOM_OP_MODULE = "torch._library.autograd"
r"""The module whose generated Functions give ``torch.library.custom_op``\ s their autograd."""


def forward_cls(node: Any) -> type[Any] | None:
    """The ``torch.autograd.Function`` subclass whose backward ``node`` runs, else None."""
    cls = getattr(node, "_forward_cls", None)
    return cls if isinstance(cls, type) else None


def set_backward_apply(function: type[torch.autograd.Function], apply: Callable[..., Any]) -> None:
    """Make the backward nodes of ``function`` call ``apply(node, *grads)``."""
    function._backward_cls.apply = apply  # type: ignore[attr-defined]


def plain_apply(function: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``function.apply`` without the functorch dispatch of ``Function.apply``: valid only
    while no functorch transform is active (see :mod:`customgrad._torch.transforms`)."""
    return super(torch.autograd.Function, function).apply  # type: ignore[misc,no-any-return]


def custom_op_of(node: Any) -> str | None:
    """The name (``"ns::op"``) of the ``torch.library.custom_op`` whose backward ``node`` runs;
    its Function's class name (``GeneratedBackwardFor_ns_op_default``) when the op cannot be
    read from it; None for any other node."""
    from torch._ops import OpOverload

    cls = forward_cls(node)
    if cls is None or cls.__module__ != _CUSTOM_OP_MODULE:
        return None
    for cell in getattr(cls.forward, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, OpOverload):
            return str(value._schema.name)
    return cls.__name__


def is_aot_node(node: Any) -> bool:
    """Whether ``node`` is the autograd node of an AOTAutograd-compiled graph (its
    ``autograd.Function`` class carries the compiled forward, ``compiled_fw``)."""
    return getattr(getattr(node, "_forward_cls", None), "compiled_fw", None) is not None


def setup_context_defined(function: type[torch.autograd.Function]) -> bool:
    """Whether ``function`` defines its own ``setup_context`` (a forward without ``ctx``)."""
    from torch.autograd.function import _is_setup_context_defined

    return bool(_is_setup_context_defined(function.setup_context))
