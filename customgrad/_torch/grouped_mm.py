"""``torch._grouped_mm``, torch's grouped GEMM (private: no public name yet).

- :func:`grouped_mm`: ``torch._grouped_mm(a, b, offs=offs)``: with ``a`` ``(m, k)`` and ``b``
  ``(g, k, n)``, rows ``offs[i-1]:offs[i]`` of ``a`` times ``b[i]``; with ``a`` ``(k, m)`` and
  ``b`` ``(m, n)``, the groups split the reduced dimension: ``(g, k, n)``;
- :func:`takes`: whether it takes these operands: their dtype on their device (probed once per
  device type and dtype: CPU takes float32, bfloat16 and float16, not float64; CUDA depends on
  the GPU and the release) and their layout (its stride rule, read from ATen's
  ``check_valid_strides_and_return_transposed``: one of the last two dimensions contiguous, the
  other's stride a multiple of 16 bytes; on a GPU the data 16-byte aligned too; no empty
  operand, which some releases refuse). Where it does not, customgrad's grouped GEMM loops over
  the groups instead: slower, never wrong.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["grouped_mm", "takes"]


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)``."""
    return torch._grouped_mm(a, b, offs=offs)


def takes(*mats: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes ``mats`` as operands (dtype, device and layout)."""
    return all(_layout_ok(m) for m in mats) and all(_runs(m.device.type, m.dtype) for m in mats)


def _layout_ok(mat: torch.Tensor) -> bool:
    if mat.dim() not in (2, 3) or mat.numel() == 0:
        return False
    if mat.device.type != "cpu" and mat.data_ptr() % 16 != 0:
        return False
    (rows, cols), (row_stride, col_stride) = mat.shape[-2:], mat.stride()[-2:]
    alignment = max(1, 16 // mat.element_size())
    if row_stride == 1 and col_stride >= max(1, rows):
        return col_stride % alignment == 0
    if col_stride == 1 and row_stride >= max(1, cols):
        return row_stride % alignment == 0
    return False


@functools.cache
def _runs(device_type: str, dtype: torch.dtype) -> bool:
    """One small call on ``device_type`` in ``dtype``: does ``torch._grouped_mm`` run there?"""
    try:
        a = torch.ones(2, 8, dtype=dtype, device=device_type)
        b = torch.ones(1, 8, 8, dtype=dtype, device=device_type)
        offs = torch.tensor([2], dtype=torch.int32, device=device_type)
        torch._grouped_mm(a, b, offs=offs)
    except (AttributeError, RuntimeError, NotImplementedError, TypeError):
        return False
    return True
