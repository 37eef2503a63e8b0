"""Triton kernels of the grouped GEMM: compiled on CUDA, on CPU through Triton's interpreter
(``TRITON_INTERPRET=1`` set before Triton is imported; small shapes: it runs each program in
Python).

- :func:`grouped_mm`: a program per ``(BLOCK_M, BLOCK_N)`` tile of the output; a tile's rows
  may belong to several experts (the groups are not aligned to tiles), so the program walks the
  experts whose rows meet its tile, each a masked GEMM with that expert's weight; rows past the
  last expert's end stay zero. Work: about ``M / BLOCK_M + E`` tile GEMMs per column block.
- :func:`grouped_weight_grad`: a program per expert and ``(BLOCK_K, BLOCK_N)`` tile of its
  weight gradient, reducing over that expert's rows; an expert with no tokens writes zeros.

Both accumulate in float32 (float32 inputs multiply in IEEE float32, not TF32, so they match
torch's float32) and store in the inputs' dtype. Triton's interpreter multiplies bfloat16 tiles
wrongly in ``tl.dot`` (it keeps bfloat16 as uint16 for numpy, and triton 3.9 multiplies those);
there the tiles are multiplied in float32 instead (``DOT_F32``), which gives the same products
(one of two bfloat16 values is exact in float32). Triton is optional: :data:`HAS_TRITON` says
whether it imported.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "DEVICE_TYPES",
    "HAS_TRITON",
    "INTERPRETED",
    "grouped_mm",
    "grouped_weight_grad",
    "kernels",
]

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

INTERPRETED = HAS_TRITON and bool(triton.knobs.runtime.interpret)
"""Whether the kernels run in Triton's interpreter (then CPU tensors run them too)."""

DEVICE_TYPES: tuple[str, ...] = (
    (("cuda", "cpu") if INTERPRETED else ("cuda",)) if HAS_TRITON else ()
)
"""The devices these kernels serve: CUDA, and the CPU when interpreted; none without Triton."""

BLOCK = 32
"""Each tile's side (``tl.dot`` needs at least 16)."""


def _dot_f32(dtype: torch.dtype) -> bool:
    return INTERPRETED and dtype == torch.bfloat16


if HAS_TRITON:

    @triton.jit
    def _grouped_mm_kernel(
        x_ptr, w_ptr, out_ptr, offs_ptr, M, N, K, E,
        stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_om, stride_on,
        DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        tile_start = pid_m * BLOCK_M
        rows = tile_start + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        for e in range(0, E):
            start = tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)), 0)
            end = tl.load(offs_ptr + e)
            if (start < end) & (start < tile_start + BLOCK_M) & (end > tile_start):
                in_group = (rows >= start) & (rows < end)
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    ks = k0 + tl.arange(0, BLOCK_K)
                    a = tl.load(
                        x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                        mask=in_group[:, None] & (ks[None, :] < K),
                        other=0.0,
                    )
                    b = tl.load(
                        w_ptr + e * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                        mask=(ks[:, None] < K) & (cols[None, :] < N),
                        other=0.0,
                    )
                    if DOT_F32:
                        a, b = a.to(tl.float32), b.to(tl.float32)
                    acc = tl.dot(a, b, acc, input_precision="ieee")
                tl.store(
                    out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on,
                    acc.to(out_ptr.dtype.element_ty),
                    mask=in_group[:, None] & (cols[None, :] < N),
                )

    @triton.jit
    def _grouped_weight_grad_kernel(
        x_ptr, g_ptr, out_ptr, offs_ptr, K, N,
        stride_xm, stride_xk, stride_gm, stride_gn, stride_oe, stride_ok, stride_on,
        DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        e, pid_k, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start = tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)), 0)
        end = tl.load(offs_ptr + e)
        ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            a = tl.load(  # x's rows of this expert, transposed: (BLOCK_K, BLOCK_M)
                x_ptr + rows[None, :] * stride_xm + ks[:, None] * stride_xk,
                mask=(rows[None, :] < end) & (ks[:, None] < K),
                other=0.0,
            )
            b = tl.load(
                g_ptr + rows[:, None] * stride_gm + cols[None, :] * stride_gn,
                mask=(rows[:, None] < end) & (cols[None, :] < N),
                other=0.0,
            )
            if DOT_F32:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        tl.store(
            out_ptr + e * stride_oe + ks[:, None] * stride_ok + cols[None, :] * stride_on,
            acc.to(out_ptr.dtype.element_ty),
            mask=(ks[:, None] < K) & (cols[None, :] < N),
        )


def grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """``(M, K) x (E, K, N) -> (M, N)`` by :func:`_grouped_mm_kernel` (one launch)."""
    (rows, k), (experts, _, n) = x.shape, w.shape
    out = torch.zeros((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    grid = (triton.cdiv(rows, BLOCK), triton.cdiv(n, BLOCK))
    _grouped_mm_kernel[grid](
        x, w, out, offs, rows, n, k, experts, *x.stride(), *w.stride(), *out.stride(),
        DOT_F32=_dot_f32(x.dtype), BLOCK_M=BLOCK, BLOCK_N=BLOCK, BLOCK_K=BLOCK,
    )  # fmt: skip
    return out


def grouped_weight_grad(x: Tensor, grad: Tensor, offs: Tensor) -> Tensor:
    """``(M, K), (M, N) -> (E, K, N)`` by :func:`_grouped_weight_grad_kernel` (one launch)."""
    (_, k), n, experts = x.shape, grad.shape[1], offs.shape[0]
    out = torch.empty((experts, k, n), dtype=x.dtype, device=x.device)
    if k == 0 or n == 0:
        return out
    grid = (experts, triton.cdiv(k, BLOCK), triton.cdiv(n, BLOCK))
    _grouped_weight_grad_kernel[grid](
        x, grad, out, offs, k, n, *x.stride(), *grad.stride(), *out.stride(),
        DOT_F32=_dot_f32(x.dtype), BLOCK_M=BLOCK, BLOCK_K=BLOCK, BLOCK_N=BLOCK,
    )  # fmt: skip
    return out


def kernels() -> tuple[object, ...]:
    """The ``@triton.jit`` kernels (for counting their launches); none without Triton."""
    if not HAS_TRITON:
        return ()
    return (_grouped_mm_kernel, _grouped_weight_grad_kernel)
