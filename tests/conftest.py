"""Ops shared by the tests: a customgrad linear in each backward style, and a plain Function.

Ops are global by name, so each test module builds its own under its own namespace
(``linear_op("split_bw::linear")``), optionally with a ``spy`` to count backward halves.
"""

from __future__ import annotations

import itertools
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


_ids = itertools.count()


def linear_op(
    name: str | None = None,
    *,
    bias: bool = False,
    backward: Literal["pair", "single", "every"] | None = "pair",
    spy: Spy | None = None,
    split: Literal["auto", "phase"] = "auto",
    cast_grad: bool = False,
) -> cg.CustomOp[..., Tensor]:
    """``x @ weight.mT`` (``+ bias``) as the customgrad op ``name`` (a fresh
    ``"conftest<n>::linear"`` when None); ``weight`` (and ``bias``) are its weights.

    The one op factory of the tests: every test module that needs a customgrad linear builds it
    here, under its own name.

    ``bias``: an ``Optional[Tensor]`` bias argument (``linear(x, weight, bias=None)``).
    ``backward``: "pair" registers ``backward_input`` and ``backward_weight``; "single" one
    ``backward`` that computes what ``ctx.needs_input_grad`` asks for; "every" one ``backward``
    that returns every gradient whatever the pass needs (what the automatic split is for); both
    registered with ``split``; None registers none (the caller does). ``cast_grad`` casts the
    output gradient to the inputs' dtype first, as a backward written for autocast does. The
    weight gradient sums over all leading dims of ``x``; saved is ``(x, weight)``, with a
    bias ``(x, weight, bias is not None)``.

    A ``spy`` that records its calls changes Python state, so a single backward with
    ``split="auto"`` that calls it is not traced: it runs once per backward, in the first pass
    that needs a gradient, with every gradient asked for (the run-once rule). Use
    ``split="phase"`` to count calls per pass.
    """
    name = name or f"conftest{next(_ids)}::linear"
    if bias:

        @cg.op(name, weights=("weight", "bias"))
        def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
            out = x @ weight.mT
            return out if bias is None else out + bias

        @linear.register_fake
        def _(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
            return x.new_empty((*x.shape[:-1], weight.shape[0]))

        @linear.register_save_for_backward
        def _(inputs: Any, output: Tensor) -> Any:
            return inputs.x, inputs.weight, inputs.bias is not None

    else:

        @cg.op(name, weights=("weight",))
        def linear(x: Tensor, weight: Tensor) -> Tensor:  # type: ignore[misc]
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
        weight = saved[1]
        return (grad.to(weight.dtype) if cast_grad else grad) @ weight

    def grad_weights(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
        if spy is not None:
            spy("weight", ctx.phase)
        x = saved[0]
        g = grad.to(x.dtype) if cast_grad else grad
        g, xs = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        out = {"weight": g.mT @ xs}
        if bias:
            out["bias"] = g.sum(0) if saved[2] else None
        return out

    if backward == "pair":

        @linear.register_backward_input
        def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
            return {"x": grad_x(ctx, saved, grad)}

        @linear.register_backward_weight
        def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
            return grad_weights(ctx, saved, grad)

    elif backward == "single":

        @linear.register_backward(split=split)
        def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
            out: dict[str, Any] = {}
            if ctx.needs_input_grad("x"):
                out["x"] = grad_x(ctx, saved, grad)
            if ctx.needs_input_grad("weight") or (bias and ctx.needs_input_grad("bias")):
                out.update(grad_weights(ctx, saved, grad))
            return out

    elif backward == "every":

        @linear.register_backward(split=split)
        def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
            return {"x": grad_x(ctx, saved, grad), **grad_weights(ctx, saved, grad)}

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
