"""``cg.from_function``: existing ``torch.autograd.Function`` subclasses as customgrad ops.

The wrapped op gives the Function's gradients (checked against native references in float64),
splits its backward into an input and a weight pass with exact FLOPs (FLOPs(I) + FLOPs(W) ==
FLOPs(full) == the Function's own full backward, where the Function itself repeats its backward
under a split), and carries what ``forward`` left on ``ctx`` on every call path.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.distributed.pipelining import _backward as torch_backward
from torch.utils.flop_counter import FlopCounterMode

import customgrad as cg
from customgrad._autosplit import TracedSplit
from customgrad.pipelining import stage_backward_input, stage_backward_weight
from customgrad.testing import check_op
from tests._skips import TORCH_SPLIT
from tests._triton_support import INTERPRETED

_ids = itertools.count()
DT = torch.float64


def unique(name: str) -> str:
    return f"test_from_function{next(_ids)}::{name}"


def randn(*shape: int, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=DT, generator=gen).requires_grad_()


class Linear(torch.autograd.Function):
    """A linear layer as people write it: needs_input_grad honoured, bias optional."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = x @ weight.mT
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = grad @ weight
        if ctx.needs_input_grad[1]:
            dw = grad.reshape(-1, grad.shape[-1]).mT @ x.reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = grad.reshape(-1, grad.shape[-1]).sum(0)
        return dx, dw, db


class NaiveLinear(torch.autograd.Function):
    """The same, computing every gradient whatever is asked."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight.mT

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.mT @ x


class TanhLinear(torch.autograd.Function):
    """``tanh(x @ w.mT)`` written with ``setup_context``, saving its output."""

    @staticmethod
    def forward(x: Tensor, w: Tensor) -> Tensor:
        return torch.tanh(x @ w.mT)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        x, w = inputs
        ctx.save_for_backward(x, w, output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        x, w, y = ctx.saved_tensors
        gh = grad * (1 - y * y)  # shared by both gradients
        return gh @ w, gh.mT @ x


class RMSLinear(torch.autograd.Function):
    """Saves what forward computed (``rstd``), a view of an input, a shape and a dict."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, eps: float) -> Tensor:
        h = x @ w.mT
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x.reshape(-1), w, rstd)
        ctx.shape = x.shape
        ctx.extra = {"h": h, "eps": eps}
        return h * rstd

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x_flat, w, rstd = ctx.saved_tensors
        x = x_flat.view(ctx.shape)
        y = ctx.extra["h"] * rstd
        gh = rstd * (grad - y * (grad * y).mean(-1, keepdim=True))
        dw = gh.reshape(-1, gh.shape[-1]).mT @ x.reshape(-1, x.shape[-1])
        return gh @ w, dw, None


def rms_linear(x: Tensor, w: Tensor, eps: float) -> Tensor:
    h = x @ w.mT
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


linear = cg.from_function(Linear, unique("linear"), weights=("weight", "bias"))
naive = cg.from_function(NaiveLinear, unique("naive"), weights=("weight",))
tanh_linear = cg.from_function(TanhLinear, unique("tanh_linear"), weights=("w",))
rms = cg.from_function(RMSLinear, unique("rms_linear"), weights=("w",))


# --------------------------------------------------------------------------------------------
# Measuring


def flops_of(fn: Callable[[], Any]) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


Args = Callable[[], tuple[list[Tensor], list[Tensor], tuple[Any, ...]]]


def split_flops(
    fn: Callable[..., Tensor], args: Args, splitter: str = "customgrad"
) -> tuple[dict[str, int], list[Tensor | None]]:
    """FLOPs of the input pass, the weight pass and a full backward (after a warm-up that
    traces), and the gradients of the split (inputs, then weights)."""
    if splitter == "customgrad":
        backward_input, backward_weight = stage_backward_input, stage_backward_weight
    else:
        backward_input = torch_backward.stage_backward_input
        backward_weight = torch_backward.stage_backward_weight
    inputs, weights, call = args()
    out = fn(*call)
    g = torch.randn(out.shape, dtype=DT, generator=torch.Generator().manual_seed(9))
    out.backward(g)
    inputs, weights, call = args()
    out = fn(*call)
    groups: Any = None

    def run_i() -> None:
        nonlocal groups
        _, groups = backward_input([out], [g], inputs, iter(weights))

    flops = {"I": flops_of(run_i), "W": flops_of(lambda: backward_weight(iter(weights), groups))}
    grads = [t.grad for t in inputs + weights]
    inputs, weights, call = args()
    out = fn(*call)
    flops["full"] = flops_of(lambda: out.backward(g))
    return flops, grads


def reference(fn: Callable[..., Tensor], args: Args) -> tuple[Tensor, ...]:
    inputs, weights, call = args()
    out = fn(*call)
    g = torch.randn(out.shape, dtype=DT, generator=torch.Generator().manual_seed(9))
    return torch.autograd.grad(out, inputs + weights, g)


def assert_grads(got: list[Tensor | None], want: tuple[Tensor, ...]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a is not None
        torch.testing.assert_close(a, b)


# --------------------------------------------------------------------------------------------
# Gradients and FLOPs


@pytest.mark.parametrize("splitter", ["customgrad", pytest.param("torch", marks=TORCH_SPLIT)])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "bias=None"])
@pytest.mark.parametrize("shape", [(6, 5), (2, 3, 5)], ids=["2d", "3d"])
def test_wrapped_linear_splits_with_exact_flops(
    splitter: str, with_bias: bool, shape: tuple[int, ...]
) -> None:
    def args() -> tuple[list[Tensor], list[Tensor], tuple[Any, ...]]:
        x, w = randn(*shape, seed=0), randn(4, 5, seed=1)
        b = randn(4, seed=2) if with_bias else None
        return [x], [w] if b is None else [w, b], (x, w, b)

    flops, grads = split_flops(linear, args, splitter)
    want = reference(lambda x, w, b: x @ w.mT + (0 if b is None else b), args)
    assert_grads(grads, want)
    fn_flops, fn_grads = split_flops(Linear.apply, args, splitter)
    assert_grads(fn_grads, want)
    mm = 2 * (shape[0] * shape[1] if len(shape) == 3 else shape[0]) * 5 * 4
    assert flops == {"I": mm, "W": mm, "full": 2 * mm}
    assert fn_flops["full"] == flops["full"]  # the Function's own full backward
    if splitter == "torch":  # the raw Function's whole backward runs again in torch's W
        assert fn_flops["I"] + fn_flops["W"] == 2 * fn_flops["full"]
    else:  # customgrad's split captures the raw Function's backward and splits it as well
        assert (fn_flops["I"], fn_flops["W"]) == (mm, mm)
    assert isinstance(linear.rules.auto.last, TracedSplit)


def test_a_function_that_computes_every_gradient_splits_too() -> None:
    def args() -> tuple[list[Tensor], list[Tensor], tuple[Any, ...]]:
        x, w = randn(6, 5, seed=0), randn(4, 5, seed=1)
        return [x], [w], (x, w)

    flops, grads = split_flops(naive, args)
    assert_grads(grads, reference(lambda x, w: x @ w.mT, args))
    assert flops == {"I": 240, "W": 240, "full": 480}
    assert flops["full"] == split_flops(NaiveLinear.apply, args)[0]["full"]


def test_setup_context_function_hands_its_shared_work_to_the_weight_pass() -> None:
    def args() -> tuple[list[Tensor], list[Tensor], tuple[Any, ...]]:
        x, w = randn(6, 5, seed=0), randn(4, 5, seed=1)
        return [x], [w], (x, w)

    flops, grads = split_flops(tanh_linear, args)
    assert_grads(grads, reference(lambda x, w: torch.tanh(x @ w.mT), args))
    assert (
        flops["I"] + flops["W"] == flops["full"] == split_flops(TanhLinear.apply, args)[0]["full"]
    )
    assert (flops["I"], flops["W"]) == (240, 240)
    assert "1 tensor(s) handed from the input pass" in tanh_linear.rules.auto.describe()


def test_what_forward_computed_and_kept_reaches_backward() -> None:
    def args() -> tuple[list[Tensor], list[Tensor], tuple[Any, ...]]:
        x, w = randn(2, 6, 5, seed=0), randn(4, 5, seed=1)
        return [x], [w], (x, w, 1e-5)

    flops, grads = split_flops(rms, args)
    want = reference(rms_linear, args)
    assert_grads(grads, want)
    assert flops["I"] + flops["W"] == flops["full"]
    assert flops["full"] == split_flops(RMSLinear.apply, args)[0]["full"]
    # The dispatcher path and the compiled path see the same saved values.
    inputs, weights, call = args()
    out = torch.ops.__getattr__(rms.name.split("::")[0]).rms_linear(*call)
    g = torch.randn(out.shape, dtype=DT, generator=torch.Generator().manual_seed(9))
    assert_grads(list(torch.autograd.grad(out, inputs + weights, g)), want)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend: str) -> None:
    torch._dynamo.reset()
    x, w = randn(2, 6, 5, seed=0), randn(4, 5, seed=1)

    def f(x: Tensor, w: Tensor) -> Tensor:
        return rms(x, w, 1e-5).sin().sum() + tanh_linear(x.sum(0), w).sum()

    def ref(x: Tensor, w: Tensor) -> Tensor:
        return rms_linear(x, w, 1e-5).sin().sum() + torch.tanh(x.sum(0) @ w.mT).sum()

    got = torch.autograd.grad(torch.compile(f, fullgraph=True, backend=backend)(x, w), [x, w])
    assert_grads(list(got), torch.autograd.grad(ref(x, w), [x, w]))


def test_check_op_passes_a_wrapped_function() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=gen) for s in ((4, 3), (5, 3), (5,)))
    report = check_op(linear, x, w, b)
    assert report.ok
    assert report.flops == {"full": 240, "input": 120, "weight": 120}
    assert report.backward.startswith("one backward, split automatically (traced: ")
    assert check_op(tanh_linear, x, w).ok
    report = check_op(rms, x, w, 1e-5, checks=["opcheck", "fake", "gradcheck", "split", "flops"])
    assert report.ok, str(report)


# --------------------------------------------------------------------------------------------
# What a Function may do


def test_non_differentiable_outputs_are_declared() -> None:
    class WithStats(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
            ctx.save_for_backward(x, w)
            out = x @ w.mT
            stats = out.abs().amax(-1)
            ctx.mark_non_differentiable(stats)
            return out, stats

        @staticmethod
        def backward(ctx: Any, grad: Tensor, grad_stats: Tensor) -> tuple[Tensor, Tensor]:
            x, w = ctx.saved_tensors
            return grad @ w, grad.mT @ x

    op = cg.from_function(
        WithStats, unique("with_stats"), weights=("w",), output_differentiability=[True, False]
    )
    x, w = randn(4, 3, seed=0), randn(5, 3, seed=1)
    out, stats = op(x, w)
    assert out.requires_grad and not stats.requires_grad
    torch.testing.assert_close(stats, (x @ w.mT).abs().amax(-1))
    assert_grads(list(torch.autograd.grad(out.sum(), [x, w])),
                 torch.autograd.grad((x @ w.mT).sum(), [x, w]))  # fmt: skip


def test_once_differentiable_backward_refuses_double_backward() -> None:
    from torch.autograd.function import once_differentiable

    class Once(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
            ctx.save_for_backward(x, w)
            return x @ w.mT

        @staticmethod
        @once_differentiable
        def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
            x, w = ctx.saved_tensors
            return grad @ w, grad.mT @ x

    op = cg.from_function(Once, unique("once"), weights=("w",))
    assert op.rules.nondifferentiable == frozenset({"full"})
    x, w = randn(4, 3, seed=0), randn(5, 3, seed=1)
    (gx,) = torch.autograd.grad(op(x, w).sum(), [x], create_graph=True)
    with pytest.raises(cg.UnsupportedError, match="registered with differentiable=False"):
        torch.autograd.grad(gx.sum(), [w])


def test_double_backward_through_saved_inputs_and_outputs() -> None:
    x, w = randn(4, 5, seed=0), randn(3, 5, seed=1)
    got = torch.autograd.gradgradcheck(tanh_linear, (x, w))
    assert got
    (gx,) = torch.autograd.grad(tanh_linear(x, w).sum(), [x], create_graph=True)
    (want,) = torch.autograd.grad(torch.tanh(x @ w.mT).sum(), [x], create_graph=True)
    torch.testing.assert_close(torch.autograd.grad(gx.sum(), [w])[0],
                               torch.autograd.grad(want.sum(), [w])[0])  # fmt: skip


def test_tensors_kept_as_attributes() -> None:
    class Attrs(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
            h = x @ w.mT
            ctx.z_x, ctx.a_w, ctx.m_h = x, w, h  # an input, a weight, a computed tensor
            return torch.tanh(h)

        @staticmethod
        def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
            t = torch.tanh(ctx.m_h)
            gh = grad * (1 - t * t)
            return gh @ ctx.a_w, gh.mT @ ctx.z_x

    op = cg.from_function(Attrs, unique("attrs"), weights=("w",))
    x, w = randn(4, 3, seed=0), randn(5, 3, seed=1)
    want = torch.autograd.grad(torch.tanh(x @ w.mT).sum(), [x, w], create_graph=True)
    got = torch.autograd.grad(op(x, w).sum(), [x, w], create_graph=True)
    assert_grads(list(got), tuple(t.detach() for t in want))
    with pytest.raises(cg.UnsupportedError, match="reached a tensor that the Function's forward"):
        torch.autograd.grad(got[0].sum(), [x])  # through h, which forward computed


def test_schema_given_for_an_unannotated_forward() -> None:
    class Plain(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, scale):  # type: ignore[no-untyped-def]
            ctx.save_for_backward(x, w)
            ctx.scale = scale
            return (x * w) * scale

        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def]
            x, w = ctx.saved_tensors
            return grad * w * ctx.scale, (grad * x * ctx.scale).sum(0), None

    op = cg.from_function(
        Plain, unique("plain"), weights=("w",), schema="(Tensor x, Tensor w, float scale) -> Tensor"
    )
    assert op.schema == "(Tensor x, Tensor w, float scale) -> Tensor"
    x, w = randn(4, 3, seed=0), randn(3, seed=1)
    assert_grads(list(torch.autograd.grad(op(x, w, 2.0).sum(), [x, w])),
                 torch.autograd.grad((x * w * 2.0).sum(), [x, w]))  # fmt: skip


# --------------------------------------------------------------------------------------------
# Round 3


class GluLinear(torch.autograd.Function):
    """``a * sigmoid(b)`` for ``a, b = (x @ w.mT).chunk(2)``: saves two views of one
    intermediate (torch refuses residuals that alias each other)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        a, b = (x @ w.mT).chunk(2, -1)
        ctx.save_for_backward(x, w, a, b)
        return a * torch.sigmoid(b)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor]:
        x, w, a, b = ctx.saved_tensors
        s = torch.sigmoid(b)
        dh = torch.cat([g * s, g * a * s * (1 - s)], -1)
        return dh @ w, dh.mT @ x


def glu_ref(x: Tensor, w: Tensor) -> Tensor:
    a, b = (x @ w.mT).chunk(2, -1)
    return a * torch.sigmoid(b)


def test_views_of_one_intermediate_are_saved() -> None:
    glu = cg.from_function(GluLinear, unique("glu"), weights=("w",))

    def args() -> tuple[list[Tensor], list[Tensor], tuple[Any, ...]]:
        x, w = randn(3, 4, seed=0), randn(6, 4, seed=1)
        return [x], [w], (x, w)

    flops, grads = split_flops(glu, args)
    assert_grads(grads, reference(glu_ref, args))
    assert flops["I"] + flops["W"] == flops["full"] == split_flops(GluLinear.apply, args)[0]["full"]
    inputs, weights, call = args()  # the dispatcher path
    out = getattr(torch.ops, glu.name.split("::")[0]).glu(*call)
    want = torch.autograd.grad(glu_ref(*call), inputs + weights, torch.ones_like(out))
    assert_grads(list(torch.autograd.grad(out, inputs + weights, torch.ones_like(out))), want)


def tanh_function(once: bool) -> type[torch.autograd.Function]:
    """``tanh(x @ w.mT)`` saving ``1 - y**2`` (an intermediate), as Functions commonly do."""

    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor]:
        x, w, h = ctx.saved_tensors
        d = g * h
        return d @ w, d.mT @ x

    class Tanh(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
            y = torch.tanh(x @ w.mT)
            ctx.save_for_backward(x, w, 1 - y * y)
            return y

    Tanh.backward = staticmethod(  # type: ignore[method-assign]
        torch.autograd.function.once_differentiable(backward) if once else backward
    )
    return Tanh


def test_double_backward_through_a_saved_intermediate_gives_the_one_line_fix() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 3, generator=gen), torch.randn(5, 3, generator=gen)
    op = cg.from_function(tanh_function(once=False), unique("tanh"), weights=("w",))
    report = check_op(op, x, w)  # not applicable, saying why and the one-line fix
    assert report["gradgradcheck"].status == "skipped"
    assert report["gradgradcheck"].detail.startswith("not applicable: ")
    assert "decorate its backward with @once_differentiable" in report["gradgradcheck"].detail
    # The fix it gives: the check passes, double backward skipped as not supported.
    op = cg.from_function(tanh_function(once=True), unique("tanh"), weights=("w",))
    report = check_op(op, x, w)
    assert report.ok and report["gradgradcheck"].status == "skipped"


class ScaleIfAsked(torch.autograd.Function):
    """Stores ``x.requires_grad`` on ctx in forward, as many Functions do."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.x_requires_grad = x.requires_grad
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor]:
        x, w = ctx.saved_tensors
        return (g * w if ctx.x_requires_grad else None), (g * x).sum(0)


def test_requires_grad_read_in_forward_under_aot_autograd() -> None:
    # Under AOTAutograd the kernel runs on fakes that don't require grad: x got no gradient.
    op = cg.from_function(ScaleIfAsked, unique("scale_if_asked"), weights=("w",))
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 4, generator=gen), torch.randn(4, generator=gen)
    report = check_op(op, x, w, checks=["opcheck", "gradcheck", "split"])
    assert report.ok, str(report)
    x, w = randn(3, 4, seed=0), randn(4, seed=1)
    from functorch.compile import make_boxed_func

    aot = torch._functorch.aot_autograd.aot_function(
        lambda x, w: op(x, w), lambda gm, _: make_boxed_func(gm)
    )
    got = torch.autograd.grad(aot(x, w).sum(), [x, w])
    assert_grads(list(got), torch.autograd.grad((x * w).sum(), [x, w]))


# --------------------------------------------------------------------------------------------
# A Function whose forward launches Triton: a fake kernel for the outputs the user sees


def _triton_function() -> type[torch.autograd.Function]:
    """RMSNorm as a Function: its forward launches the Triton kernel itself (raw), its backward
    calls the fused backward kernel through its op (which has a fake kernel)."""
    from examples.ops import triton_fused_rms_norm as rms

    class TritonRMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
            y, rstd = rms._forward(x, weight, eps)  # a raw launch
            ctx.save_for_backward(x, weight, rstd)
            ctx.cols = x.shape[-1]  # a plain value the backward reads
            return y

        @staticmethod
        def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
            x, weight, rstd = ctx.saved_tensors
            assert ctx.cols == x.shape[-1]
            dx, dw = rms.triton_rms_norm_backward(grad, x, weight, rstd)
            return dx, dw, None

    return TritonRMSNorm


_needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="runs Triton on CPU through its interpreter"
)


@_needs_interpreter
def test_triton_function_compiles_with_a_fake_kernel_for_its_outputs() -> None:
    op = cg.from_function(_triton_function(), unique("triton_rms"), weights=("weight",))

    @op.register_fake
    def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return torch.empty_like(x)

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=gen).requires_grad_()
    w = torch.randn(8, generator=gen).requires_grad_()
    op(x, w, 1e-6).sum().backward()
    xc, wc = (t.detach().clone().requires_grad_() for t in (x, w))
    fn = torch.compile(lambda a, b: op(a, b, 1e-6).sum(), backend="aot_eager", fullgraph=True)
    fn(xc, wc).backward()
    torch.testing.assert_close(xc.grad, x.grad)
    torch.testing.assert_close(wc.grad, w.grad)


def _fake_call(op: cg.CustomOp[..., Any], *shapes: tuple[int, ...]) -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        return op(*(mode.from_tensor(torch.randn(s)) for s in shapes), 1e-6)


@_needs_interpreter
def test_triton_function_without_a_fake_kernel_names_the_op_and_how_to_give_one() -> None:
    function = _triton_function()
    name = unique("triton_rms")
    op = cg.from_function(function, name, weights=("weight",))
    with pytest.raises(cg.UnsupportedError) as info:
        _fake_call(op, (4, 8), (8,))
    message = str(info.value)
    assert message.startswith(
        f"{name}: the Function's forward cannot run on fake tensors (torch.compile, opcheck and "
        f"FakeTensorMode run an op's fake kernel, which for an op made with from_function is the "
        f"Function's forward): it launches the Triton kernel _forward_kernel directly ("
    )
    assert message.endswith(
        "Give the op a fake kernel for the outputs the user sees; customgrad handles what the "
        "forward saves on ctx:\n\n"
        f'    op = cg.from_function(TritonRMSNorm, "{name}", ...)\n'
        "    @op.register_fake\n"
        "    def _(x, weight, eps):\n"
        "        return torch.empty_like(x)              # each output's shape, dtype and device\n\n"
        f"(forward defined at {__file__}:{function.forward.__code__.co_firstlineno})"
    )


@_needs_interpreter
def test_a_fake_kernel_whose_outputs_do_not_match_the_forward_names_both() -> None:
    name = unique("triton_rms")
    op = cg.from_function(_triton_function(), name, weights=("weight",))
    wrong = op.register_fake(lambda x, weight, eps: torch.empty_like(weight))
    with pytest.raises(
        cg.CustomGradError,
        match=re.escape(
            f"{name}: the fake kernel registered with register_fake returned 1 output(s): (8) "
            f"float32 on cpu, but the Function's forward returns 1 output(s): (4, 8) float32 on "
            f"cpu for these arguments. Return tensors exactly like the forward's outputs (same "
            f"count, shape, dtype and device); return only the outputs the user sees, not what "
            f"forward saves. (fake kernel defined at {wrong.__code__.co_filename}:"
            f"{wrong.__code__.co_firstlineno})"
        ),
    ):
        _fake_call(op, (4, 8), (8,))


_CFG: dict[str, float] = {"scale": 2.0}
_LOG: list[str] = []


class _CtxContainers(torch.autograd.Function):
    """Keeps a dict and a list on ctx (not arguments): backward reads the dict as it is then,
    and appends to the list."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.cfg = _CFG
        ctx.log = _LOG
        return x * w * _CFG["scale"]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (x,) = ctx.saved_tensors
        ctx.log.append("backward")
        s = ctx.cfg["scale"]
        return g * s, (g * x * s).sum(0)


def test_ctx_containers_reach_backward_as_the_user_s_own_objects() -> None:
    op = cg.from_function(_CtxContainers, "test_ff_ctx::containers", weights=("w",))
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    got = {}
    for name, f in (("raw", _CtxContainers.apply), ("op", op)):
        _CFG["scale"], _LOG[:] = 2.0, []
        y = f(x, w)
        _CFG["scale"] = 3.0  # changed between forward and backward: backward sees it
        (gw,) = torch.autograd.grad(y.sum(), [w])
        got[name] = (gw, list(_LOG))
    torch.testing.assert_close(got["op"][0], got["raw"][0])
    torch.testing.assert_close(got["op"][0], 3.0 * x.detach().sum(0))
    assert got["op"][1] == got["raw"][1] == ["backward"]  # appended to the user's list


class _WeightOnCtx(torch.autograd.Function):
    """Keeps its weight on ctx without saving it (``ctx.w = w``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.w = w
        return x * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (x,) = ctx.saved_tensors
        return g * ctx.w, (g * x).sum(0)


def test_a_weight_kept_on_ctx_and_changed_in_place_reads_as_with_the_raw_function() -> None:
    # Plain autograd keeps ctx.w by reference (no version check): backward reads the weight as
    # it is then. customgrad saved it through autograd and raised torch's version error.
    op = cg.from_function(_WeightOnCtx, "test_ff_ctx::weight_on_ctx", weights=("w",))
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    got = []
    for f in (_WeightOnCtx.apply, op):
        y = f(x, w)
        with torch.no_grad():
            w.mul_(2.0)  # an optimizer step between forward and backward
        got.append(torch.autograd.grad(y.sum(), [x])[0])
        with torch.no_grad():
            w.div_(2.0)
    torch.testing.assert_close(got[1], got[0])
    torch.testing.assert_close(got[1], (2.0 * w.detach()).expand(3, 4))
