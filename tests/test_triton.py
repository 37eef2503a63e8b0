"""Triton kernels through customgrad: run on CPU by Triton's interpreter (``TRITON_INTERPRET=1``,
set by ``tests/_triton_support.py`` before Triton is imported) and on CUDA compiled
(``make gpu-check``, the tests marked ``cuda``).

The fused RMSNorm example (``examples/ops/triton_fused_rms_norm.py``): gradients against torch
in float32, its backward kernel launched once across the input and the weight pass (through
``register_backward_shared``, and through a traced ``register_backward``), under
``torch.compile``; ``check_op`` in the kernel's own dtype, counting launches per pass; a raw
launch in a backward; the interpreter's shims.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import Tensor

import customgrad as cg
from customgrad._triton import FIX_RAW_LAUNCH
from customgrad.pipelining import stage_backward_input, stage_backward_weight
from customgrad.testing import (
    FIX_LAUNCHED_TWICE,
    MSG_COARSE_DTYPE,
    MSG_FLOAT64_MISMATCH,
    MSG_NO_FLOAT64,
    MSG_RAN_OWN,
    CheckFailed,
    check_op,
)
from tests._skips import NO_CUDA, TORCH_SPLIT, optional_package
from tests._triton_support import HAS_TRITON, INTERPRETED, count_launches, interpreter_shims

pytestmark = pytest.mark.skipif(
    not HAS_TRITON,
    reason=optional_package(
        "triton",
        "torch's CPU build brings none: make install pins one; a CUDA build brings its own",
    ),
)

if HAS_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from examples.ops import triton_fused_rms_norm as rms_module
    from examples.ops import triton_scale_shift as scale_shift_module
    from examples.ops.triton_fused_rms_norm import triton_rms_norm, triton_rms_norm_backward

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="TRITON_INTERPRET=0")),
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA),
        ],
    ),
]

# The backward reads the residual rstd: registered differentiable=False, no double backward.
ONCE = ["opcheck", "fake", "gradcheck", "split", "flops"]


def _reference(x: Tensor, w: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _args(device: str, *shape: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g).to(device).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(device).requires_grad_()
    return x, w


def _kernels() -> tuple[Any, Any]:
    return rms_module._forward_kernel, rms_module._backward_kernel


def _ops_only(launches: dict[str, int]) -> dict[str, int]:
    """Launches of kernel ops; compiled Triton launches (``"triton:<name>"``, seen through
    Triton's launch hook on a GPU) checked apart."""
    return {k: v for k, v in launches.items() if not k.startswith("triton:")}


def _triton_only(launches: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in launches.items() if k.startswith("triton:")}


@pytest.mark.parametrize("device", DEVICES)
def test_forward_and_gradients_match_torch_in_float32(device: str) -> None:
    x, w = _args(device, 3, 5, 12)  # 12 columns: a masked block of 16
    with count_launches(*_kernels()) as launches:
        y = triton_rms_norm(x, w)
        g = torch.randn_like(y)
        dx, dw = torch.autograd.grad(y, (x, w), g)
    assert launches == {"_forward_kernel": 1, "_backward_kernel": 1}
    ref = _reference(x, w)
    rx, rw = torch.autograd.grad(ref, (x, w), g)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx, rx, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dw, rw, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_kernel_launched_once_across_input_and_weight_pass(device: str) -> None:
    x, w = _args(device, 4, 8, seed=1)
    y = triton_rms_norm(x, w)
    grad = torch.randn_like(y)
    full = torch.autograd.grad(_reference(x, w), (x, w), grad)
    with count_launches(*_kernels()) as launches:
        _, groups = stage_backward_input([y], [grad], [x], iter([w]))
        after_input = dict(launches)
        stage_backward_weight(iter([w]), groups)
    assert after_input == {"_forward_kernel": 0, "_backward_kernel": 1}
    assert launches == {"_forward_kernel": 0, "_backward_kernel": 1}  # W launched nothing
    assert x.grad is not None and w.grad is not None
    torch.testing.assert_close(x.grad, full[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad, full[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("backend", "device"),
    [
        # inductor on CPU compiles C++: too slow for the test suite; aot_eager there
        pytest.param("aot_eager", "cpu", marks=DEVICES[0].marks, id="aot_eager-cpu"),
        pytest.param("aot_eager", "cuda", marks=DEVICES[1].marks, id="aot_eager-cuda"),
        pytest.param("inductor", "cuda", marks=DEVICES[1].marks, id="inductor-cuda"),
    ],
)
def test_torch_compile_gives_eager_gradients(device: str, backend: str) -> None:
    x, w = _args(device, 2, 3, 8, seed=2)
    triton_rms_norm(x, w).sum().backward()
    xc, wc = (t.detach().clone().requires_grad_() for t in (x, w))
    fn = torch.compile(lambda a, b: triton_rms_norm(a, b).sum(), backend=backend, fullgraph=True)
    loss = fn(xc, wc)
    with count_launches(*_kernels()) as launches:
        loss.backward()
    assert launches["_backward_kernel"] == 1
    torch.testing.assert_close(xc.grad, x.grad)
    torch.testing.assert_close(wc.grad, w.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_check_op_in_float32_counts_one_backward_launch(device: str) -> None:
    x, w = (t.detach() for t in _args(device, 4, 8, seed=3))
    report = check_op(triton_rms_norm, x, w, dtype=torch.float32, checks=ONCE)
    assert report.ok, str(report)
    assert report["gradcheck"].dtype == "float32" and report["split"].dtype == "float32"
    kernel = "examples::triton_rms_norm_backward"
    assert _ops_only(report.launches["full"]) == {kernel: 1}
    assert _ops_only(report.launches["input"]) == {kernel: 1}
    assert report.launches["weight"] == {}
    if device == "cuda":  # compiled: Triton's launch hook sees the kernel itself, once
        assert _triton_only(report.launches["input"]) == {"triton:_backward_kernel": 1}
    else:  # the interpreter has no launch hook
        assert _triton_only(report.launches["input"]) == {}
    assert report["flops"].status == "passed"
    assert report["flops"].detail.startswith("no FLOPs to count")
    assert f"kernel launches, input: {kernel} x1" in str(report)
    assert "[ok  ] gradcheck (float32)" in str(report)


@pytest.mark.skipif(not INTERPRETED, reason="the CPU kernel is Triton's only when interpreted")
def test_check_op_of_a_kernel_without_float64_checks_in_its_dtype_saying_so() -> None:
    x, w = torch.randn(4, 8), torch.randn(8)
    exc = (
        "UnsupportedError: examples::triton_rms_norm: the Triton kernel takes float32, float16 "
        "or bfloat16 tensors, got torch.float64. Convert the arguments (x.float()), or check the "
        "op in its own dtype: check_op(op, ..., dtype=torch.float32)."
    )
    report = check_op(triton_rms_norm, x, w, checks=ONCE)  # float64 only by default
    assert report.ok, str(report)
    for name in ("gradcheck", "split", "flops"):
        assert report[name].dtype == "float32"
    note = MSG_RAN_OWN.format(dtype="float32", op="examples::triton_rms_norm", exc=exc)
    assert report.dtype_note == note
    assert f"\n  dtype: {note}\n" in str(report)
    # float64 asked for: each gradient check fails with the kernel's error and the fix
    expected = MSG_NO_FLOAT64.format(op="examples::triton_rms_norm", exc=exc)
    with pytest.raises(CheckFailed) as info:
        check_op(triton_rms_norm, x, w, checks=ONCE, dtype=torch.float64)
    assert isinstance(info.value, cg.CustomGradError)
    for name in ("gradcheck", "split", "flops"):
        assert info.value.report[name].detail == expected
    assert info.value.report["fake"].status == "passed"  # the arguments as given: float32


@pytest.mark.parametrize("device", DEVICES)
def test_check_op_in_bfloat16_skips_finite_differences_saying_why(device: str) -> None:
    x, w = (t.detach() for t in _args(device, 4, 8, seed=4))
    report = check_op(triton_rms_norm, x, w, dtype=torch.bfloat16, checks=ONCE)
    assert report.ok, str(report)
    assert report["gradcheck"].status == "skipped"
    assert report["gradcheck"].detail == MSG_COARSE_DTYPE.format(dtype="bfloat16")
    assert report["split"].status == "passed" and report["split"].dtype == "bfloat16"


def _relaunching_op(name: str) -> cg.CustomOp[..., Tensor]:
    """RMSNorm whose two halves each launch the fused backward kernel (the mistake)."""

    @cg.op(name, weights=("weight",), residuals=("rstd",))
    def op(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        return triton_rms_norm(x, weight), torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)

    op.register_fake(lambda x, weight: (torch.empty_like(x), x.new_empty(x.shape[:-1])))
    op.register_save_for_backward(lambda i, o, r: (i.x, i.weight, r.rstd))

    @op.register_backward_input(differentiable=False)
    def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
        return {"x": triton_rms_norm_backward(grad, *saved)[0]}

    @op.register_backward_weight(differentiable=False)
    def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
        return {"weight": triton_rms_norm_backward(grad, *saved)[1]}

    return op


@pytest.mark.parametrize("device", DEVICES)
def test_check_op_reports_a_backward_kernel_launched_in_both_passes(device: str) -> None:
    op = _relaunching_op(f"test_triton::relaunch_{device}")
    x, w = (t.detach() for t in _args(device, 4, 8, seed=5))
    report = check_op(op, x, w, dtype=torch.float32, checks=ONCE, raise_on_failure=False)
    assert [r.name for r in report.failures] == ["flops"], str(report)
    kernel = "examples::triton_rms_norm_backward"
    assert _ops_only(report.launches["input"]) == {kernel: 1}
    assert _ops_only(report.launches["weight"]) == {kernel: 1}
    assert report["flops"].detail == (
        f"the backward kernel {kernel} ran in both passes, computing the same result in the "
        f"input pass and again in the weight pass: work done twice\n{FIX_LAUNCHED_TWICE}"
    )


def test_check_op_float32_gradcheck_catches_a_wrong_gradient() -> None:
    @cg.op("test_triton::wrong", weights=("w",))
    def wrong(x: Tensor, w: Tensor) -> Tensor:
        return x * w

    wrong.register_fake(lambda x, w: torch.empty_like(x))
    wrong.register_save_for_backward(lambda i, o: (i.x, i.w))
    wrong.register_backward_input(lambda ctx, s, g: {"x": g * s[1]})
    wrong.register_backward_weight(lambda ctx, s, g: {"w": (g * s[0]).sum(0) * 1.1})
    report = check_op(
        wrong, torch.randn(4, 3), torch.randn(3), dtype=torch.float32, raise_on_failure=False
    )
    assert report["gradcheck"].status == "failed"
    assert report["gradcheck"].dtype == "float32"
    assert "with respect to 'w'" in report["gradcheck"].detail


def test_check_op_refuses_a_dtype_that_is_not_floating() -> None:
    with pytest.raises(
        cg.CustomGradError,
        match=re.escape(
            'check_op(examples::triton_rms_norm): dtype must be a floating-point torch.dtype, "own" '
            "(the arguments' own dtypes) or None (float64), got torch.int64. Pass e.g. "
            "dtype=torch.float32."
        ),
    ):
        check_op(triton_rms_norm, torch.randn(2, 4), torch.randn(4), dtype=torch.int64)


# -- the other Triton example and the interpreter's gaps ----------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_scale_shift_runs_its_triton_kernel(device: str) -> None:
    g = torch.Generator().manual_seed(6)
    x, w, b = (torch.randn(s, generator=g).to(device) for s in ((4, 8), (8,), (8,)))
    with count_launches(scale_shift_module._scale_shift_kernel) as launches:
        torch.testing.assert_close(scale_shift_module.scale_shift(x, w, b), x * w + b)
    assert launches == {"_scale_shift_kernel": 1}
    assert check_op(scale_shift_module.scale_shift, x, w, b, dtype=torch.float32).ok


if HAS_TRITON:

    @triton.jit
    def _gaps_kernel(x_ptr, out_ptr, eps, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        y = libdevice.tanh(x) + libdevice.rsqrt(x * x + eps.to(tl.float32))
        tl.store(out_ptr + offs, y, mask=mask)


@pytest.mark.skipif(not INTERPRETED, reason="the shims fill gaps of the interpreter only")
def test_interpreter_shims_fill_the_float_argument_and_libdevice_gaps() -> None:
    x = torch.randn(10)
    out = torch.full_like(x, float("nan"))
    with pytest.raises(Exception, match="'float' object has no attribute 'to'"):
        _gaps_kernel[(1,)](x, out, 1e-3, 10, 16)  # the gap, unshimmed
    with interpreter_shims():
        _gaps_kernel[(1,)](x, out, 1e-3, 10, 16)
    torch.testing.assert_close(out, torch.tanh(x) + torch.rsqrt(x * x + 1e-3))


# -- a raw Triton launch in a backward -----------------------------------------------------------
def _raw_launch_op(name: str) -> cg.CustomOp[..., Tensor]:
    """RMSNorm whose single backward launches the backward kernel itself (no op around it)."""

    @cg.op(name, weights=("weight",), residuals=("rstd",))
    def op(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        return triton_rms_norm(x, weight), torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)

    op.register_fake(lambda x, weight: (torch.empty_like(x), x.new_empty(x.shape[:-1])))
    op.register_save_for_backward(lambda i, o, r: (i.x, i.weight, r.rstd))
    launch = rms_module._backward  # the function that launches the kernel

    @op.register_backward(differentiable=False)
    def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
        dx, dw = launch(grad, *saved)  # the raw launch
        return {"x": dx, "weight": dw}

    return op


@pytest.mark.skipif(not INTERPRETED, reason="runs the kernel on CPU")
def test_raw_launch_in_a_backward_under_compile_names_the_op_and_the_fix() -> None:
    op = _raw_launch_op("test_triton::raw_compiled")
    x, w = _args("cpu", 4, 8, seed=7)
    fn = torch.compile(lambda a, b: op(a, b).sum(), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception) as info:
        fn(x, w).backward()
    err = info.value
    inner = getattr(err, "inner_exception", None)  # dynamo wraps it: BackendCompilerFailed
    err = inner if isinstance(inner, BaseException) else err
    assert isinstance(err, cg.UnsupportedError) and isinstance(err, RuntimeError)
    launched_at = f"{rms_module.__file__}:"
    assert str(err).startswith(
        "test_triton::raw_compiled: backward launches the Triton kernel _backward_kernel "
        f"directly ({launched_at}"
    )
    assert (
        "on tensors without data: torch.compile traces the backward on fake tensors, which a raw "
        "launch cannot read. Make the kernel an op with a fake kernel and call the op from the "
        "backward, so the trace keeps it as one opaque call:"
    ) in str(err)
    assert "torch.library.triton_op + wrap_triton" in str(err)
    assert re.search(r"\(backward defined at .*test_triton\.py:\d+\)$", str(err))


@pytest.mark.skipif(not INTERPRETED, reason="runs the kernel on CPU")
def test_a_raw_launch_in_a_backward_runs_once_across_input_and_weight_pass() -> None:
    """Not split (the automatic split cannot trace a raw launch): the run-once rule runs the
    whole backward once, in I, and hands dweight to W."""
    op = _raw_launch_op("test_triton::raw_once")
    x, w = _args("cpu", 4, 8, seed=8)
    y = op(x, w)
    grad = torch.randn_like(y)
    full = torch.autograd.grad(_reference(x, w), (x, w), grad)
    with count_launches(rms_module._backward_kernel) as launches:
        _, groups = stage_backward_input([y], [grad], [x], iter([w]))
        stage_backward_weight(iter([w]), groups)
    assert launches == {"_backward_kernel": 1}
    torch.testing.assert_close(x.grad, full[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad, full[1], atol=1e-5, rtol=1e-5)
    auto = op.rules.auto
    assert isinstance(auto, cg._autosplit.AutoSplitter)
    fallback = auto.fallback()
    assert fallback is not None and "_backward_kernel" in fallback.why


@pytest.mark.skipif(not INTERPRETED, reason="runs the kernel on CPU")
def test_automatic_split_fallback_names_the_raw_launch() -> None:
    op = _raw_launch_op("test_triton::raw_auto")
    x, w = _args("cpu", 4, 8, seed=9)
    torch.autograd.grad(op(x, w).sum(), [x])  # an input pass: the capture is tried
    auto = op.rules.auto
    assert isinstance(auto, cg._autosplit.AutoSplitter)
    fallback = auto.fallback()
    assert fallback is not None
    assert re.fullmatch(
        re.escape("it launches the Triton kernel _backward_kernel directly (")
        + re.escape(rms_module.__file__)
        + r":\d+"
        + re.escape("): a raw launch, which dynamo cannot capture here"),
        fallback.why,
    ), fallback.why
    assert fallback.fix == FIX_RAW_LAUNCH


@pytest.mark.parametrize("device", DEVICES)
def test_a_traced_backward_calling_the_kernel_op_launches_it_once(device: str) -> None:
    """The other way: one register_backward calls the backward op once and returns both
    gradients; the automatic split computes the call once, in I, and hands dweight to W."""

    @cg.op(f"test_triton::traced_{device}", weights=("weight",), residuals=("rstd",))
    def op(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        return rms_module._forward(x, weight)  # type: ignore[no-any-return]

    op.register_fake(lambda x, weight: (torch.empty_like(x), x.new_empty(x.shape[:-1])))
    op.register_save_for_backward(lambda i, o, r: (i.x, i.weight, r.rstd))

    @op.register_backward(differentiable=False)
    def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
        dx, dw = triton_rms_norm_backward(grad, *saved)
        return {"x": dx, "weight": dw}

    x, w = _args(device, 4, 8, seed=9)
    y = op(x, w)
    grad = torch.randn_like(y)
    full = torch.autograd.grad(_reference(x, w), (x, w), grad)
    with count_launches(rms_module._backward_kernel) as launches:
        _, groups = stage_backward_input([y], [grad], [x], iter([w]))
        assert launches == {"_backward_kernel": 1}
        stage_backward_weight(iter([w]), groups)
    assert launches == {"_backward_kernel": 1}
    auto = op.rules.auto
    assert isinstance(auto, cg._autosplit.AutoSplitter) and auto.fallback() is None
    torch.testing.assert_close(x.grad, full[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad, full[1], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter's launch on fake tensors")
def test_a_trace_that_hits_a_raw_launch_is_explained_by_the_kernel() -> None:
    """What the automatic split says when tracing reaches a raw launch (``_capture._why``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from customgrad._capture import _why

    with FakeTensorMode() as mode:
        x, w = mode.from_tensor(torch.randn(4, 8)), mode.from_tensor(torch.randn(8))
        rstd = mode.from_tensor(torch.randn(4))
        with pytest.raises(Exception) as info:
            rms_module._backward(x, x, w, rstd)
    reason, fix = _why(info.value)
    assert reason.startswith(
        f"it launches the Triton kernel _backward_kernel directly ({rms_module.__file__}:"
    )
    assert reason.endswith("), which fake tensors cannot run")
    assert fix == FIX_RAW_LAUNCH


if HAS_TRITON:

    @triton.jit
    def _scale_backward_in_place(dy_ptr, x_ptr, w_ptr, dw_part_ptr, d, BLOCK: tl.constexpr):
        """One row: dW's partial dy * x, then dX = dy * w written over dY (Liger's
        ``in_place=True``: a Triton store, which no version counter sees)."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < d
        dy = tl.load(dy_ptr + row * d + cols, mask=mask)
        x = tl.load(x_ptr + row * d + cols, mask=mask)
        w = tl.load(w_ptr + cols, mask=mask)
        tl.store(dw_part_ptr + row * d + cols, dy * x, mask=mask)
        tl.store(dy_ptr + row * d + cols, dy * w, mask=mask)

    class InPlaceScale(torch.autograd.Function):
        """``x * w`` whose Triton backward writes dX into the incoming gradient's memory."""

        @staticmethod
        def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, Tensor]:
            x, w = ctx.saved_tensors
            dy = dy.contiguous()
            parts = torch.empty_like(x)
            n, d = x.shape
            _scale_backward_in_place[(n,)](dy, x, w, parts, d, BLOCK=triton.next_power_of_2(d))
            return dy, parts.sum(0)


@pytest.mark.skipif(not INTERPRETED, reason="runs the kernel on CPU")
@pytest.mark.parametrize("split", ["customgrad", pytest.param("torch", marks=TORCH_SPLIT)])
def test_a_kernel_writing_into_its_input_gradient_launches_once_and_is_exact(split: str) -> None:
    from torch.distributed.pipelining import _backward as torch_split

    op = cg.from_function(InPlaceScale, f"test_triton::in_place_{split}", weights=("w",))
    first, second = (
        (stage_backward_input, stage_backward_weight)
        if split == "customgrad"
        else (torch_split.stage_backward_input, torch_split.stage_backward_weight)
    )
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 8, generator=gen).requires_grad_()
    w = torch.randn(8, generator=gen).requires_grad_()
    g = torch.randn(4, 8, generator=gen)
    with count_launches(_scale_backward_in_place) as launches:
        (gx,), groups = first([op(x, w)], [g.clone()], [x], [w])
        second([w], groups)
    assert launches == {"_scale_backward_in_place": 1}  # once across I and W
    torch.testing.assert_close(gx, g * w.detach())
    torch.testing.assert_close(w.grad, (g * x.detach()).sum(0))


# -- a float32-only kernel under check_op's float64, and a Function's raw launch compiled --------
if HAS_TRITON:

    @triton.jit
    def _mul_f32_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        a = tl.load(a_ptr + offs, mask=mask).to(tl.float32)  # float32 inside, as Liger's
        b = tl.load(b_ptr + offs, mask=mask).to(tl.float32)
        tl.store(out_ptr + offs, a * b, mask=mask)


def _mul_f32(a: Tensor, b: Tensor) -> Tensor:
    a, b = a.contiguous(), b.expand_as(a).contiguous()
    out = torch.empty_like(a)
    _mul_f32_kernel[(triton.cdiv(a.numel(), 64),)](a, b, out, a.numel(), BLOCK=64)
    return out


@pytest.mark.skipif(not INTERPRETED, reason="runs the kernel on CPU")
def test_check_op_says_a_float64_mismatch_may_be_a_float32_kernel_and_how_to_check_it() -> None:
    @cg.op("test_triton::mul_f32", weights=("w",))
    def mul(x: Tensor, w: Tensor) -> Tensor:
        return _mul_f32(x, w)

    mul.register_fake(lambda x, w: torch.empty_like(x))
    mul.register_save_for_backward(lambda i, o: (i.x, i.w))

    @mul.register_backward
    def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
        x, w = saved
        return {"x": _mul_f32(grad, w), "w": _mul_f32(grad, x).sum(0)}

    x, w = torch.randn(4, 8), torch.randn(8)
    report = check_op(mul, x, w, checks=["gradcheck"], raise_on_failure=False)
    detail = report["gradcheck"].detail
    assert detail.startswith("the backward disagrees with finite differences: Jacobian mismatch")
    assert detail.endswith(". " + MSG_FLOAT64_MISMATCH.format(check="gradcheck", own="float32"))
    # The advice applied: in the op's own dtype, the checks pass.
    assert check_op(mul, x, w, checks=["gradcheck", "split", "flops"], dtype=torch.float32).ok


class _RawLaunchRMSNorm(torch.autograd.Function):
    """A Liger-style Function: its backward launches the Triton kernel itself."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor) -> Tensor:
        y, rstd = rms_module._forward(x, weight)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        x, weight, rstd = ctx.saved_tensors
        return rms_module._backward(grad, x, weight, rstd)  # the raw launch


@pytest.mark.skipif(not INTERPRETED, reason="runs the kernel on CPU")
def test_a_functions_raw_launch_compiled_with_aot_eager_gives_customgrads_error() -> None:
    op = cg.from_function(
        _RawLaunchRMSNorm,
        "test_triton::raw_function",
        weights=("weight",),
        schema="(Tensor x, Tensor weight) -> Tensor",
    )
    op.register_fake(lambda x, weight: torch.empty_like(x))
    x, w = _args("cpu", 4, 8, seed=3)
    fn = torch.compile(lambda a, b: op(a, b).sum(), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception) as info:
        fn(x, w).backward()
    err = info.value
    inner = getattr(err, "inner_exception", None)  # dynamo wraps it: BackendCompilerFailed
    err = inner if isinstance(inner, BaseException) else err
    assert isinstance(err, cg.UnsupportedError), repr(err)
    assert str(err).startswith(
        "test_triton::raw_function: backward launches the Triton kernel _backward_kernel "
        f"directly ({rms_module.__file__}:"
    )
    assert "invalid python storage" not in str(err)
