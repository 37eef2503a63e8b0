"""Ready-made customgrad ops: the kernels teams swap into models, with an exact I/W split.

A mixture-of-experts layer's grouped GEMM (tokens sorted by expert, ``offs`` the end row of
each expert's tokens, int32, as torchtitan passes it):

- :data:`grouped_mm` ``(x, w, offs)``: ``x`` ``(M, K)`` times expert ``e``'s ``w[e]`` (``w``
  ``(E, K, N)``) for the rows of expert ``e``: ``(M, N)``; rows past ``offs[-1]`` are zero.
  Its backward is the pair: the input pass computes ``grouped_mm(grad, w.mT, offs)`` (the dX
  GEMMs), the weight pass :data:`grouped_weight_grad` ``(x, grad, offs)`` (the dW GEMMs). torch's
  kernel: ``torch._grouped_mm`` where it takes the operands, else a loop over the experts.
- :data:`triton_grouped_mm`, :data:`triton_grouped_weight_grad`: the same ops with Triton
  kernels for float32, bfloat16 and float16 on CUDA (and on CPU when Triton's interpreter is
  on, ``TRITON_INTERPRET=1``); torch's kernels for the rest.

Swap one into torchtitan's MoE through its ``GroupedExperts._grouped_mm`` seam, whose
``(A, B_t, offs)`` is this ``(x, w, offs)``::

    from torchtitan.models.common.moe import GroupedExperts
    import customgrad.ops

    class SplitGroupedExperts(GroupedExperts):
        def _grouped_mm(self, *, A, B_t, offs):
            return customgrad.ops.grouped_mm(A, B_t, offs)

Example:
    >>> import torch
    >>> from customgrad.ops import grouped_mm
    >>> x = torch.randn(5, 8, requires_grad=True)
    >>> w = torch.randn(2, 8, 4, requires_grad=True)
    >>> offs = torch.tensor([3, 5], dtype=torch.int32)  # rows 0-2: expert 0; 3-4: expert 1
    >>> y = grouped_mm(x, w, offs)
    >>> torch.allclose(y[3:], x[3:] @ w[1])
    True
    >>> y.sum().backward()
    >>> w.grad.shape
    torch.Size([2, 8, 4])
"""

from customgrad.ops import _triton_grouped_mm as _triton
from customgrad.ops._grouped_mm import define as _define

__all__ = [
    "grouped_mm",
    "grouped_weight_grad",
    "triton_grouped_mm",
    "triton_grouped_weight_grad",
]

grouped_mm, grouped_weight_grad = _define("customgrad", "grouped_mm")

triton_grouped_mm, triton_grouped_weight_grad = _define(
    "customgrad",
    "triton_grouped_mm",
    (_triton.grouped_mm, _triton.grouped_weight_grad),
    _triton.DEVICE_TYPES,
)
