"""``examples::lora_linear``: a frozen linear layer plus a LoRA adapter, as unsloth fuses it.

``y = x @ W.T + s * (x @ A.T) @ B.T`` with the base weight ``W`` (out, in), usually frozen (and
in unsloth often 4-bit, dequantized on the fly), the adapter ``A`` (r, in) and ``B`` (out, r),
and ``s = lora_alpha / r``. Facts carried over from unsloth's ``LoRA_W``/``matmul_lora``:

- the adapter may be kept in float32 while activations are bfloat16: the forward casts ``A``
  and ``B`` to ``x``'s dtype, and the adapter's gradients are returned **in the adapter's
  dtype**. customgrad refuses a gradient whose dtype differs from its input's (autograd would
  cast it silently), so the weight half casts explicitly;
- ``x`` may have any leading dimensions; weight gradients flatten them (``grad.mT @ x`` on 3-D
  tensors would be a batch of gradients, which customgrad refuses instead of summing silently).

``grad @ B`` (N, r) is needed by both halves: by the input gradient ``dx = grad @ W + s *
(grad @ B) @ A`` and by the adapter gradient ``dA = s * (grad @ B).T @ x``. It is registered as
**shared work** (``register_backward_shared``): computed once per call, in the earlier pass of
a split backward, handed to the later one as ``ctx.shared`` and freed after it.

Everything is a differentiable torch op on saved inputs: double backward is exact.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

import customgrad as cg

__all__ = ["lora_linear"]


@cg.op("examples::lora_linear", weights=("weight", "lora_a", "lora_b"))
def lora_linear(
    x: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor, scaling: float = 1.0
) -> Tensor:
    """``x @ weight.T + scaling * (x @ lora_a.T) @ lora_b.T`` in ``x``'s dtype."""
    a, b = lora_a.to(x.dtype), lora_b.to(x.dtype)
    return x @ weight.mT + scaling * ((x @ a.mT) @ b.mT)


@lora_linear.register_fake
def _(x: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor, scaling: float = 1.0) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@lora_linear.register_save_for_backward
def _(inputs: Any, output: Tensor) -> Any:
    return inputs.x, inputs.weight, inputs.lora_a, inputs.lora_b, inputs.scaling


@lora_linear.register_backward_shared
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> Tensor:
    """``grad @ B``: both halves need it."""
    lora_b: Tensor = saved[3]
    return grad @ lora_b.to(grad.dtype)


@lora_linear.register_backward_input
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor | None]:
    _, weight, lora_a, _, scaling = saved
    return {"x": grad @ weight + scaling * (ctx.shared @ lora_a.to(grad.dtype))}


@lora_linear.register_backward_weight
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor | None]:
    x, _, lora_a, lora_b, scaling = saved
    xs = x.reshape(-1, x.shape[-1])  # (N, in)
    g = grad.reshape(-1, grad.shape[-1])  # (N, out)
    grads: dict[str, Tensor | None] = {}
    if ctx.needs_input_grad("lora_a"):
        grad_b = ctx.shared.reshape(-1, lora_b.shape[-1])  # (N, r)
        grads["lora_a"] = (scaling * (grad_b.mT @ xs)).to(lora_a.dtype)
    if ctx.needs_input_grad("lora_b"):
        x_a = xs @ lora_a.to(x.dtype).mT  # (N, r)
        grads["lora_b"] = (scaling * (g.mT @ x_a)).to(lora_b.dtype)
    if ctx.needs_input_grad("weight"):  # the base weight is usually frozen
        grads["weight"] = g.mT @ xs
    return grads
