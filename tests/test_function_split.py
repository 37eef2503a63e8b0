"""Plain ``torch.autograd.Function``\\ s split in a stage's split backward (issue 31, item 1).

A Function node with weight edges whose backward dynamo can capture is split as customgrad's own
single backwards are: its input work runs in I, its weight work in W, the gradients equal the
backward's and the FLOPs of I and W add up to the full backward's. A backward that cannot be
captured (side effects, a write into its output gradient) runs once in I, its reason logged once
per class; ``split_functions=False`` runs every one once.
"""

from __future__ import annotations

import copy
import logging
import re
from collections import Counter
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.pipelining import ScheduleZBVZeroBubble
from torch.utils.flop_counter import FlopCounterMode

import customgrad as cg
import customgrad.pipelining as cgp
from customgrad._split_plan import stage_split
from customgrad.pipelining import (
    _backward,
    _function_split,
    stage_backward_input,
    stage_backward_weight,
)

DT = torch.float64
CALLS: Counter[str] = Counter()
SHIFT = 1.0  # read by ScaledLinear's backward (a global changed between steps)


class RMSNorm(torch.autograd.Function):
    """An RMSNorm in torch ops, as Liger's RMSNorm is in Triton: ``x / rms(x) * w``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, eps: float) -> Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, w, rstd)
        return x * rstd * w

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, w, rstd = ctx.saved_tensors
        normed = x * rstd
        dw = (grad * normed).sum(0)
        gw = grad * w
        dx = rstd * (gw - normed * (gw * normed).mean(-1, keepdim=True))
        return dx, dw, None


class ScaledLinear(torch.autograd.Function):
    """``scale * x @ w.T + SHIFT * 0`` with non-tensor arguments before, between and after the
    tensors, a ctx attribute and a global read in backward."""

    @staticmethod
    def forward(ctx: Any, scale: float, x: Tensor, w: Tensor, transpose: bool) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.scale = scale
        ctx.transpose = transpose
        return scale * (x @ (w.t() if transpose else w))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, Tensor, None]:
        x, w = ctx.saved_tensors
        g = grad * (ctx.scale * SHIFT)
        wt = w.t() if ctx.transpose else w
        dx = g @ wt.t()
        dwt = x.t() @ g
        return None, dx, dwt.t() if ctx.transpose else dwt, None


class CountedLinear(torch.autograd.Function):
    """``x @ w.T`` whose backward counts its calls (a side effect: it cannot be captured)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        CALLS["counted"] += 1
        x, w = ctx.saved_tensors
        return grad @ w, grad.t() @ x


class Affine(torch.autograd.Function):
    """``(x @ w.T + b) * scale``: three tensors and a number."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, b: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.scale = scale
        return (x @ w.t() + b) * scale

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        x, w = ctx.saved_tensors
        g = grad * ctx.scale
        return g @ w, g.t() @ x, g.sum(0), None


def _loss(out: Tensor, target: Tensor) -> Tensor:
    return ((out - target) ** 2).sum()


def _split(
    run: Any, x: Tensor, weights: list[Tensor], grad: Tensor, **options: Any
) -> tuple[Tensor, list[Tensor | None], int, int]:
    """One stage's I and W on ``run(x)``: dX, each weight's gradient, and the FLOPs of I and W."""
    for w in weights:
        w.grad = None
    out = run(x)
    with FlopCounterMode(display=False) as i_flops:
        (dx,), groups = stage_backward_input([out], [grad], [x], weights, **options)
    assert dx is not None and all(w.grad is None for w in weights)
    with FlopCounterMode(display=False) as w_flops:
        stage_backward_weight(weights, groups)
    return dx, [w.grad for w in weights], i_flops.get_total_flops(), w_flops.get_total_flops()


def _full(run: Any, x: Tensor, weights: list[Tensor], grad: Tensor) -> tuple[list[Tensor], int]:
    out = run(x)
    with FlopCounterMode(display=False) as flops:
        grads = torch.autograd.grad(out, [x, *weights], grad)
    return list(grads), flops.get_total_flops()


def _leaf(*shape: int) -> Tensor:
    return torch.randn(*shape, dtype=DT, requires_grad=True)


def test_an_rmsnorm_function_splits_with_its_weight_work_in_w() -> None:
    x, w = _leaf(4, 6), _leaf(6)
    grad = torch.randn(4, 6, dtype=DT)

    def run(x: Tensor) -> Tensor:
        return RMSNorm.apply(x, w, 1e-6)  # type: ignore[no-untyped-call,no-any-return]

    (ref_dx, ref_dw), full = _full(run, x, [w], grad)
    dx, (dw,), i_flops, w_flops = _split(run, x, [w], grad)
    assert torch.equal(dx, ref_dx) and dw is not None and torch.equal(dw, ref_dw)
    assert (i_flops, w_flops, full) == (0, 0, 0)  # elementwise only: FlopCounterMode counts none
    report = cg.explain_split([run(x)], [x], [w], [grad])
    assert [(f.label, f.how) for f in report.functions] == [
        ("RMSNorm (autograd.Function)", "split")
    ]


def test_a_linear_function_splits_its_matmuls_between_i_and_w() -> None:
    x, w = _leaf(4, 3), _leaf(5, 3)
    grad = torch.randn(4, 5, dtype=DT)

    def run(x: Tensor) -> Tensor:
        return ScaledLinear.apply(2.0, x, w, True)  # type: ignore[no-untyped-call,no-any-return]

    (ref_dx, ref_dw), full = _full(run, x, [w], grad)
    dx, (dw,), i_flops, w_flops = _split(run, x, [w], grad)
    assert torch.equal(dx, ref_dx) and dw is not None and torch.equal(dw, ref_dw)
    matmul = 2 * 4 * 5 * 3
    assert (i_flops, w_flops, full) == (matmul, matmul, 2 * matmul)


def test_a_changed_ctx_attribute_or_global_between_steps_stays_right() -> None:
    global SHIFT
    w = _leaf(5, 3)
    try:
        for scale, transpose, shift in [(2.0, True, 1.0), (3.0, True, 1.0), (3.0, False, 1.0),
                                         (3.0, True, 0.5)]:  # fmt: skip
            SHIFT = shift
            x = _leaf(4, 3)
            weight = w if transpose else w.detach().t().contiguous().requires_grad_()
            grad = torch.randn(4, 5, dtype=DT)

            def run(x: Tensor, weight: Tensor = weight, scale: float = scale,
                    transpose: bool = transpose) -> Tensor:  # fmt: skip
                return ScaledLinear.apply(scale, x, weight, transpose)  # type: ignore[no-untyped-call,no-any-return]

            (ref_dx, ref_dw), _ = _full(run, x, [weight], grad)
            dx, (dw,), i_flops, w_flops = _split(run, x, [weight], grad)
            assert torch.equal(dx, ref_dx) and dw is not None and torch.equal(dw, ref_dw)
            assert i_flops == w_flops > 0  # split each time
    finally:
        SHIFT = 1.0


def test_a_function_with_a_side_effect_runs_once_with_its_reason_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _backward._TOLD.discard(CountedLinear)
    w = _leaf(5, 3)
    with caplog.at_level(logging.INFO, logger="customgrad"):
        for _ in range(2):
            x = _leaf(4, 3)
            grad = torch.randn(4, 5, dtype=DT)

            def run(x: Tensor) -> Tensor:
                return CountedLinear.apply(x, w)  # type: ignore[no-untyped-call,no-any-return]

            (ref_dx, ref_dw), full = _full(run, x, [w], grad)
            CALLS.clear()
            dx, (dw,), i_flops, w_flops = _split(run, x, [w], grad)
            assert CALLS["counted"] == 1
            assert torch.equal(dx, ref_dx) and dw is not None and torch.equal(dw, ref_dw)
            assert (i_flops, w_flops) == (full, 0)  # whole, once, in I
    told = [r.getMessage() for r in caplog.records if "CountedLinear" in r.getMessage()]
    assert len(told) == 1
    reason = re.escape("it changes state outside itself")
    assert re.search(r"CountedLinear is a plain autograd.Function whose backward cannot split "
                     r"automatically \(.*" + reason, told[0])  # fmt: skip


def test_split_functions_false_runs_them_once_in_i() -> None:
    x, w = _leaf(4, 3), _leaf(5, 3)
    grad = torch.randn(4, 5, dtype=DT)

    def run(x: Tensor) -> Tensor:
        return ScaledLinear.apply(2.0, x, w, True)  # type: ignore[no-untyped-call,no-any-return]

    (ref_dx, ref_dw), full = _full(run, x, [w], grad)
    dx, (dw,), i_flops, w_flops = _split(run, x, [w], grad, split_functions=False)
    assert torch.equal(dx, ref_dx) and dw is not None and torch.equal(dw, ref_dw)
    assert (i_flops, w_flops) == (full, 0)


def test_tensors_without_gradient_among_non_tensors_run_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The node does not say which argument a tensor needing no gradient was: not split."""
    _backward._TOLD.discard(Affine)
    x, w = _leaf(4, 3), _leaf(5, 3)
    grad = torch.randn(4, 5, dtype=DT)
    frozen = torch.randn(5, dtype=DT)

    def run(x: Tensor) -> Tensor:
        return Affine.apply(x, w, frozen, 2.0)  # type: ignore[no-untyped-call,no-any-return]

    (ref_dx, ref_dw), full = _full(run, x, [w], grad)
    with caplog.at_level(logging.INFO, logger="customgrad"):
        dx, (dw,), i_flops, w_flops = _split(run, x, [w], grad)
    assert torch.equal(dx, ref_dx) and dw is not None and torch.equal(dw, ref_dw)
    assert (i_flops, w_flops) == (full, 0)
    told = [r.getMessage() for r in caplog.records if "Affine" in r.getMessage()]
    assert len(told) == 1 and "does not tell which gradient it returns goes along" in told[0]


def test_under_the_queue_a_function_runs_once_and_is_right() -> None:
    """The queue gives plain Functions' weights their gradients in I, as a plain backward does
    (it defers customgrad ops' weight halves only): the backward runs once, there."""
    x, w = _leaf(4, 3), _leaf(5, 3)
    grad = torch.randn(4, 5, dtype=DT)
    (ref_dx, ref_dw), full = _full(lambda x: CountedLinear.apply(x, w), x, [w], grad)  # type: ignore[no-untyped-call]
    queue = cgp.WeightGradQueue()
    CALLS.clear()
    out: Tensor = CountedLinear.apply(x, w)  # type: ignore[no-untyped-call]
    with FlopCounterMode(display=False) as flops:
        queue.backward(out, grad, inputs=[x])
        queue.runner([(0, 0)], strict=False)()
    queue.finish()
    assert CALLS["counted"] == 1 and flops.get_total_flops() == full
    assert x.grad is not None and torch.equal(x.grad, ref_dx)
    assert w.grad is not None and torch.equal(w.grad, ref_dw)


class InPlaceScale(torch.autograd.Function):
    """``x * w`` whose backward writes dX over its output gradient (torch ops, not a kernel):
    the capture refuses the write, and it runs once."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        x, w = ctx.saved_tensors
        dw = (grad * x).sum(0)
        return grad.mul_(w), dw


def test_a_backward_writing_into_its_output_gradient_runs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _backward._TOLD.discard(InPlaceScale)
    x, w = _leaf(4, 3), _leaf(3)
    grad = torch.randn(4, 3, dtype=DT)

    def run(x: Tensor) -> Tensor:
        return InPlaceScale.apply(x, w)  # type: ignore[no-untyped-call,no-any-return]

    (ref_dx, ref_dw), _ = _full(run, x, [w], grad.clone())
    with caplog.at_level(logging.INFO, logger="customgrad"):
        dx, (dw,), _, _ = _split(run, x, [w], grad.clone())
    assert torch.equal(dx, ref_dx) and dw is not None and torch.equal(dw, ref_dw)
    told = [r.getMessage() for r in caplog.records if "InPlaceScale" in r.getMessage()]
    assert len(told) == 1
    assert "it writes in place into a tensor it did not create" in told[0]


def test_explain_split_shows_a_split_function_in_i_and_w() -> None:
    x, w = _leaf(4, 3), _leaf(5, 3)
    out: Tensor = ScaledLinear.apply(2.0, x, w, True)  # type: ignore[no-untyped-call]
    report = cg.explain_split([out], [x], [w], [torch.randn(4, 5, dtype=DT)])
    (row,) = [n for n in report.nodes if n.kind == "function"]
    matmul = 2 * 4 * 5 * 3
    assert (row.flops["input"], row.flops["weight"], row.runs_in) == (matmul, matmul, "I+W")
    assert report.repeated_flops == 0 and report.computes_twice == []
    assert [(f.label, f.how) for f in report.functions] == [
        ("ScaledLinear (autograd.Function)", "split")
    ]
    assert "backward captured and split: input work in I, weight work in W" in str(report)


class _Block(nn.Module):
    """``relu(ScaledLinear(x, w))``: a plain Function with a weight edge in a stage."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6) / 6**0.5)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = ScaledLinear.apply(2.0, x, self.w, True)  # type: ignore[no-untyped-call]
        return torch.relu(out)


@pytest.mark.parametrize("split", [True, False])
def test_pipeline_stage_splits_functions_unless_told_not_to(group: None, split: bool) -> None:
    mods = [_Block(), _Block()]
    ref = nn.Sequential(*copy.deepcopy(mods))
    stages = [
        cgp.PipelineStage(m, i, 2, torch.device("cpu"), split_functions=split)
        for i, m in enumerate(mods)
    ]
    schedule = ScheduleZBVZeroBubble(stages, n_microbatches=2, loss_fn=_loss)
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    _backward._TOLD.discard(ScaledLinear)
    _function_split.SPLIT.discard(ScaledLinear)
    schedule.step(x, target=y)
    for xi, yi in zip(x.chunk(2), y.chunk(2)):
        (_loss(ref(xi), yi) / 2).backward()
    for m, r in zip(mods, ref):
        assert m.w.grad is not None and r.w.grad is not None
        torch.testing.assert_close(m.w.grad, r.w.grad)
    # split: nothing said; run once: one line, which names the class (summary lists it)
    assert (ScaledLinear in _backward._TOLD) is not split
    name = f"{__name__}.ScaledLinear"
    report = cg.summary()
    assert (name in report.split_functions, name in report.functions) == (split, not split)
    heading = "customgrad's split cut" if split else "customgrad's split ran once"
    assert re.search(
        re.escape(heading) + r"[^\n]*:\n(  .*\n)*" + re.escape(f"  {name}"), str(report)
    )


class FourWeights(torch.autograd.Function):
    """``x*a + x²*b + x³*c + sin(x)*d``: four weights of one shape, whose gradients differ only
    in value (one sent along another's edge would be a silently wrong gradient)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, a: Tensor, b: Tensor, c: Tensor, d: Tensor) -> Tensor:
        ctx.save_for_backward(x, a, b, c, d)
        return x * a + x * x * b + x**3 * c + torch.sin(x) * d

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, ...]:
        x, a, b, c, d = ctx.saved_tensors
        dx = g * (a + 2 * x * b + 3 * x * x * c + torch.cos(x) * d)
        return dx, (g * x).sum(0), (g * x * x).sum(0), (g * x**3).sum(0), (g * torch.sin(x)).sum(0)


def test_same_shaped_weights_get_their_own_gradients_along_their_own_edges() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 5, dtype=DT, requires_grad=True)
    ws = [torch.randn(5, dtype=DT, requires_grad=True) for _ in range(4)]
    out = FourWeights.apply(torch.tanh(x), *ws)
    _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], ws)
    split = stage_split(groups)
    assert split is not None and split.split_functions()  # it split: W runs its weight pass
    stage_backward_weight(ws, groups)
    h = torch.tanh(x).detach()
    want = [h.sum(0), (h * h).sum(0), (h**3).sum(0), torch.sin(h).sum(0)]
    for w, g in zip(ws, want):
        torch.testing.assert_close(w.grad, g)
