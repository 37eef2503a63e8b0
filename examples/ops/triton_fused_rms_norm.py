"""``examples::triton_rms_norm``: RMSNorm with Triton kernels, its backward fused into one launch.

Written for this project (in the style of Liger-Kernel's RMSNorm, not copied from it): the
forward kernel normalizes one row per program and keeps ``rstd`` for the backward; the backward
kernel computes the input gradient **and** the weight gradient in one launch (each program walks
a block of rows, writes their ``dx`` and one partial sum of ``dw``).

How it launches that backward kernel once across the input pass (I) and the weight pass (W):

1. the backward kernel is an op of its own, ``examples::triton_rms_norm_backward``, with a fake
   kernel, so ``torch.compile`` and customgrad's tracing treat the launch as one opaque call;
2. ``register_backward_shared`` calls it: customgrad runs the shared function once per op call,
   in the earlier pass that needs a gradient, and hands its result to the other pass
   (``ctx.shared``); the input half returns ``dx`` from it, the weight half ``dw``.

Where the kernels run: on CUDA, compiled by Triton; on CPU, in Triton's interpreter when
``TRITON_INTERPRET=1`` is set before Triton is imported (the test suite does), else a torch
implementation of the same maths. The Triton kernels take float32, float16 and bfloat16 (they
compute in float32); float64 is refused with an error that says so.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import customgrad as cg
from customgrad import UnsupportedError

__all__ = [
    "HAS_TRITON",
    "INTERPRETED",
    "TRITON_DTYPES",
    "triton_rms_norm",
    "triton_rms_norm_backward",
]

try:  # Triton is optional: without it the torch implementation runs everywhere.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

INTERPRETED = HAS_TRITON and bool(triton.knobs.runtime.interpret)
"""Whether the kernels below run in Triton's interpreter (``TRITON_INTERPRET=1``): then CPU
tensors run them too."""

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The dtypes the Triton kernels take."""


# -- the op, its torch implementation (CPU without the interpreter) and fake kernels -----------
@cg.op("examples::triton_rms_norm", weights=("weight",), residuals=("rstd",))
def triton_rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """``x / rms(x) * weight`` over the last dimension; keeps ``rstd`` (float32, one per row).

    Calling the op returns the normalized tensor only (same shape and dtype as ``x``).
    """
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + eps)
    return (x.float() * rstd[..., None] * weight.float()).to(x.dtype), rstd


@cg.op("examples::triton_rms_norm_backward")
def triton_rms_norm_backward(
    grad: Tensor, x: Tensor, weight: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor]:
    """Both gradients of :func:`triton_rms_norm`: ``(dx, dweight)``, computed together."""
    g, xf, w = grad.float(), x.float(), weight.float()
    x_hat = xf * rstd[..., None]
    gw = g * w
    dx = rstd[..., None] * (gw - x_hat * (gw * x_hat).mean(-1, keepdim=True))
    dw = (g * x_hat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


@triton_rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(
        x.shape[:-1], dtype=torch.float32
    )


@triton_rms_norm_backward.register_fake
def _(grad: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


# -- autograd: one backward launch, shared by the two halves -----------------------------------
@triton_rms_norm.register_save_for_backward
def _(inputs: Any, output: Tensor, residuals: Any) -> Any:
    return inputs.x, inputs.weight, residuals.rstd


@triton_rms_norm.register_backward_shared
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
    x, weight, rstd = saved
    return triton_rms_norm_backward(grad, x, weight, rstd)  # one launch: dx and dweight


@triton_rms_norm.register_backward_input(differentiable=False)
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor | None]:
    return {"x": ctx.shared[0]}


@triton_rms_norm.register_backward_weight(differentiable=False)
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor | None]:
    return {"weight": ctx.shared[1]}


# -- the Triton kernels -------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _forward_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        tl.store(rstd_ptr + row, rstd)
        y = x * rstd * w
        tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _backward_kernel(
        g_ptr,
        x_ptr,
        w_ptr,
        rstd_ptr,
        dx_ptr,
        dw_partial_ptr,
        n_rows,
        n_cols,
        rows_per_program,
        BLOCK: tl.constexpr,
    ):
        """``dx`` of rows ``[start, end)`` and their partial ``dw`` sum, in one program."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK,), dtype=tl.float32)
        start = pid * rows_per_program
        end = tl.minimum(start + rows_per_program, n_rows)
        for row in range(start, end):
            x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            x_hat = x * rstd
            gw = g * w
            dx = rstd * (gw - x_hat * (tl.sum(gw * x_hat, axis=0) / n_cols))
            tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += g * x_hat
        tl.store(dw_partial_ptr + pid * n_cols + cols, dw, mask=mask)

    def _check(op: str, *tensors: Tensor) -> None:
        bad = [t.dtype for t in tensors if t.dtype not in TRITON_DTYPES]
        if bad:
            raise UnsupportedError(
                f"{op}: the Triton kernel takes float32, float16 or bfloat16 tensors, got "
                f"{bad[0]}. Convert the arguments (x.float()), or check the op in its own dtype: "
                f"check_op(op, ..., dtype=torch.float32)."
            )

    def _forward(x: Tensor, weight: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
        _check("examples::triton_rms_norm", x, weight)
        n_cols = x.shape[-1]
        x2 = x.reshape(-1, n_cols).contiguous()
        y = torch.empty_like(x2)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(n_cols)
        _forward_kernel[(x2.shape[0],)](x2, weight.contiguous(), y, rstd, n_cols, eps, block)
        return y.view(x.shape), rstd.view(x.shape[:-1])

    def _backward(grad: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
        _check("examples::triton_rms_norm_backward", grad, x, weight)
        n_cols = x.shape[-1]
        x2 = x.reshape(-1, n_cols).contiguous()
        g2 = grad.reshape(-1, n_cols).contiguous()
        n_rows = x2.shape[0]
        programs = min(n_rows, 64) if n_rows else 1
        rows_per_program = triton.cdiv(n_rows, programs)
        dx = torch.empty_like(x2)
        dw_partial = torch.empty(programs, n_cols, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(n_cols)
        _backward_kernel[(programs,)](
            g2, x2, weight.contiguous(), rstd.contiguous(), dx, dw_partial,
            n_rows, n_cols, rows_per_program, block,
        )  # fmt: skip
        return dx.view(x.shape), dw_partial.sum(0).to(weight.dtype)

    # CUDA runs the kernels compiled; CPU runs them in the interpreter when it is on.
    _devices = ("cuda", "cpu") if INTERPRETED else ("cuda",)
    triton_rms_norm.register_kernel(_devices, _forward)
    triton_rms_norm_backward.register_kernel(_devices, _backward)
