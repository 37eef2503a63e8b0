"""customgrad.testing.check_op: passes good ops, and catches each planted fault."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import Tensor

import customgrad as cg
from customgrad.testing import CHECKS, FIX_TWICE, MSG_NO_FLOPS, CheckFailed, check_op
from tests.conftest import linear_op


def _args() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, generator=g), torch.randn(5, 3, generator=g)


good = linear_op("test_testing::good")


def test_good_op_passes_every_check() -> None:
    report = check_op(good, *_args())
    assert report.ok
    assert [r.name for r in report.results] == list(CHECKS)
    assert all(r.status == "passed" for r in report.results)
    assert report.flops == {"full": 240, "input": 120, "weight": 120}
    assert report.calls["input"] == {"backward_input": 1}
    assert report.calls["weight"] == {"backward_weight": 1}
    text = str(report)
    assert "[ok  ] flops" in text
    assert "FLOPs: full 240, input pass 120, weight pass 120" in text


def test_arguments_are_left_untouched() -> None:
    x, w = _args()
    w.requires_grad_(True)
    before = (x.clone(), w.detach().clone())
    check_op(good, x, w)
    assert not x.requires_grad and x.grad is None and w.grad is None
    torch.testing.assert_close((x, w.detach()), before)


wrong_backward = linear_op("test_testing::wrong_backward", backward=None)


@wrong_backward.register_backward_input
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
    return {"x": 2 * grad @ saved[1]}  # planted: twice the true gradient


@wrong_backward.register_backward_weight
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
    return {"weight": grad.mT @ saved[0]}


def test_catches_wrong_backward() -> None:
    with pytest.raises(CheckFailed) as info:
        check_op(wrong_backward, *_args())
    msg = str(info.value)
    assert msg.startswith("check_op(test_testing::wrong_backward): ")
    assert (
        "- gradcheck: the backward disagrees with finite differences: Jacobian mismatch for "
        "output 0 with respect to 'x'"
    ) in msg
    assert info.value.report["split"].status == "passed"  # consistent, just wrong
    assert isinstance(info.value, AssertionError)
    assert isinstance(info.value, cg.CustomGradError)


wrong_fake_shape = linear_op("test_testing::wrong_fake_shape")


@wrong_fake_shape.register_fake
def _(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], weight.shape[0] + 1))  # planted: one column too many


def test_catches_wrong_fake_kernel_shape() -> None:
    fix = "Make the fake kernel (register_fake) return tensors exactly like the real kernel's"
    with pytest.raises(
        CheckFailed,
        match=re.escape(f"- fake: output 0: real shape (4, 5), fake shape (4, 6)\n      {fix}"),
    ) as info:
        check_op(wrong_fake_shape, *_args())
    assert info.value.report["opcheck"].status == "failed"
    assert "test_faketensor" in info.value.report["opcheck"].detail


wrong_fake_dtype_strides = linear_op("test_testing::wrong_fake_dtype_strides")


@wrong_fake_dtype_strides.register_fake
def _(x: Tensor, weight: Tensor) -> Tensor:
    # planted: float64 and column-major
    return x.new_empty((weight.shape[0], x.shape[0]), dtype=torch.float64).mT


def test_catches_wrong_fake_kernel_dtype_and_strides() -> None:
    with pytest.raises(CheckFailed) as info:
        check_op(wrong_fake_dtype_strides, *_args())
    detail = info.value.report["fake"].detail
    assert "output 0: real dtype torch.float32, fake dtype torch.float64" in detail
    assert "output 0: real strides (5, 1), fake strides (1, 4)" in detail


greedy = linear_op("test_testing::greedy", backward=None)


@greedy.register_backward(split="phase")
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
    x, w = saved  # planted: ignores ctx.needs_input_grad, computes everything every pass
    return {"x": grad @ w, "weight": grad.mT @ x}


def test_catches_backward_that_ignores_needs_input_grad() -> None:
    with pytest.raises(
        CheckFailed,
        match=re.escape(
            "- flops: the split repeats 240 FLOPs: input pass 240 + weight pass 240 > full "
            "backward 240\n"
            "      backward computed a gradient for 'weight' in the input pass, where "
            "ctx.needs_input_grad('weight') is False (it is thrown away)\n"
            "      backward computed a gradient for 'x' in the weight pass, where "
            "ctx.needs_input_grad('x') is False (it is thrown away)\n"
            "      The split repeats work."
        ),
    ) as info:
        check_op(greedy, *_args())
    report = info.value.report
    assert [r.name for r in report.failures] == ["flops"]  # gradients are right
    assert report.calls["input"] == {"backward": 1}


@torch.library.custom_op("test_testing::opaque_mm", mutates_args=())
def opaque_mm(a: Tensor, b: Tensor) -> Tensor:  # no FLOP formula: FLOP counters see 0
    return a @ b


opaque_greedy = linear_op("test_testing::opaque_greedy", backward=None)


@opaque_greedy.register_backward(split="phase")
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
    x, w = saved  # planted, through an opaque kernel that FLOP counters see as 0 FLOPs
    return {"x": opaque_mm(grad, w), "weight": opaque_mm(grad.mT, x)}


def test_catches_repeated_work_in_opaque_kernels() -> None:
    report = check_op(opaque_greedy, *_args(), checks=["split", "flops"], raise_on_failure=False)
    assert report.flops == {"full": 0, "input": 0, "weight": 0}
    assert not report.ok
    assert report["flops"].detail.startswith(
        "backward computed a gradient for 'weight' in the input pass"
    )


phase_dependent = linear_op("test_testing::phase_dependent", backward=None)


@phase_dependent.register_backward(split="phase")  # called per pass, so ctx.phase varies
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
    x, w = saved
    out: dict[str, Any] = {}
    if ctx.needs_input_grad("x"):
        out["x"] = grad @ w
    if ctx.needs_input_grad("weight"):
        scale = 2.0 if ctx.phase == "weight" else 1.0  # planted: wrong only when split
        out["weight"] = scale * grad.mT @ x
    return out


def test_catches_split_that_differs_from_full_backward() -> None:
    with pytest.raises(
        CheckFailed,
        match=re.escape(
            "- split: gradient of 'weight' from the weight pass differs from the full backward"
        ),
    ) as info:
        check_op(phase_dependent, *_args())
    assert [r.name for r in info.value.report.failures] == ["split"]


def test_every_failure_is_listed_in_one_error() -> None:
    @cg.op("test_testing::everything_wrong", weights=("weight",))
    def op(x: Tensor, weight: Tensor) -> Tensor:
        return x @ weight.mT

    @op.register_fake
    def _(x: Tensor, weight: Tensor) -> Tensor:
        return x.new_empty((x.shape[0], weight.shape[0] + 1))

    @op.register_save_for_backward
    def _(inputs: Any, output: Tensor) -> Any:
        return inputs.x, inputs.weight

    @op.register_backward(split="phase")  # called whole in each pass: repeats FLOPs
    def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
        x, w = saved
        return {"x": 3 * grad @ w, "weight": grad.mT @ x}

    with pytest.raises(CheckFailed, match=re.escape("4 of 6 checks failed:")) as info:
        check_op(op, *_args())
    names = [r.name for r in info.value.report.failures]
    assert names == ["opcheck", "fake", "gradcheck", "flops"]
    for name in names:
        assert f"\n  - {name}: " in str(info.value)


def test_options() -> None:
    report = check_op(good, *_args(), checks=("split",))
    assert report["split"].status == "passed"
    assert report["opcheck"] == report["opcheck"].__class__("opcheck", "skipped", "not requested")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "check_op: unknown check 'gradchek'. Checks: opcheck, fake, gradcheck, "
            "gradgradcheck, split, flops."
        ),
    ):
        check_op(good, *_args(), checks=["gradchek"])
    with pytest.raises(KeyError, match=re.escape("no check named 'nope'")):
        report["nope"]


def test_requires_grad_picks_what_is_differentiated() -> None:
    x, w = _args()
    report = check_op(good, x, w.requires_grad_(True))  # only the weight
    assert report["split"].status == "skipped"
    assert report["split"].detail == (
        "nothing to split: no non-weight argument among the differentiated arguments"
    )
    assert report["gradcheck"].status == "passed"


@cg.op("test_testing::weighted_sum", weights=("scales",))
def weighted_sum(xs: list[Tensor], scales: list[Tensor], *, bias: float = 0.0) -> Tensor:
    return sum((x * s for x, s in zip(xs, scales)), torch.zeros_like(xs[0])) + bias


@weighted_sum.register_fake
def _(xs: list[Tensor], scales: list[Tensor], *, bias: float = 0.0) -> Tensor:
    return torch.empty_like(xs[0])


@weighted_sum.register_save_for_backward
def _(inputs: Any, output: Tensor) -> Any:
    return inputs.xs, inputs.scales


@weighted_sum.register_backward
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
    xs, scales = saved
    out: dict[str, Any] = {}
    if ctx.needs_input_grad("xs"):
        out["xs"] = [grad * s for s in scales]
    if ctx.needs_input_grad("scales"):
        out["scales"] = [grad * x for x in xs]
    return out


def test_list_and_keyword_only_arguments() -> None:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(3, generator=g) for _ in range(2)]
    scales = [torch.randn(3, generator=g) for _ in range(2)]
    report = check_op(weighted_sum, xs, scales, bias=0.5)
    assert report.ok
    assert report.calls["input"] == {"backward (traced input part)": 1}
    assert report.calls["weight"] == {"backward (traced weight part)": 1}


# fake and save_for_backward, but no backward
no_autograd = linear_op("test_testing::no_autograd", backward=None)


def test_missing_autograd_is_reported_not_crashed() -> None:
    report = check_op(no_autograd, *_args(), raise_on_failure=False)
    assert report["fake"].status == "passed"
    for name in ("gradcheck", "split", "flops"):
        assert report[name].status == "failed"
        assert report[name].detail.startswith("raised MissingRegistrationError: ")


def test_a_backward_declared_not_differentiable_skips_gradgradcheck() -> None:
    @cg.op("test_testing::once_diff_scale", weights=("w",))
    def scale(x: Tensor, w: Tensor) -> Tensor:
        return x * w

    scale.register_fake(lambda x, w: torch.empty_like(x))
    scale.register_save_for_backward(lambda inputs, output: (inputs.x, inputs.w))
    scale.register_backward_input(lambda ctx, s, g: {"x": g * s[1]}, differentiable=False)
    scale.register_backward_weight(lambda ctx, s, g: {"w": (g * s[0]).sum(0)})
    report = check_op(scale, torch.randn(3, 4), torch.randn(4))
    assert report.ok
    assert report["gradgradcheck"].status == "skipped"
    assert report["gradgradcheck"].detail == (
        "not applicable: the backward is registered with differentiable=False (backward_input; "
        "a Function's @once_differentiable backward through from_function): double backward "
        "raises by design"
    )


# --------------------------------------------------------------------------------------------
# Round 3: check_op checks what it names


def test_in_place_matmuls_are_counted() -> None:
    # Work done in place (addmm_, baddbmm_, ...) has no formula in torch's FLOP table: a
    # backward repeating only in-place work passed the flops check.
    op = linear_op("test_testing::in_place", backward=None)

    @op.register_backward(split="phase")
    def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
        x, w = saved
        gx = grad.new_zeros(x.shape).addmm_(grad, w)  # both, in every pass
        gw = grad.new_zeros(w.shape).addmm_(grad.mT, x)
        return {k: v for k, v in (("x", gx), ("weight", gw)) if ctx.needs_input_grad(k)}

    report = check_op(op, *_args(), raise_on_failure=False)
    assert report.flops == {"full": 240, "input": 240, "weight": 240}
    assert report["flops"].status == "failed"
    assert report["flops"].detail.startswith(
        "the split repeats 240 FLOPs: input pass 240 + weight pass 240 > full backward 240"
    )


def mlp_pair(name: str) -> cg.CustomOp[..., Tensor]:
    """``silu(x @ up.mT) @ down.mT`` whose input and weight halves both compute ``g @ down``."""

    @cg.op(name, weights=("up", "down"))
    def mlp(x: Tensor, up: Tensor, down: Tensor) -> Tensor:
        return torch.nn.functional.silu(x @ up.mT) @ down.mT

    mlp.register_fake(lambda x, up, down: x.new_empty((x.shape[0], down.shape[0])))
    mlp.register_save_for_backward(lambda i, o: (i.x, i.up, i.down))

    def dh(saved: Any, g: Tensor) -> tuple[Tensor, Tensor]:
        x, up, down = saved
        h = x @ up.mT
        s = torch.sigmoid(h)
        return (g @ down) * (s * (1 + h * (1 - s))), h * s

    @mlp.register_backward_input
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        return {"x": dh(saved, g)[0] @ saved[1]}

    @mlp.register_backward_weight
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        d, act = dh(saved, g)  # recomputes x @ up.mT and g @ down: done in the input pass too
        return {"up": d.mT @ saved[0], "down": g.mT @ act}

    return mlp


def test_work_computed_in_both_halves_is_reported_with_the_fix() -> None:
    # full = I + W, since the full backward runs both halves: the sum can't see it.
    op = mlp_pair("test_testing::mlp_twice")
    g = torch.Generator().manual_seed(0)
    x, up, down = (torch.randn(*s, generator=g) for s in ((4, 3), (5, 3), (2, 5)))
    report = check_op(op, x, up, down, raise_on_failure=False)
    assert report.flops["input"] + report.flops["weight"] == report.flops["full"]
    assert report["flops"].status == "failed"
    detail = report["flops"].detail
    assert detail.splitlines()[:2] == [
        "the input pass and the weight pass both compute aten.mm.default giving the same (4, 5) "
        "tensor (120 FLOPs each time): work done twice",
        "the input pass and the weight pass both compute aten.mm.default giving the same (4, 5) "
        "tensor (80 FLOPs each time): work done twice",
    ]
    assert detail.endswith(FIX_TWICE)
    # The same backward written once and split automatically does it once.
    assert check_op(good, *_args()).ok


def test_an_op_without_counted_flops_says_so() -> None:
    # LayerNorm-like: elementwise and reductions only. It reported "[ok] flops" with 0/0/0.
    @cg.op("test_testing::scale", weights=("w",))
    def scale(x: Tensor, w: Tensor) -> Tensor:
        return x * w

    scale.register_fake(lambda x, w: torch.empty_like(x))
    scale.register_save_for_backward(lambda i, o: (i.x, i.w))

    @scale.register_backward_input
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        return {"x": g * saved[1]}

    @scale.register_backward_weight
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        return {"w": (g * saved[0]).sum(0)}

    report = check_op(scale, torch.randn(4, 3), torch.randn(3))
    assert report.ok
    assert report.flops == {"full": 0, "input": 0, "weight": 0}
    assert report["flops"].status == "skipped"
    assert report["flops"].detail == MSG_NO_FLOPS.format(
        ran="input pass: backward_input x1; weight pass: backward_weight x1"
    )
    assert "[skip] flops (float64): could not measure FLOPs" in str(report)
    assert "[ok  ] flops" not in str(report)


def test_an_op_that_fails_in_every_dtype_is_not_blamed_on_float64() -> None:
    @cg.op("test_testing::broken", weights=("w",))
    def broken(x: Tensor, w: Tensor) -> Tensor:
        raise ValueError("broken kernel")

    broken.register_fake(lambda x, w: torch.empty_like(x))
    broken.register_save_for_backward(lambda i, o: (i.x, i.w))
    broken.register_backward_input(lambda ctx, s, g: {"x": g * s[1]})
    broken.register_backward_weight(lambda ctx, s, g: {"w": (g * s[0]).sum(0)})
    report = check_op(broken, torch.randn(4, 3), torch.randn(3), raise_on_failure=False)
    for name in ("gradcheck", "split"):
        assert report[name].status == "failed"
        assert report[name].detail.startswith("raised ValueError: broken kernel"), report[name]
        assert "float64 path" not in report[name].detail


def test_one_error_raised_by_several_checks_is_listed_once() -> None:
    op = linear_op("test_testing::returns_tuple", backward=None)

    @op.register_backward
    def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> Any:
        x, w = saved
        return grad @ w, grad.mT @ x  # planted: a tuple, not a dict

    report = check_op(op, *_args(), raise_on_failure=False)
    assert [r.name for r in report.failures] == [
        "opcheck", "gradcheck", "gradgradcheck", "split", "flops",
    ]  # fmt: skip
    message = report.failure_message()
    assert message.count("must return a dict of gradients") == 1
    assert message.splitlines()[1].startswith(
        "  - opcheck, gradcheck, gradgradcheck, split, flops: each raised GradientTypeError: "
        "test_testing::returns_tuple: backward must return a dict of gradients keyed by "
        "argument name, but returned a tuple of 2 items. Return {'x': grad_x, 'weight': "
        "grad_weight} (None for a gradient that is zero)."
    )
    text = str(report)
    assert text.count("must return a dict of gradients") == 1
    assert "[FAIL] split (float64): raised the same error as opcheck" in text


def test_the_report_says_how_a_registered_pair_splits() -> None:
    report = check_op(good, *_args())
    assert report.backward == (
        "the pair: backward_input returns 'x' in the input pass; backward_weight returns "
        "'weight' in the weight pass"
    )
    assert f"  backward: {report.backward}" in str(report)


# -- check_op's advice, applied: each fix it prints gives the outcome it promises --------------


def test_fix_flops_applied_asking_needs_input_grad_passes() -> None:
    # FIX_FLOPS, second way: in a single backward, compute a gradient only when asked.
    op = linear_op("test_testing::asks", backward=None)

    @op.register_backward(split="phase")
    def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Any]:
        x, weight = saved
        grads = {}
        if ctx.needs_input_grad("x"):
            grads["x"] = grad @ weight
        if ctx.needs_input_grad("weight"):
            grads["weight"] = grad.mT @ x
        return grads

    report = check_op(op, *_args())
    assert report.ok
    assert report.flops == {"full": 240, "input": 120, "weight": 120}


def test_fix_flops_applied_the_pair_passes() -> None:
    # FIX_FLOPS, first way: the pair (``good`` registers it) does no work twice.
    report = check_op(good, *_args())
    assert report["flops"].status == "passed"
    assert report.flops["input"] + report.flops["weight"] == report.flops["full"]


def _mlp_args() -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*s, generator=g) for s in ((4, 3), (5, 3), (2, 5)))  # type: ignore[return-value]


def test_fix_twice_applied_with_register_backward_shared_passes() -> None:
    # FIX_TWICE, first way: what both halves need, computed once in register_backward_shared.
    op = mlp_pair("test_testing::mlp_shared")

    @op.register_backward_shared
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> Any:
        x, up, down = saved
        h = x @ up.mT
        s = torch.sigmoid(h)
        return (g @ down) * (s * (1 + h * (1 - s))), h * s

    @op.register_backward_input
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        return {"x": ctx.shared[0] @ saved[1]}

    @op.register_backward_weight
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        d, act = ctx.shared
        return {"up": d.mT @ saved[0], "down": g.mT @ act}

    report = check_op(op, *_mlp_args())
    assert report.ok, str(report)
    twice = check_op(
        mlp_pair("test_testing::mlp_twice_again"), *_mlp_args(), raise_on_failure=False
    )
    assert report.flops["full"] < twice.flops["full"]  # the shared matmuls, once


def test_fix_twice_applied_with_one_traced_backward_passes() -> None:
    # FIX_TWICE, second way: one backward returning every gradient, split automatically.
    op = mlp_pair("test_testing::mlp_traced")

    @op.register_backward  # replaces the pair
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        x, up, down = saved
        h = x @ up.mT
        s = torch.sigmoid(h)
        d = (g @ down) * (s * (1 + h * (1 - s)))
        return {"x": d @ up, "up": d.mT @ x, "down": g.mT @ (h * s)}

    report = check_op(op, *_mlp_args())
    assert report.ok, str(report)
    assert report.flops["input"] + report.flops["weight"] == report.flops["full"]


def test_fix_fake_applied_passes() -> None:
    # FIX_FAKE: a fake kernel that returns the real kernel's shape, dtype and strides.
    op = linear_op("test_testing::fake_fixed")

    @op.register_fake
    def _(x: Tensor, weight: Tensor) -> Tensor:
        return x.new_empty((x.shape[0], weight.shape[0] + 1))  # the mistake

    assert check_op(op, *_args(), raise_on_failure=False)["fake"].status == "failed"

    @op.register_fake
    def _(x: Tensor, weight: Tensor) -> Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))  # new_empty: contiguous, as x @ w.mT

    report = check_op(op, *_args())
    assert report["fake"].status == "passed" and report["opcheck"].status == "passed"


def test_no_float64_advice_applied_checks_in_float32() -> None:
    # MSG_NO_FLOAT64: "check_op(op, ..., dtype=torch.float32)" for a kernel without float64.
    @cg.op("test_testing::float32_only", weights=("w",))
    def op(x: Tensor, w: Tensor) -> Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"this kernel takes float32 tensors, got {x.dtype}")
        return x * w

    op.register_fake(lambda x, w: torch.empty_like(x))
    op.register_save_for_backward(lambda i, o: (i.x, i.w))
    op.register_backward_input(lambda ctx, s, g: {"x": g * s[1]})
    op.register_backward_weight(lambda ctx, s, g: {"w": (g * s[0]).sum(0)})
    x, w = torch.randn(4, 3), torch.randn(3)
    failed = check_op(op, x, w, dtype=torch.float64, raise_on_failure=False)  # asked for
    assert "dtype=torch.float32" in failed["gradcheck"].detail
    report = check_op(op, x, w, dtype=torch.float32)
    assert report.ok
    assert report["gradcheck"].status == "passed" and report["gradcheck"].dtype == "float32"
    # MSG_COARSE_DTYPE's advice: in bfloat16 the gradchecks are skipped, saying to use float32
    coarse = check_op(op, x, w, dtype=torch.bfloat16, raise_on_failure=False)
    assert coarse["gradcheck"].status == "skipped"
    assert "dtype=torch.float32" in coarse["gradcheck"].detail


def test_opchecks_tests_failing_with_the_same_error_count_as_one() -> None:
    from customgrad.testing import CheckReport, CheckResult

    error = "GradientTypeError: ns::op: backward must return a dict"
    report = CheckReport(
        "ns::op",
        [
            CheckResult(
                "opcheck",
                "failed",
                f"torch.library.opcheck's test_autograd_registration failed: {error}\n"
                f"torch.library.opcheck's test_aot_dispatch_dynamic failed: {error}",
            ),
            CheckResult("gradcheck", "failed", f"raised {error}"),
            CheckResult("split", "failed", "gradient of 'x' from the input pass differs"),
        ],
    )
    assert report.failure_message().splitlines() == [
        "check_op(ns::op): 3 of 3 checks failed:",
        f"  - opcheck, gradcheck: each raised {error}",
        "  - split: gradient of 'x' from the input pass differs",
    ]


# --------------------------------------------------------------------------------------------
# Round 6: check_op says yes to what works and explains the rest


class _SwiGLU(torch.autograd.Function):
    """As xformers' and Liger's: the forward saves what it computed (``a``, ``b``, ``s``)."""

    @staticmethod
    def forward(ctx, x, w1, w2):  # type: ignore[no-untyped-def]  # unannotated, as libraries'
        a, b = x @ w1.mT, x @ w2.mT
        s = torch.sigmoid(a)
        ctx.save_for_backward(x, w1, w2, a, b, s)
        return a * s * b

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x, w1, w2, a, b, s = ctx.saved_tensors
        db = g * a * s
        da = g * b * (s + a * s * (1 - s))
        return da @ w1 + db @ w2, da.mT @ x, db.mT @ x


def _swiglu_args() -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    return (
        torch.randn(4, 8, generator=g),
        torch.randn(6, 8, generator=g),
        torch.randn(6, 8, generator=g),
    )


def test_a_from_function_op_that_keeps_forward_values_passes_gradgradcheck_not_applicable() -> None:
    from customgrad._errors import where
    from customgrad._from_function import MSG_COMPUTED_DOUBLE_BACKWARD

    name = "test_testing::swiglu_kept"
    op = cg.from_function(_SwiGLU, name, weights=("w1", "w2"))
    assert op.op is None  # a deferred op: check_op defines it from its arguments
    report = check_op(op, *_swiglu_args())
    assert report.ok, str(report)
    assert report["gradgradcheck"].status == "skipped"
    reason = MSG_COMPUTED_DOUBLE_BACKWARD.format(op=name, loc=where(_SwiGLU.forward))
    assert report["gradgradcheck"].detail == f"not applicable: {reason}"
    assert op.op is not None and check_op(op.op, *_swiglu_args()).ok  # the op it defined


def test_a_once_differentiable_function_passes_gradgradcheck_not_applicable() -> None:
    from torch.autograd.function import once_differentiable

    class Once(_SwiGLU):
        @staticmethod
        @once_differentiable
        def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            return _SwiGLU.backward(ctx, g)

    report = check_op(cg.from_function(Once, "test_testing::swiglu_once", weights=("w1", "w2")),
                      *_swiglu_args())  # fmt: skip
    assert report.ok, str(report)
    assert report["gradgradcheck"].detail.startswith(
        "not applicable: the backward is registered with differentiable=False (backward; a "
        "Function's @once_differentiable backward through from_function)"
    )


def test_a_backward_that_branches_on_a_value_is_reported_as_running_once() -> None:
    from customgrad.testing import MSG_BRANCH

    op = linear_op("test_testing::branches", backward=None)

    @op.register_backward
    def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor]:
        x, w = saved
        if grad.abs().max() > 100:  # a tensor value: runs once
            grad = grad / grad.abs().max()
        return {"x": grad @ w, "weight": grad.mT @ x}

    report = check_op(op, *_args())
    assert report.ok, str(report)
    line = _.__code__.co_firstlineno + 3  # the decorator's line, then the branch's
    at = f"{__file__}:{line} (`if grad.abs().max() > 100:  # a tensor value: runs once`)"
    assert report["opcheck"].detail == MSG_BRANCH.format(
        test="test_aot_dispatch_dynamic", once="runs once: ", at=at
    )
    assert "GuardOnDataDependentSymNode" not in str(report)


def test_a_full_backward_that_computes_a_gradient_nothing_needs_is_explained() -> None:
    # LoRA with one naive backward: it returns the frozen base weight's gradient too. The full
    # backward calls it as written; the split computes what its passes need: I + W < full.
    from customgrad.testing import MSG_FULL_DOES_MORE

    @cg.op("test_testing::lora", weights=("a", "b"))
    def lora(x: Tensor, w: Tensor, a: Tensor, b: Tensor) -> Tensor:
        return x @ w.mT + (x @ a.mT) @ b.mT

    lora.register_fake(lambda x, w, a, b: x.new_empty((*x.shape[:-1], w.shape[0])))
    lora.register_save_for_backward(lambda i, o: (i.x, i.w, i.a, i.b))

    @lora.register_backward
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Tensor]:
        x, w, a, b = saved
        gb = g @ b
        return {"x": g @ w + gb @ a, "w": g.mT @ x, "a": gb.mT @ x, "b": g.mT @ (x @ a.mT)}

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, generator=gen), torch.randn(6, 8, generator=gen)
    a, b = torch.randn(2, 8, generator=gen), torch.randn(6, 2, generator=gen)
    report = check_op(lora, x.requires_grad_(), w, a.requires_grad_(), b.requires_grad_())
    assert report.ok, str(report)
    f = report.flops
    assert f["full"] - f["input"] - f["weight"] == 2 * 4 * 6 * 8  # g.mT @ x, for 'w'
    assert report["flops"].detail == MSG_FULL_DOES_MORE.format(
        less=384, full=f["full"], input=f["input"], weight=f["weight"], label="backward",
        names="'w'", name="w",
    )  # fmt: skip


def test_a_kernel_whose_backward_has_no_float64_is_checked_in_its_dtype() -> None:
    # As a Triton kernel's launcher: a dtype table without float64, in the backward only.
    from customgrad.testing import MSG_RAN_OWN

    table = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    op = linear_op("test_testing::float32_backward", backward=None)

    @op.register_backward
    def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor]:
        x, w = saved
        table[grad.dtype]  # KeyError: torch.float64
        return {"x": grad @ w, "weight": grad.mT @ x}

    report = check_op(op, *_args())
    assert report.ok, str(report)
    assert [report[c].dtype for c in CHECKS] == ["own", "own", *["float32"] * 4]
    assert report.dtype_note == MSG_RAN_OWN.format(
        dtype="float32", op="test_testing::float32_backward", exc="KeyError: torch.float64"
    )
    assert "\n  dtype: gradcheck, gradgradcheck, split and flops ran in float32, the " in str(
        report
    )
