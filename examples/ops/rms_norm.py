"""``examples::rms_norm``: RMSNorm with a learned weight, ``x / rms(x) * weight``.

It saves only its inputs and recomputes ``rstd = 1 / rms(x)`` (one reduction) in the half that
runs: the backward then uses only differentiable torch ops on saved inputs, so double backward
(``gradgradcheck``) is exact. A kernel that saved ``rstd`` instead would save that reduction but
lose double backward, because a tensor computed inside the forward is a constant to autograd.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import customgrad as cg

__all__ = ["rms_norm"]


@cg.op("examples::rms_norm", weights=("weight",))
def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """Normalize the last dimension of ``x`` by its root mean square, then scale by ``weight``."""
    return x * _rstd(x, eps) * weight


def _rstd(x: Tensor, eps: float) -> Tensor:
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    return torch.empty_like(x)


@rms_norm.register_save_for_backward
def _(inputs: Any, output: Tensor) -> Any:
    return inputs.x, inputs.weight, inputs.eps


@rms_norm.register_backward_input
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor | None]:
    x, weight, eps = saved
    rstd = _rstd(x, eps)
    x_hat = x * rstd
    g = grad * weight
    return {"x": rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))}


@rms_norm.register_backward_weight
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor | None]:
    x, weight, eps = saved
    x_hat = x * _rstd(x, eps)
    return {"weight": (grad * x_hat).reshape(-1, weight.shape[-1]).sum(0)}
