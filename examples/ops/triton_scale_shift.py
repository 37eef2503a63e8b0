"""``examples::scale_shift``: ``x * weight + bias`` per feature, with a Triton kernel.

The pattern for a library author with a fast kernel:

1. define the op with a portable torch implementation (the kernel for every device);
2. when Triton is available, register a Triton launch as the ``"cuda"`` kernel
   (``register_kernel("cuda")``), compiled by Triton; when Triton's interpreter is on
   (``TRITON_INTERPRET=1`` before Triton is imported, as in the test suite), register it for
   ``"cpu"`` too, so CPU tensors run the same kernel interpreted; otherwise CPU (or CUDA without
   Triton) runs the torch implementation;
3. give it a fake kernel, so ``torch.compile`` treats the launch as an opaque op;
4. in the backward, call a kernel through another op (here ``examples::scale``) rather than
   launching Triton directly, so the backward traces under ``torch.compile`` too.

FLOP counters cannot see inside a Triton kernel; ``check_op`` therefore also counts how often
each half of the backward runs in each pass.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import customgrad as cg

__all__ = ["HAS_TRITON", "INTERPRETED", "scale", "scale_shift"]

try:  # Triton is optional: without it (or without CUDA) the torch kernels run.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

INTERPRETED = HAS_TRITON and bool(triton.knobs.runtime.interpret)
"""Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``): CPU runs them too."""


@cg.op("examples::scale_shift", weights=("weight", "bias"))
def scale_shift(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """``x * weight + bias``, ``weight`` and ``bias`` of shape ``(x.shape[-1],)``."""
    return x * weight + bias


@cg.op("examples::scale", weights=("weight",))
def scale(x: Tensor, weight: Tensor) -> Tensor:
    """``x * weight`` per feature: the input gradient of ``scale_shift``, also a kernel."""
    return x * weight


@scale_shift.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@scale.register_fake
def _(x: Tensor, weight: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# -- autograd ------------------------------------------------------------------------------------
@scale_shift.register_save_for_backward
def _(inputs: Any, output: Tensor) -> Any:
    return inputs.x, inputs.weight


@scale_shift.register_backward_input
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor | None]:
    _, weight = saved
    return {"x": scale(grad.contiguous(), weight)}  # the Triton kernel on CUDA


@scale_shift.register_backward_weight
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor | None]:
    x, weight = saved
    g = grad.reshape(-1, weight.shape[0])
    return {
        "weight": (g * x.reshape(-1, weight.shape[0])).sum(0),
        "bias": g.sum(0),
    }


@scale.register_save_for_backward
def _(inputs: Any, output: Tensor) -> Any:
    return inputs.x, inputs.weight


@scale.register_backward_input
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor | None]:
    _, weight = saved
    return {"x": scale(grad.contiguous(), weight)}


@scale.register_backward_weight
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor | None]:
    x, weight = saved
    return {"weight": (grad * x).reshape(-1, weight.shape[0]).sum(0)}


# -- the Triton kernels: CUDA compiled, CPU when interpreted -------------------------------------
if HAS_TRITON:

    @triton.jit
    def _scale_shift_kernel(
        x_ptr, w_ptr, b_ptr, out_ptr, n, d, HAS_B: tl.constexpr, BLOCK: tl.constexpr
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        col = offs % d
        x = tl.load(x_ptr + offs, mask=mask)
        y = x * tl.load(w_ptr + col, mask=mask)
        if HAS_B:
            y = y + tl.load(b_ptr + col, mask=mask)
        tl.store(out_ptr + offs, y, mask=mask)

    def _launch(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        n, d = x.numel(), x.shape[-1]
        block = 1024
        _scale_shift_kernel[(triton.cdiv(n, block),)](
            x, weight, bias if bias is not None else weight, out, n, d, bias is not None, block
        )
        return out

    _devices = ("cuda", "cpu") if INTERPRETED else ("cuda",)

    @scale_shift.register_kernel(_devices)
    def _(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        return _launch(x, weight.contiguous(), bias.contiguous())

    @scale.register_kernel(_devices)
    def _(x: Tensor, weight: Tensor) -> Tensor:
        return _launch(x, weight.contiguous(), None)
