"""One op, one behaviour: ``op(...)``, ``torch.ops.ns.name.default(...)`` and a compiled call agree
in everything a user can register through ``torch.library`` (kernels per device, autocast
rules, fake kernels) and under dispatch modes, with and without gradients, on the fast path and
the general path."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import customgrad as cg
from tests.conftest import linear_op

_ids = itertools.count()


def scaled_linear(*, backward: str = "auto") -> cg.CustomOp[..., torch.Tensor]:
    """``x @ weight.mT`` with the pair or one backward that returns every gradient (split
    automatically or by phase). The output gradient is cast to the inputs' dtype (bfloat16
    under autocast, when the kernel's matmul autocasts), as a backward written for autocast
    does."""
    return linear_op(
        f"test_dispatch{next(_ids)}::linear",
        backward="pair" if backward == "pair" else "every",
        split="auto" if backward == "auto" else "phase",
        cast_grad=True,
    )


BACKWARDS = ["pair", "auto", "phase"]


def _both(op: cg.CustomOp[..., torch.Tensor], *args: Any) -> tuple[Any, Any]:
    return op(*args), op.opoverload(*args)


@pytest.mark.parametrize("backward", BACKWARDS)
def test_a_kernel_registered_through_torch_library_runs_on_every_call_path(
    backward: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    op = scaled_linear(backward=backward)
    x = torch.randn(3, 4, dtype=torch.float64)
    w = torch.randn(5, 4, dtype=torch.float64)
    op(x, w)  # the fast path is built and warm before the registration
    lib = torch.library.Library(op.name.split("::")[0], "FRAGMENT")
    try:
        torch.library.register_kernel(op.name, "cpu", lambda x, weight: x @ weight.mT + 1, lib=lib)
        want = x @ w.mT + 1
        direct, ops = _both(op, x, w)
        torch.testing.assert_close(direct, want)
        torch.testing.assert_close(ops, want)
        with torch.no_grad():
            torch.testing.assert_close(op(x, w), want)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = op(xr, wr)
        torch.testing.assert_close(out, want)
        g = torch.randn_like(out)
        out.backward(g)
        torch.testing.assert_close(xr.grad, g @ w)
        torch.testing.assert_close(wr.grad, g.mT @ x)
    finally:
        lib._destroy()
    # the registration is gone: customgrad's kernel again, on the direct path too
    torch.testing.assert_close(op(x, w), x @ w.mT)


@pytest.mark.parametrize("backward", BACKWARDS)
def test_an_autocast_rule_registered_through_torch_library_applies_to_the_direct_call(
    backward: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    op = scaled_linear(backward=backward)
    lib = torch.library.Library(op.name.split("::")[0], "FRAGMENT")
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    try:
        torch.library.register_autocast(op.name, "cpu", torch.bfloat16, lib=lib)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            direct, ops = _both(op, x, w)
        assert direct.dtype is ops.dtype is torch.bfloat16
        torch.testing.assert_close(direct, ops)
        g = torch.randn(3, 5, dtype=torch.bfloat16)
        direct.backward(g)
        # the op saw bfloat16 inputs; autograd casts the gradients back to the leaves' dtype
        assert x.grad is not None and w.grad is not None
        assert x.grad.dtype is w.grad.dtype is torch.float32
        xb, wb = x.detach().bfloat16(), w.detach().bfloat16()
        torch.testing.assert_close(x.grad, (g @ wb).float())
        torch.testing.assert_close(w.grad, (g.mT @ xb).float())
    finally:
        lib._destroy()


def test_without_an_autocast_rule_both_calls_run_the_kernel_under_autocast() -> None:
    op = scaled_linear()
    x = torch.randn(3, 4)
    w = torch.randn(5, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        direct, ops = _both(op, x, w)
    assert direct.dtype is ops.dtype is torch.bfloat16  # the kernel's matmul autocasts
    torch.testing.assert_close(direct, ops)


def test_fake_tensors_and_dispatch_modes_see_the_same_op_on_both_paths() -> None:
    op = scaled_linear()

    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[Any] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    for call in (op, op.opoverload):
        with Seen() as seen:
            call(x, w)
        assert op.opoverload in seen.ops
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx, fw = mode.from_tensor(x), mode.from_tensor(w)
        for call in (op, op.opoverload):
            out = call(fx, fw)
            assert out.shape == (3, 5)


@pytest.mark.parametrize("backward", BACKWARDS)
def test_compiled_module_under_autocast_works_where_eager_does(backward: str) -> None:
    op = scaled_linear(backward=backward)

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(5, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return op(x, self.weight).float().sum()

    torch.manual_seed(0)
    m = M()
    x = torch.randn(3, 4, requires_grad=True)
    grads = []
    for module in (m, torch.compile(m, backend="aot_eager", fullgraph=True)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = module(x)
        gx, gw = torch.autograd.grad(loss, (x, m.weight))
        assert gx.dtype is gw.dtype is torch.float32
        grads.append((gx, gw))
    # the compiled backward runs under the forward's autocast (torch's default): bf16 matmuls
    torch.testing.assert_close(grads[0], grads[1], atol=0.05, rtol=0.02)
