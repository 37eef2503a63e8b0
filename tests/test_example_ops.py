"""The basic example ops and RMSNorm: check_op (opcheck, gradcheck, fake kernel, split, FLOPs), a
stage split with customgrad.pipelining against the full backward, and torch.compile. The other
real ops are tested in test_real_ops.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import customgrad as cg
from customgrad.graph import explain_split
from customgrad.pipelining import stage_backward_input, stage_backward_weight
from customgrad.testing import CHECKS, check_op
from examples.ops import gelu_linear, linear, rms_norm, scale_shift
from tests._skips import TORCH_SPLIT

Case = tuple[cg.CustomOp[..., Tensor], Callable[[torch.Generator], tuple[Any, ...]]]


def _randn(g: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=g)


CASES: dict[str, Case] = {
    "linear": (linear, lambda g: (_randn(g, 2, 4, 3), _randn(g, 5, 3), _randn(g, 5))),
    "linear_no_bias": (linear, lambda g: (_randn(g, 4, 3), _randn(g, 5, 3))),
    "rms_norm": (rms_norm, lambda g: (_randn(g, 2, 4, 8), _randn(g, 8))),
    "rms_norm_eps": (rms_norm, lambda g: (_randn(g, 3, 8), _randn(g, 8), 1e-3)),
    "gelu_linear": (gelu_linear, lambda g: (_randn(g, 2, 4, 3), _randn(g, 5, 3), _randn(g, 5))),
    "gelu_linear_no_bias": (gelu_linear, lambda g: (_randn(g, 4, 3), _randn(g, 5, 3))),
    "scale_shift": (scale_shift, lambda g: (_randn(g, 4, 8), _randn(g, 8), _randn(g, 8))),
}


# rms_norm's backward uses its residual rstd: it is registered differentiable=False.
ONCE_DIFFERENTIABLE = {"rms_norm", "rms_norm_eps"}


@pytest.mark.parametrize("name", list(CASES))
def test_check_op(name: str) -> None:
    op, make = CASES[name]
    checks = [c for c in CHECKS if c != "gradgradcheck" or name not in ONCE_DIFFERENTIABLE]
    report = check_op(op, *make(torch.Generator().manual_seed(0)), checks=checks)
    # An op without counted FLOPs (rms_norm: elementwise) has its flops check skipped, said so.
    no_flops = report.flops["full"] == 0 and report["flops"].status == "skipped"
    assert all(
        r.status == "passed" or (r.name == "flops" and no_flops)
        for r in report.results
        if r.name in checks
    ), str(report)
    assert report.calls["input"] == {"backward_input": 1}
    assert report.calls["weight"] == {"backward_weight": 1}
    assert report.flops["input"] + report.flops["weight"] == report.flops["full"]


def _leaves(args: tuple[Any, ...], dtype: torch.dtype) -> tuple[Any, ...]:
    return tuple(
        a.detach().to(dtype, copy=True).requires_grad_(True) if isinstance(a, Tensor) else a
        for a in args
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(CASES))
def test_stage_split_matches_full_backward(name: str, dtype: torch.dtype) -> None:
    op, make = CASES[name]
    args = make(torch.Generator().manual_seed(1))
    names = [a.name for a in op.opoverload._schema.arguments]

    full_args = _leaves(args, dtype)
    out = op(*full_args)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=dtype)
    out.backward(grad)

    split_args = _leaves(args, dtype)
    x = split_args[0]
    weights = [a for a, n in zip(split_args, names) if n in op.weights and isinstance(a, Tensor)]
    out = op(*split_args)
    _, groups = stage_backward_input([out], [grad], [x], iter(weights))
    assert x.grad is not None and all(w.grad is None for w in weights)
    stage_backward_weight(iter(weights), groups)
    for a, b in zip(full_args, split_args):
        if isinstance(a, Tensor):
            torch.testing.assert_close(b.grad, a.grad)


@TORCH_SPLIT
@pytest.mark.parametrize("name", ["linear", "rms_norm", "gelu_linear", "scale_shift"])
def test_nothing_computes_twice_in_a_stage(name: str) -> None:
    op, make = CASES[name]
    x, *rest = _leaves(make(torch.Generator().manual_seed(3)), torch.float32)
    weights = [a for a in rest if isinstance(a, Tensor)]
    h = op(x, *rest)
    report = explain_split(torch.tanh(h), [x], weights, splitter="torch")
    assert not report.computes_twice, str(report)
    assert report.repeated_flops == 0
    assert [n.runs_in for n in report.nodes if n.kind == "customgrad"] == ["I+W"]


@pytest.mark.parametrize("name", ["linear", "gelu_linear", "rms_norm"])
def test_torch_compile_gives_eager_gradients(name: str) -> None:
    op, make = CASES[name]
    args = make(torch.Generator().manual_seed(4))
    eager = _leaves(args, torch.float32)
    op(*eager).sum().backward()
    compiled = _leaves(args, torch.float32)
    fn = torch.compile(lambda *a: op(*a).sum(), backend="aot_eager", fullgraph=True)
    fn(*compiled).backward()
    for a, b in zip(eager, compiled):
        if isinstance(a, Tensor):
            torch.testing.assert_close(b.grad, a.grad)


def test_triton_example_falls_back_on_cpu() -> None:
    """The module imports and runs with or without Triton; on CPU its Triton kernel runs in
    Triton's interpreter (the test suite sets TRITON_INTERPRET=1), else the torch kernel."""
    x, w, b = (torch.randn(s) for s in ((4, 8), (8,), (8,)))
    torch.testing.assert_close(scale_shift(x, w, b), x * w + b)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_example_on_cuda() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x, w, b = (torch.randn(s, device="cuda", generator=g) for s in ((64, 96), (96,), (96,)))
    torch.testing.assert_close(scale_shift(x, w, b), x * w + b)
    report = check_op(scale_shift, x, w, b)
    assert report.ok
