"""``examples::silu_and_mul``: the gate of a SwiGLU MLP, ``silu(x[..., :d]) * x[..., d:]``.

The fused activation that LLM training and serving stacks (vLLM among them) register as a custom
op: one read of the ``(..., 2d)`` projection, one write of the ``(..., d)`` result.

It has **no weights**, so it registers only the input half of the backward: customgrad asks for
nothing else. The backward recomputes ``silu`` from the saved input (elementwise, cheaper to redo
than to keep alive), with differentiable torch ops only, so double backward is exact.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import customgrad as cg

__all__ = ["silu_and_mul"]


@cg.op("examples::silu_and_mul")
def silu_and_mul(x: Tensor) -> Tensor:
    """``silu(gate) * up`` for ``x = cat([gate, up], -1)`` of shape ``(..., 2d)``."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@silu_and_mul.register_fake
def _(x: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@silu_and_mul.register_save_for_backward
def _(inputs: Any, output: Tensor) -> Any:
    return inputs.x


@silu_and_mul.register_backward_input  # no weights: the input half is the whole backward
def _(ctx: cg.BackwardContext, x: Tensor, grad: Tensor) -> dict[str, Tensor | None]:
    gate, up = x.chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    d_gate = grad * up * sig * (1 + gate * (1 - sig))  # silu'(gate) = sig * (1 + gate * (1 - sig))
    d_up = grad * gate * sig
    return {"x": torch.cat([d_gate, d_up], dim=-1)}
