"""The grouped GEMM of a mixture-of-experts layer as a customgrad op, split exactly.

Tokens arrive sorted by expert; ``offs[e]`` is the end row of expert ``e``'s tokens (a running
sum of the tokens per expert, int32, as torchtitan passes it), so expert ``e`` owns rows
``offs[e-1]:offs[e]`` (``0:offs[0]`` for the first) and may own none. Each op family has two ops:

- ``grouped_mm(x, w, offs)``: ``x`` ``(M, K)``, ``w`` ``(E, K, N)`` (expert ``e``'s weight
  ``w[e]``, as ``torch._grouped_mm`` and torchtitan's ``GroupedExperts._grouped_mm(A, B_t,
  offs)`` take it: the ``(E, N, K)`` parameter transposed): rows of expert ``e`` times ``w[e]``,
  ``(M, N)``; rows past ``offs[-1]`` are zero. ``w`` is its weight (``weights=("w",)``).
- ``grouped_weight_grad(x, grad, offs)``: ``x`` ``(M, K)``, ``grad`` ``(M, N)``: for each
  expert, its rows of ``x`` transposed times its rows of ``grad``, ``(E, K, N)``: the weight
  gradient (zero for an expert with no tokens).

The backward is the pair: the input half is one grouped GEMM (``grouped_mm(grad, w.mT, offs)``,
the dX GEMMs), the weight half the other (``grouped_weight_grad(x, grad, offs)``, the dW
GEMMs), so a zero-bubble schedule's I runs the first and its W the second, nothing twice. The
offsets are a tensor argument: the routing changes their values, never the op's signature, so
nothing is traced or specialized per routing. Each op gives its FLOPs (``register_flops``:
``2 * M * K * N`` each), so FLOP counters see it, Triton kernels included.

Two families are defined here by :func:`define`, the same registrations with other kernels:
torch's (``torch._grouped_mm`` where it takes the operands, else a loop over the experts) and
Triton's (:mod:`customgrad.ops._triton_grouped_mm`). A team's own kernel (an FP8 or MXFP8
scaled grouped GEMM) is registered the same way: docs/writing-ops/grouped-gemm.md.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

import customgrad as cg
from customgrad._errors import ArgumentTypeError, ArgumentValueError
from customgrad._torch import grouped_mm as torch_grouped
from customgrad._torch.fake import is_fake

__all__ = ["GroupedGemm", "define", "torch_grouped_mm", "torch_grouped_weight_grad"]

Kernel = Callable[[Tensor, Tensor, Tensor], Tensor]
"""A kernel of either op: ``(x, w, offs) -> out`` or ``(x, grad, offs) -> weight gradient``."""

OFFS_FIX = (
    "Pass the end row of each expert's tokens, a running sum of the tokens per expert: "
    "torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)."
)


class GroupedGemm(NamedTuple):
    """One grouped GEMM family: the op and the op its weight half calls."""

    mm: cg.CustomOp[[Tensor, Tensor, Tensor], Tensor]
    """``(x (M, K), w (E, K, N), offs (E,)) -> (M, N)``; ``w`` is the weight."""
    weight_grad: cg.CustomOp[[Tensor, Tensor, Tensor], Tensor]
    """``(x (M, K), grad (M, N), offs (E,)) -> (E, K, N)``."""


def _shape(t: Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)} on {t.device}"


def check_arguments(op: str, x: Tensor, other: Tensor, offs: Tensor, weight_grad: bool) -> None:
    """Refuse what neither kernel could compute right: shapes, dtypes, devices, and (on the CPU,
    where reading them costs no synchronization) the offsets' values.

    ``other`` is ``w`` ``(E, K, N)`` for ``grouped_mm``, ``grad`` ``(M, N)`` for
    ``grouped_weight_grad``.

    Raises:
        ArgumentTypeError: an argument is not a tensor.
        ArgumentValueError: a shape, dtype, device or offset value that does not fit.
    """
    other_name = "grad" if weight_grad else "w"
    for name, t in (("x", x), (other_name, other), ("offs", offs)):
        if not isinstance(t, Tensor):
            raise ArgumentTypeError(f"{op}: {name!r} must be a tensor, got {type(t).__name__}.")
    if x.dim() != 2:
        raise ArgumentValueError(
            f"{op}: 'x' must be 2-D (tokens sorted by expert, features), got {_shape(x)}. "
            f"Flatten the batch dimensions first: x.flatten(0, -2)."
        )
    if weight_grad:
        if other.dim() != 2 or other.shape[0] != x.shape[0]:
            raise ArgumentValueError(
                f"{op}: 'grad' must be 2-D with x's {x.shape[0]} rows, got {_shape(other)}. "
                f"Pass the gradient of grouped_mm's output."
            )
        experts = offs.shape[0] if offs.dim() == 1 else -1
    else:
        if other.dim() != 3 or other.shape[1] != x.shape[1]:
            raise ArgumentValueError(
                f"{op}: 'w' must be 3-D (experts, {x.shape[1]} = x's features, out features), "
                f"got {_shape(other)}. Pass the experts' weights as torchtitan's _grouped_mm "
                f"takes them: w_EFD.transpose(-2, -1)."
            )
        experts = other.shape[0]
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.shape[0] != experts or experts < 1:
        want = f"length {experts} (one per expert)" if experts >= 1 else "at least one expert"
        raise ArgumentValueError(
            f"{op}: 'offs' must be a 1-D int32 tensor of {want}, got {_shape(offs)}. {OFFS_FIX}"
        )
    if other.dtype != x.dtype:
        raise ArgumentValueError(
            f"{op}: {other_name!r} must have x's dtype {x.dtype}, got {other.dtype}. Cast one "
            f"to the other's dtype (torchtitan casts both to bfloat16)."
        )
    if not x.dtype.is_floating_point:
        raise ArgumentValueError(
            f"{op}: 'x' must be a floating-point tensor (float32, bfloat16, float16 or "
            f"float64), got {x.dtype}. Cast x and {other_name} with .float()."
        )
    if other.device != x.device or offs.device != x.device:
        raise ArgumentValueError(
            f"{op}: x, {other_name} and offs must be on one device, got {x.device}, "
            f"{other.device} and {offs.device}. Move offs with .to(x.device)."
        )
    if offs.device.type == "cpu" and not is_fake(offs):
        _check_offsets(op, offs.tolist(), x.shape[0])


def _check_offsets(op: str, ends: Sequence[int], rows: int) -> None:
    start = 0
    for e, end in enumerate(ends):
        if end < start or end > rows:
            raise ArgumentValueError(
                f"{op}: 'offs' must rise from 0 to at most x's {rows} rows, got {list(ends)} "
                f"(expert {e} would end at row {end} after starting at {start}). {OFFS_FIX}"
            )
        start = end


def _groups(offs: Tensor) -> list[tuple[int, int, int]]:
    """``(expert, start, end)`` of every expert that has tokens (a host read of ``offs``)."""
    start, out = 0, []
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out.append((e, start, end))
        start = end
    return out


def _zero_tail(out: Tensor, offs: Tensor) -> Tensor:
    """Rows past the last expert's end are zero (``torch._grouped_mm`` leaves them unset)."""
    rows = torch.arange(out.shape[0], device=out.device)
    return out.masked_fill_((rows >= offs[-1]).unsqueeze(1), 0)


def torch_grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """``grouped_mm``'s torch kernel: ``torch._grouped_mm`` where it takes the operands (CPU and
    CUDA, float32 / bfloat16 / float16, 16-byte aligned rows), else one matmul per expert."""
    if torch_grouped.takes(x, w):
        return _zero_tail(torch_grouped.grouped_mm(x, w, offs).contiguous(), offs)
    out = x.new_zeros((x.shape[0], w.shape[2]))
    for e, start, end in _groups(offs):
        out[start:end] = x[start:end] @ w[e]
    return out


def torch_grouped_weight_grad(x: Tensor, grad: Tensor, offs: Tensor) -> Tensor:
    """``grouped_weight_grad``'s torch kernel: ``torch._grouped_mm`` over the reduced (token)
    dimension where it takes the operands, else one matmul per expert."""
    if torch_grouped.takes(x.mT, grad):
        return torch_grouped.grouped_mm(x.mT, grad, offs).contiguous()
    out = x.new_zeros((offs.shape[0], x.shape[1], grad.shape[1]))
    for e, start, end in _groups(offs):
        out[e] = x[start:end].mT @ grad[start:end]
    return out


def _gemm_flops(x: Tensor, other: Tensor, offs: Tensor) -> int:
    """Either op (``other``: ``w`` or ``grad``): one ``(M, K) x (K, N)`` product over the
    experts' rows, ``2 * M * K * N`` (every row counted, as torch counts ``torch._grouped_mm``)."""
    rows, k = x.shape
    return 2 * int(rows) * int(k) * int(other.shape[-1])


def define(
    namespace: str,
    name: str,
    kernels: tuple[Kernel, Kernel] | None = None,
    device_types: Sequence[str] = (),
    dtypes: Collection[torch.dtype] = (torch.float32, torch.bfloat16, torch.float16),
) -> GroupedGemm:
    """Define ``namespace::name`` and ``namespace::name_weight_grad`` with the registrations
    described in the module docstring. ``kernels`` (the op's and the weight gradient's) serve
    ``device_types`` in ``dtypes``; torch's kernels serve the rest (everything without
    ``kernels``)."""
    op_name, wg_name = f"{namespace}::{name}", f"{namespace}::{name}_weight_grad"

    def grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
        """``x`` ``(M, K)`` times expert ``e``'s ``w[e]`` (``w`` ``(E, K, N)``) for the rows of
        expert ``e`` (rows ``offs[e-1]`` to ``offs[e]``; ``offs`` int32, ascending): ``(M, N)``,
        zero past ``offs[-1]``. Backward: the dX GEMMs in the input pass, the dW GEMMs (the
        op's weight gradient op) in the weight pass."""
        check_arguments(op_name, x, w, offs, weight_grad=False)
        return torch_grouped_mm(x, w, offs)

    def grouped_weight_grad(x: Tensor, grad: Tensor, offs: Tensor) -> Tensor:
        """The grouped GEMM's weight gradient: ``(E, K, N)``, expert ``e``'s
        ``x[rows of e].mT @ grad[rows of e]`` (zero for an expert without rows)."""
        check_arguments(wg_name, x, grad, offs, weight_grad=True)
        return torch_grouped_weight_grad(x, grad, offs)

    gemm = GroupedGemm(
        cg.op(op_name, grouped_mm, weights=("w",)), cg.op(wg_name, grouped_weight_grad)
    )
    if kernels is not None and device_types:
        _register_kernels(gemm, kernels, tuple(device_types), dtypes)
    _register_autograd(gemm)
    gemm.mm.register_flops(_gemm_flops)  # the same for every kernel, Triton's included
    gemm.weight_grad.register_flops(_gemm_flops)
    return gemm


def _register_kernels(
    gemm: GroupedGemm,
    kernels: tuple[Kernel, Kernel],
    device_types: tuple[str, ...],
    dtypes: Collection[torch.dtype],
) -> None:
    """``kernels`` for ``device_types`` in ``dtypes``; torch's for other dtypes there."""
    (mm, wg), (mm_kernel, weight_grad_kernel) = gemm, kernels

    @mm.register_kernel(device_types)
    def _(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
        check_arguments(mm.name, x, w, offs, weight_grad=False)
        kernel = mm_kernel if x.dtype in dtypes else torch_grouped_mm
        return kernel(x, w, offs)

    @wg.register_kernel(device_types)
    def _(x: Tensor, grad: Tensor, offs: Tensor) -> Tensor:
        check_arguments(wg.name, x, grad, offs, weight_grad=True)
        kernel = weight_grad_kernel if x.dtype in dtypes else torch_grouped_weight_grad
        return kernel(x, grad, offs)


def _register_autograd(gemm: GroupedGemm) -> None:
    """The fake kernels, and the backward: the pair for the op, double backward for the weight
    gradient's op."""
    mm, wg = gemm

    @mm.register_fake
    def _(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
        check_arguments(mm.name, x, w, offs, weight_grad=False)
        return x.new_empty((x.shape[0], w.shape[2]))

    @wg.register_fake
    def _(x: Tensor, grad: Tensor, offs: Tensor) -> Tensor:
        check_arguments(wg.name, x, grad, offs, weight_grad=True)
        return x.new_empty((offs.shape[0], x.shape[1], grad.shape[1]))

    @mm.register_save_for_backward
    def _(inputs: Any, output: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return inputs.x, inputs.w, inputs.offs

    @mm.register_backward_input  # I: the dX GEMMs, one grouped GEMM
    def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor]:
        _, w, offs = saved
        return {"x": mm(grad, w.mT, offs)}

    @mm.register_backward_weight  # W: the dW GEMMs
    def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor]:
        x, _, offs = saved
        return {"w": wg(x, grad, offs)}

    @wg.register_save_for_backward
    def _(inputs: Any, output: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return inputs.x, inputs.grad, inputs.offs

    @wg.register_backward  # double backward only: both gradients are grouped GEMMs
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Tensor | None]:
        x, grad, offs = saved
        return {
            "x": mm(grad, g.mT, offs) if ctx.needs_input_grad("x") else None,
            "grad": mm(x, g, offs) if ctx.needs_input_grad("grad") else None,
        }
