"""functorch transforms (``vmap``, ``grad``, ``jvp``) and forward-mode AD levels.

- :data:`functorch_active`: whether any functorch transform is active
  (``torch._C._are_functorch_transforms_active``);
- :func:`forward_ad_level`: the innermost dual level (``torch.autograd.forward_ad._current_level``,
  -1 outside ``fwAD.dual_level()``);
- :func:`jvp_transform_active`: whether a functorch ``jvp`` is among the active transforms
  (``torch._functorch.pyfunctorch.retrieve_all_functorch_interpreters``,
  ``torch._C._functorch.TransformType.Jvp``);
- :data:`unwrap_if_dead`: unwraps a tensor of a transform that has exited
  (``torch._C._functorch.unwrap_if_dead``);
- :func:`legacy_batched`: whether a tensor is batched by torch's legacy vmap
  (``torch._C._functorch.is_legacy_batchedtensor``).

Fallbacks: without the transform query every call counts as transformed (the dispatcher then
handles it); without the interpreters' list no jvp is seen below a transform.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.forward_ad as _fwad

__all__ = [
    "forward_ad_level",
    "functorch_active",
    "jvp_transform_active",
    "legacy_batched",
    "unwrap_if_dead",
]

functorch_active: Callable[[], bool] = getattr(
    torch._C, "_are_functorch_transforms_active", lambda: True
)
"""Whether a functorch transform (vmap, grad, jvp, functionalize) is active."""

unwrap_if_dead: Callable[[Any], Any] | None = getattr(
    getattr(torch._C, "_functorch", None), "unwrap_if_dead", None
)
"""Unwrap a tensor whose transform level has exited, or None on a torch without it."""


_is_legacy_batched: Any = getattr(
    getattr(torch._C, "_functorch", None), "is_legacy_batchedtensor", None
)


def legacy_batched(t: torch.Tensor) -> bool:
    """Whether ``t`` is batched by torch's legacy vmap (``autograd.grad(...,
    is_grads_batched=True)``, ``jacobian(..., vectorize=True)``), which functorch's
    "transforms active" query does not see (``torch._C._functorch.is_legacy_batchedtensor``).
    True when unknown: the caller then calls the backward as written, never a trace that could
    not run on it."""
    if _is_legacy_batched is None:
        return True
    return bool(_is_legacy_batched(t))


def forward_ad_level() -> int:
    """The innermost forward-AD dual level (-1: none active)."""
    return _fwad._current_level


try:
    from torch._C._functorch import TransformType as _TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    _JVP: Any = _TransformType.Jvp
    _interpreters: Callable[[], Any] = retrieve_all_functorch_interpreters
except ImportError:  # pragma: no cover - torch without functorch
    _JVP = None
    _interpreters = list


def jvp_transform_active() -> bool:
    """Whether a functorch ``jvp`` transform is active (``torch.func.jvp``, ``jacfwd``)."""
    if not functorch_active():
        return False
    return any(i.key() == _JVP for i in _interpreters())
