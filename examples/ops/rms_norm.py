"""``examples::rms_norm``: RMSNorm as Liger-Kernel computes it, ``x * rstd * (offset + weight)``.

Facts carried over from Liger's ``LigerRMSNormFunction`` (Llama casting mode):

- ``rstd = 1 / sqrt(mean(x**2) + eps)`` is computed in float32 (at least), and ``x * rstd`` is
  cast back to ``x``'s dtype before it is scaled by the weight;
- ``offset`` is 0 for Llama and 1 for Gemma, whose weight is stored as ``weight - 1``;
- the forward keeps ``rstd`` (one float per row) for the backward instead of recomputing the
  reduction.

``rstd`` is a **residual**: the kernel returns it after the output (``residuals=("rstd",)``) and
only ``save_for_backward`` sees it; callers get the normalized tensor alone, on every call path.
A tensor computed in the forward is a constant to autograd, so the backward is registered
``differentiable=False``: double backward raises a clear error (as Liger's Function is once
differentiable) instead of returning a silently wrong gradient.

The two halves share ``x * rstd``, an elementwise product: each half recomputes it rather than
keeping an activation-sized tensor alive from I to W.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import customgrad as cg

__all__ = ["rms_norm"]


@cg.op("examples::rms_norm", weights=("weight",), residuals=("rstd",))
def rms_norm(
    x: Tensor, weight: Tensor, eps: float = 1e-6, offset: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Normalize the last dimension of ``x`` by its root mean square, then scale it.

    Returns the output (same shape and dtype as ``x``) and the residual ``rstd`` of shape
    ``(..., 1)`` in float32 (float64 for float64 inputs); calling the op returns the output only.
    """
    rstd = torch.rsqrt(_upcast(x).pow(2).mean(-1, keepdim=True) + eps)
    x_hat = (x * rstd).to(x.dtype)
    return (x_hat * (offset + weight)).to(x.dtype), rstd


def _upcast(t: Tensor) -> Tensor:
    """``t`` in the dtype the statistics are computed in: float32, or float64 for float64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float = 1e-6, offset: float = 0.0) -> tuple[Tensor, Tensor]:
    stats = torch.promote_types(x.dtype, torch.float32)
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=stats)


@rms_norm.register_save_for_backward
def _(inputs: Any, output: Tensor, residuals: Any) -> Any:
    return inputs.x, inputs.weight, inputs.offset, residuals.rstd


@rms_norm.register_backward_input(differentiable=False)
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor | None]:
    x, weight, offset, rstd = saved
    x_hat = _upcast(x) * rstd
    m = _upcast(grad) * (offset + _upcast(weight))
    dx = rstd * (m - x_hat * (m * x_hat).mean(-1, keepdim=True))
    return {"x": dx.to(x.dtype)}


@rms_norm.register_backward_weight(differentiable=False)
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor | None]:
    x, weight, _, rstd = saved
    x_hat = (x * rstd).to(x.dtype)
    dw = (_upcast(grad) * x_hat).reshape(-1, weight.shape[-1]).sum(0)
    return {"weight": dw.to(weight.dtype)}
