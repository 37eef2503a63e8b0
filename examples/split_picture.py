"""Draw what ``explain_split`` finds in a small stage: ``docs/img/explain_split.png``.

The stage of ``docs/pipelines/split-backward.md``: two customgrad linears around a plain
``autograd.Function``, split by torch's ``stage_backward_input``/``_weight``. The Function runs
its whole backward in both passes; the customgrad ops split theirs.

    python -m examples.split_picture [--out docs/img/explain_split.png]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from customgrad.graph import explain_split
from examples.ops import linear


class PlainLinear(torch.autograd.Function):
    """``x @ w.T`` as a plain Function: one backward, which torch's split runs twice."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.mT

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        x, w = ctx.saved_tensors
        return grad @ w, grad.mT @ x


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=Path("docs/img/explain_split.png"),
                   help="the picture to write (PNG or SVG, by suffix)")  # fmt: skip
    args = p.parse_args()
    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)
    w1, b1 = torch.randn(32, 16, requires_grad=True), torch.randn(32, requires_grad=True)
    w2 = torch.randn(32, 32, requires_grad=True)
    w3 = torch.randn(16, 32, requires_grad=True)
    h = torch.relu(linear(x, w1, b1))
    out = linear(torch.tanh(PlainLinear.apply(h, w2)), w3)
    report = explain_split(out, [x], {"w1": w1, "b1": b1, "w2": w2, "w3": w3}, splitter="torch")
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report.draw(args.out)
    print(f"picture: {args.out}")


if __name__ == "__main__":
    main()
