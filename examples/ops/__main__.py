"""Check every example op: ``python -m examples.ops`` (on CUDA too when a GPU is there)."""

from __future__ import annotations

import torch

from customgrad.testing import CHECKS, check_op
from examples.ops import (
    HAS_TRITON,
    gelu_linear,
    grouped_linear,
    linear,
    linear_cross_entropy,
    lora_linear,
    lora_mlp,
    rms_norm,
    scale_shift,
    silu_and_mul,
    triton_rms_norm,
    varlen_attention,
)

# Ops registered with differentiable=False (their backward uses tensors from the forward) have no
# double backward to check.
ONCE_DIFFERENTIABLE = [c for c in CHECKS if c != "gradgradcheck"]


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device)

    def show(report: object) -> None:
        print(report, end="\n\n")

    print(f"device: {device}; Triton kernels: {HAS_TRITON and device == 'cuda'}\n")
    show(check_op(linear, r(2, 4, 3), r(5, 3), r(5)))
    show(check_op(gelu_linear, r(2, 4, 3), r(5, 3), r(5)))
    show(check_op(scale_shift, r(4, 8), r(8), r(8)))
    # Triton kernels have no float64 path: checked in float32, the backward launches counted.
    show(check_op(triton_rms_norm, r(4, 8), r(8), dtype=torch.float32, checks=ONCE_DIFFERENTIABLE))

    # the seven real ops
    show(check_op(silu_and_mul, r(2, 4, 8)))
    show(check_op(rms_norm, r(2, 4, 8), r(8), checks=ONCE_DIFFERENTIABLE))
    target = torch.tensor([1, 4, -100, 2, 0, 3], device=device)
    for reduction in ("mean", "none"):
        show(
            check_op(
                linear_cross_entropy,
                r(6, 4),
                r(9, 4),
                target,
                r(9),
                lse_square_scale=1e-2,
                reduction=reduction,
                return_z_loss=True,
                checks=ONCE_DIFFERENTIABLE,
            )
        )
    show(check_op(lora_linear, r(2, 3, 8), r(6, 8), r(2, 8), r(6, 2), 0.5))
    hidden, inner, rank = 8, 12, 2
    show(
        check_op(
            lora_mlp,
            r(5, hidden),
            *(r(inner, hidden), r(rank, hidden), r(inner, rank)),  # gate
            *(r(inner, hidden), r(rank, hidden), r(inner, rank)),  # up
            *(r(hidden, inner), r(rank, inner), r(hidden, rank)),  # down
            0.5,
            checks=ONCE_DIFFERENTIABLE,
        )
    )
    cu_seqlens = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    q, k, v = r(8, 4, 3), r(8, 2, 3), r(8, 2, 3)
    show(
        check_op(
            varlen_attention,
            q,
            k,
            v,
            cu_seqlens,
            cu_seqlens,
            5,
            5,
            causal=True,
            checks=ONCE_DIFFERENTIABLE,
        )
    )
    show(check_op(grouped_linear, r(7, 4), [3, 0, 4], [r(5, 4), r(5, 4), r(5, 4)]))


if __name__ == "__main__":
    main()
