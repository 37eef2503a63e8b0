"""Check every example op: ``python -m examples.ops`` (on CUDA too when a GPU is there)."""

from __future__ import annotations

import torch

from customgrad.testing import check_op
from examples.ops import HAS_TRITON, gelu_linear, linear, rms_norm, scale_shift


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device)

    print(f"device: {device}; Triton kernels: {HAS_TRITON and device == 'cuda'}\n")
    print(check_op(linear, r(2, 4, 3), r(5, 3), r(5)), end="\n\n")
    print(check_op(rms_norm, r(2, 4, 8), r(8)), end="\n\n")
    print(check_op(gelu_linear, r(2, 4, 3), r(5, 3), r(5)), end="\n\n")
    print(check_op(scale_shift, r(4, 8), r(8), r(8)))


if __name__ == "__main__":
    main()
