"""``torch.autograd.Function`` internals: a backward node's Function class, the backward node
class of a Function, and ``apply`` without its functorch wrapper.

- :func:`forward_cls`: the ``Function`` subclass whose backward a node runs
  (``node._forward_cls``), or None for a native node;
- :func:`set_backward_apply`: make a Function's backward nodes run ``apply(node, *grads)``
  (assigns ``Function._backward_cls.apply``), which lets customgrad read the node it runs in
  instead of the ``ctx`` torch hands to ``backward``;
- :func:`plain_apply`: what ``Function.apply`` ends in when no functorch transform is active
  (``torch._C._FunctionBase.apply``), without the Python wrapper's checks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["forward_cls", "plain_apply", "set_backward_apply"]


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
