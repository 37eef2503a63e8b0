"""``examples::linear``: ``x @ weight.T + bias``, with the input/weight backward pair.

The input half computes ``dx`` only; the weight half computes ``dweight`` and ``dbias`` only.
Under a zero-bubble schedule each matmul of the backward runs exactly once.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

import customgrad as cg

__all__ = ["linear"]


@cg.op("examples::linear", weights=("weight", "bias"))
def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T (+ bias)`` for ``x`` of shape ``(..., in)`` and ``weight`` ``(out, in)``."""
    out = x @ weight.mT
    return out if bias is None else out + bias


@linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@linear.register_save_for_backward
def _(inputs: Any, output: Tensor) -> Any:
    return inputs.x, inputs.weight, inputs.bias is not None


@linear.register_backward_input
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor | None]:
    _, weight, _ = saved
    return {"x": grad @ weight}


@linear.register_backward_weight
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor | None]:
    x, _, has_bias = saved
    g = grad.reshape(-1, grad.shape[-1])
    xs = x.reshape(-1, x.shape[-1])
    return {"weight": g.mT @ xs, "bias": g.sum(0) if has_bias else None}
