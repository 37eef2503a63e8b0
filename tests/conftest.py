"""Ops shared by the tests: a customgrad linear in each backward style, and a plain Function.

Ops are global by name, so each test module builds its own under its own namespace
(``linear_op("split_bw::linear")``), optionally with a ``spy`` to count backward halves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Literal

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

import customgrad as cg

Spy = Callable[[str, str], None]
"""Called as ``spy(half, phase)``: ``half`` is "input" or "weight" (a plain Function: "fn"),
``phase`` the backward phase it ran in (``ctx.phase``; a plain Function: "both")."""


def linear_op(
    name: str,
    *,
    backward: Literal["pair", "single"] | None = "pair",
    spy: Spy | None = None,
    split: Literal["auto", "phase"] = "auto",
) -> cg.CustomOp[..., Tensor]:
    """``x @ weight.mT`` as the customgrad op ``name`` (``weight`` is its weight).

    ``backward``: "pair" registers ``backward_input`` and ``backward_weight``; "single" one
    ``backward`` that computes what ``ctx.needs_input_grad`` asks for, registered with
    ``split``; None registers none (the caller does). The weight gradient sums over all leading
    dims of ``x``.

    A ``spy`` in a single backward with ``split="auto"`` runs when the backward is traced (once
    per input signature), not in each pass: use ``split="phase"`` to count calls per pass.
    """

    @cg.op(name, weights=("weight",))
    def linear(x: Tensor, weight: Tensor) -> Tensor:
        return x @ weight.mT

    @linear.register_fake
    def _(x: Tensor, weight: Tensor) -> Tensor:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @linear.register_save_for_backward
    def _(inputs: Any, output: Tensor) -> Any:
        return inputs.x, inputs.weight

    def grad_x(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> Tensor:
        if spy is not None:
            spy("input", ctx.phase)
        return grad @ saved[1]

    def grad_weight(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> Tensor:
        if spy is not None:
            spy("weight", ctx.phase)
        x = saved[0]
        return grad.reshape(-1, grad.shape[-1]).mT @ x.reshape(-1, x.shape[-1])

    if backward == "pair":

        @linear.register_backward_input
        def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
            return {"x": grad_x(ctx, saved, grad)}

        @linear.register_backward_weight
        def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
            return {"weight": grad_weight(ctx, saved, grad)}

    elif backward == "single":

        @linear.register_backward(split=split)
        def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
            out: dict[str, Any] = {}
            if ctx.needs_input_grad("x"):
                out["x"] = grad_x(ctx, saved, grad)
            if ctx.needs_input_grad("weight"):
                out["weight"] = grad_weight(ctx, saved, grad)
            return out

    return linear


def function_linear(spy: Spy | None = None) -> Callable[[Tensor, Tensor], Tensor]:
    """``x @ weight.mT`` as a plain ``autograd.Function`` (its ``apply``).

    Its ``needs_input_grad`` is fixed at forward time, so a split backward runs all of it twice.
    """

    class FnLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor, weight: Tensor) -> Tensor:
            ctx.save_for_backward(x, weight)
            return x @ weight.mT

        @staticmethod
        def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
            x, weight = ctx.saved_tensors
            if spy is not None:
                spy("fn", "both")
            gx = grad @ weight if ctx.needs_input_grad[0] else None
            gw = grad.mT @ x if ctx.needs_input_grad[1] else None
            return gx, gw

    return FnLinear.apply  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def group() -> Iterator[None]:
    """A one-process gloo group for a module's pipeline stages (or the one already there)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
