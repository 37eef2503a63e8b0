"""``examples::lora_mlp``: a SwiGLU MLP whose three projections carry LoRA adapters, fused as
unsloth's ``LoRA_MLP`` fuses them.

Each projection is ``x @ W.T + s * (x @ A.T) @ B.T`` (frozen ``W``, adapter ``A``, ``B``; see
:mod:`examples.ops.lora_linear`), and the MLP is::

    e = gate(x)          # (N, I)
    g = up(x)            # (N, I)
    h = silu(e) * g
    y = down(h)          # (N, H)

Facts carried over from unsloth: the forward keeps ``e`` and ``g`` for the backward (here as
**residuals**, ``residuals=("e", "g")``: callers get ``y`` only); the backward recomputes ``h``
from them (elementwise) and starts from ``dh = dY @ W_down`` (plus the adapter's part).

That ``dY @ W_down`` is the work both halves need: the input half turns ``dh`` into ``de``, ``dg``
and then ``dx``; the weight half needs ``de`` and ``dg`` for the gate and up adapters. It is
registered once with ``register_backward_shared`` and handed from I to W; written as a plain pair,
each half would recompute it (1.33x the backward's FLOPs at 64 tokens, hidden 256, inner 688; see
``tests/test_real_ops.py``). The hand-off keeps ``de`` and ``dg`` (two ``(N, I)`` tensors) alive
from I until W: that is the memory it trades for the FLOPs.

Because ``e`` and ``g`` come from the forward, the backward is ``differentiable=False``: double
backward raises a clear error.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

import customgrad as cg

__all__ = ["lora_mlp"]

_WEIGHTS = tuple(
    f"{proj}_{part}" for proj in ("gate", "up", "down") for part in ("weight", "a", "b")
)


@cg.op("examples::lora_mlp", weights=_WEIGHTS, residuals=("e", "g"))
def lora_mlp(
    x: Tensor,
    gate_weight: Tensor,
    gate_a: Tensor,
    gate_b: Tensor,
    up_weight: Tensor,
    up_a: Tensor,
    up_b: Tensor,
    down_weight: Tensor,
    down_a: Tensor,
    down_b: Tensor,
    scaling: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """``down(silu(gate(x)) * up(x))``; returns the output, then the residuals ``e`` and ``g``."""
    e = _project(x, gate_weight, gate_a, gate_b, scaling)
    g = _project(x, up_weight, up_a, up_b, scaling)
    h = torch.nn.functional.silu(e) * g
    return _project(h, down_weight, down_a, down_b, scaling), e, g


def _project(x: Tensor, weight: Tensor, a: Tensor, b: Tensor, scaling: float) -> Tensor:
    """``x @ weight.T + scaling * (x @ a.T) @ b.T``, the adapter cast to ``x``'s dtype."""
    return x @ weight.mT + scaling * ((x @ a.to(x.dtype).mT) @ b.to(x.dtype).mT)


@lora_mlp.register_fake
def _(
    x: Tensor,
    gate_weight: Tensor,
    gate_a: Tensor,
    gate_b: Tensor,
    up_weight: Tensor,
    up_a: Tensor,
    up_b: Tensor,
    down_weight: Tensor,
    down_a: Tensor,
    down_b: Tensor,
    scaling: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    e = x.new_empty((*x.shape[:-1], gate_weight.shape[0]))
    return x.new_empty((*x.shape[:-1], down_weight.shape[0])), e, torch.empty_like(e)


class Projection(NamedTuple):
    weight: Tensor
    a: Tensor
    b: Tensor


class Saved(NamedTuple):
    x: Tensor
    gate: Projection
    up: Projection
    down: Projection
    scaling: float
    e: Tensor
    g: Tensor


class Shared(NamedTuple):
    """What the input half hands to the weight half."""

    de: Tensor  # d loss / d e
    dg: Tensor  # d loss / d g
    dy_b: Tensor  # dY @ down.b
    de_b: Tensor  # de @ gate.b
    dg_b: Tensor  # dg @ up.b


@lora_mlp.register_save_for_backward
def _(inputs: Any, output: Tensor, residuals: Any) -> Saved:
    def projection(name: str) -> Projection:
        return Projection(*(getattr(inputs, f"{name}_{p}") for p in ("weight", "a", "b")))

    return Saved(
        inputs.x,
        projection("gate"),
        projection("up"),
        projection("down"),
        inputs.scaling,
        residuals.e,
        residuals.g,
    )


@lora_mlp.register_backward_shared
def _(ctx: cg.BackwardContext, saved: Saved, grad: Tensor) -> Shared:
    s, e, g, down = saved.scaling, saved.e, saved.g, saved.down
    dy_b = grad @ down.b.to(grad.dtype)
    dh = grad @ down.weight + s * (dy_b @ down.a.to(grad.dtype))  # dY @ W_down, once
    sig = torch.sigmoid(e)
    de = dh * g * sig * (1 + e * (1 - sig))  # silu'(e) = sig * (1 + e * (1 - sig))
    dg = dh * e * sig
    return Shared(de, dg, dy_b, de @ saved.gate.b.to(de.dtype), dg @ saved.up.b.to(dg.dtype))


@lora_mlp.register_backward_input(differentiable=False)
def _(ctx: cg.BackwardContext, saved: Saved, grad: Tensor) -> dict[str, Tensor | None]:
    sh: Shared = ctx.shared
    s, gate, up = saved.scaling, saved.gate, saved.up
    dx = sh.de @ gate.weight + s * (sh.de_b @ gate.a.to(grad.dtype))
    dx = dx + sh.dg @ up.weight + s * (sh.dg_b @ up.a.to(grad.dtype))
    return {"x": dx}


@lora_mlp.register_backward_weight(differentiable=False)
def _(ctx: cg.BackwardContext, saved: Saved, grad: Tensor) -> dict[str, Tensor | None]:
    sh: Shared = ctx.shared
    s = saved.scaling
    h = torch.nn.functional.silu(saved.e) * saved.g  # recomputed: elementwise
    return {
        **_projection_grads(ctx, "gate", saved.x, saved.gate, sh.de, sh.de_b, s),
        **_projection_grads(ctx, "up", saved.x, saved.up, sh.dg, sh.dg_b, s),
        **_projection_grads(ctx, "down", h, saved.down, grad, sh.dy_b, s),
    }


def _projection_grads(
    ctx: cg.BackwardContext,
    name: str,
    x: Tensor,
    proj: Projection,
    dy: Tensor,
    dy_b: Tensor,
    scaling: float,
) -> dict[str, Tensor | None]:
    """Gradients of one projection's weights (only those the pass needs), from its input ``x``,
    output gradient ``dy`` and ``dy @ b``; each in its weight's dtype."""
    xs = x.reshape(-1, x.shape[-1])
    dys = dy.reshape(-1, dy.shape[-1])
    grads: dict[str, Tensor | None] = {}
    if ctx.needs_input_grad(f"{name}_a"):
        grads[f"{name}_a"] = (scaling * (dy_b.reshape(-1, dy_b.shape[-1]).mT @ xs)).to(proj.a.dtype)
    if ctx.needs_input_grad(f"{name}_b"):
        x_a = xs @ proj.a.to(xs.dtype).mT
        grads[f"{name}_b"] = (scaling * (dys.mT @ x_a)).to(proj.b.dtype)
    if ctx.needs_input_grad(f"{name}_weight"):  # the base weights are usually frozen
        grads[f"{name}_weight"] = dys.mT @ xs
    return grads
