"""``examples::gelu_linear``: a fused ``gelu(x) @ weight.T + bias`` (the second layer of an MLP).

One kernel instead of two, and a backward split the zero-bubble way:

- the input half computes ``dx = (grad @ weight) * gelu'(x)``;
- the weight half computes ``dweight = grad.T @ gelu(x)`` and ``dbias = grad.sum(0)``.

Only ``x`` and ``weight`` are saved (not ``gelu(x)``, which is as large as ``x``): the weight half
recomputes the activation, an elementwise op, rather than keeping a second activation-sized tensor
alive from forward to W. Every step is a differentiable torch op on saved inputs, so double
backward is exact.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

import customgrad as cg

__all__ = ["gelu_linear"]


@cg.op("examples::gelu_linear", weights=("weight", "bias"))
def gelu_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``gelu(x) @ weight.T (+ bias)``, with the exact (erf) GELU."""
    a = torch.nn.functional.gelu(x)
    out = a @ weight.mT
    return out if bias is None else out + bias


@gelu_linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@gelu_linear.register_save_for_backward
def _(inputs: Any, output: Tensor) -> Any:
    return inputs.x, inputs.weight, inputs.bias is not None


def _gelu_grad(x: Tensor) -> Tensor:
    """d gelu(x) / dx = Phi(x) + x * phi(x)."""
    cdf = 0.5 * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))
    pdf = torch.exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi))
    return cdf + x * pdf


@gelu_linear.register_backward_input
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor | None]:
    x, weight, _ = saved
    return {"x": (grad @ weight) * _gelu_grad(x)}


@gelu_linear.register_backward_weight
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor | None]:
    x, _, has_bias = saved
    g = grad.reshape(-1, grad.shape[-1])
    a = torch.nn.functional.gelu(x).reshape(-1, x.shape[-1])
    return {"weight": g.mT @ a, "bias": g.sum(0) if has_bias else None}
