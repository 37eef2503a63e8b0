"""customgrad in one page: define an op, check it, see its split, run it under torch.compile.

Run: ``python examples/quickstart.py`` (``make demo`` runs the pipeline demo).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import customgrad as cg
from customgrad.graph import explain_split
from customgrad.testing import check_op


# 1. Define the op: the function is the kernel for every device; the schema comes from the
#    annotations; `weights` names the parameters.
@cg.op("quickstart::linear", weights=("weight", "bias"))
def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    out = x @ weight.mT
    return out if bias is None else out + bias


# 2. The fake kernel: output shapes for torch.compile, FakeTensorMode and opcheck.
@linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# 3. Autograd: what to save, then gradients by name, split into input and weight halves.
@linear.register_save_for_backward
def _(inputs: Any, output: Tensor) -> Any:
    return inputs.x, inputs.weight, inputs.bias is not None


@linear.register_backward_input
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor | None]:
    _, weight, _ = saved
    return {"x": grad @ weight}


@linear.register_backward_weight
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor | None]:
    x, _, has_bias = saved
    g, xs = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    return {"weight": g.mT @ xs, "bias": g.sum(0) if has_bias else None}


class PlainLinear(torch.autograd.Function):
    """The same layer as a plain autograd.Function, for comparison."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight.mT

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.mT @ x


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    w1, w2 = torch.randn(32, 16), torch.randn(32, 32)
    b = torch.randn(32)

    # 4. Check it: opcheck, gradcheck, gradgradcheck, fake kernel, split, FLOPs.
    print(check_op(linear, x, w1, b), end="\n\n")

    # 5. See a stage's split: ours splits, and so does the plain Function's backward, captured by
    #    dynamo (torch's split would run it twice: explain_split(..., splitter="torch")).
    xs = x.clone().requires_grad_(True)
    params = {"w1": w1.clone().requires_grad_(True), "w2": w2.clone().requires_grad_(True)}
    params["b"] = b.clone().requires_grad_(True)
    h = torch.relu(linear(xs, params["w1"], params["b"]))
    out = PlainLinear.apply(h, params["w2"])
    report = explain_split(out, [xs], params)
    print(report, end="\n\n")
    assert report.computes_twice == []
    assert [(f.label, f.how) for f in report.functions] == [
        ("PlainLinear (autograd.Function)", "split")
    ]

    # 6. torch.compile, whole graph, same gradients as eager.
    def step(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
        return torch.relu(linear(x, w, b)).square().sum()

    grads = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        leaves = [t.clone().requires_grad_(True) for t in (x, w1, b)]
        fn(*leaves).backward()
        grads.append([t.grad for t in leaves])
    for eager, compiled in zip(*grads):
        torch.testing.assert_close(compiled, eager)
    print("torch.compile(fullgraph=True): gradients match eager.")


if __name__ == "__main__":
    main()
