"""The MLP that ``split.py`` and ``split_memory.py`` measure, in three kinds of linear layer.

``x @ weight.mT`` as a customgrad op (separate input and weight halves), as a plain
``autograd.Function`` and as ``nn.functional.linear``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import customgrad as cg


@cg.op("benchmarks::linear", weights=("weight",))
def cg_linear(x: Tensor, weight: Tensor) -> Tensor:
    return x @ weight.mT


@cg_linear.register_fake
def _(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@cg_linear.register_save_for_backward
def _(inputs: Any, output: Tensor) -> Any:
    return inputs.x, inputs.weight


@cg_linear.register_backward_input
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
    return {"x": grad @ saved[1]}


@cg_linear.register_backward_weight
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
    return {"weight": grad.mT @ saved[0]}


class FnLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight.mT

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        gx = grad @ weight if ctx.needs_input_grad[0] else None
        gw = grad.mT @ x if ctx.needs_input_grad[1] else None
        return gx, gw


LAYERS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "customgrad op": cg_linear,
    "autograd.Function": FnLinear.apply,
    "nn.Linear": lambda x, w: nn.functional.linear(x, w),
}


class MLP(nn.Module):
    """``depth`` square linear layers of ``kind`` (a key of ``LAYERS``), each followed by ``act``."""

    def __init__(
        self, kind: str, width: int, depth: int, act: Callable[[Tensor], Tensor] = torch.relu
    ) -> None:
        super().__init__()
        self.layer = LAYERS[kind]
        self.act = act
        self.ws = nn.ParameterList(
            nn.Parameter(torch.randn(width, width) / width**0.5) for _ in range(depth)
        )

    def forward(self, x: Tensor) -> Tensor:
        for w in self.ws:
            x = self.act(self.layer(x, w))
        return x
