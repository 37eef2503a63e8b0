"""Real libraries' ``torch.autograd.Function``\\ s, unmodified, through customgrad's split.

Liger-Kernel's Functions (the block of :mod:`tests._liger_block`: what
``apply_liger_kernel_to_llama`` puts in a Llama at its defaults) run under Triton's interpreter
on CPU. Through customgrad's ``stage_backward_input``/``stage_backward_weight`` and the
weight-gradient queue, two stages and two microbatches: every gradient equals one process's full
backward, and each backward kernel is launched per microbatch as often as in the full backward.
``run_functions_once=False`` (torch's way) launches them twice and gets wrong gradients, which
is what the default prevents. ScheduleZBVZeroBubble on two processes is in
``test_real_functions_mp.py``.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from typing import Any

import pytest
import torch
from torch import Tensor

import customgrad as cg
import customgrad.pipelining as cgp
from tests._skips import TORCH_SPLIT, optional_package

# liger_kernel first: a failed import of tests._liger_block can stay half-made in
# sys.modules (the doctest collection imports it too)
pytest.importorskip("liger_kernel", reason=optional_package("liger-kernel"))
L = pytest.importorskip("tests._liger_block", reason=optional_package("liger-kernel"))


def _launches_per_microbatch(run_backward: Any) -> tuple[dict[str, Tensor], list[Counter[str]]]:
    """Gradients of one step of both stages, and each microbatch's backward kernel launches;
    ``run_backward(stage_out, grad, inputs, module)`` runs one stage's backward."""
    with L.liger_kernels():
        first, last = L.build()
        x, target = L.batch()
        counts: list[Counter[str]] = []
        for xm, tm in zip(x.chunk(L.MICROBATCHES), target.chunk(L.MICROBATCHES)):
            h = first(xm)
            h_in = h.detach().requires_grad_()
            loss = last(h_in, tm)
            with L.backward_launches() as launched:
                (dh,) = run_backward([loss], None, [h_in], last)
                run_backward([h], [dh], [], first)
            counts.append(Counter(launched))
        return L.gradients(first, last), counts


def _full(outputs: Any, grads: Any, inputs: Any, module: Any) -> tuple[Tensor | None, ...]:
    torch.autograd.backward(outputs, grads)
    return tuple(i.grad for i in inputs)


@functools.cache
def _reference() -> tuple[dict[str, Tensor], list[Counter[str]]]:
    """One process's full backward: gradients and launches (computed once for the module)."""
    return _launches_per_microbatch(_full)


def _split(once: bool) -> Any:
    def run(outputs: Any, grads: Any, inputs: Any, module: Any) -> tuple[Tensor | None, ...]:
        dx, groups = cgp.stage_backward_input(
            outputs, grads, inputs, module.parameters(), run_functions_once=once
        )
        cgp.stage_backward_weight(module.parameters(), groups)
        return dx

    return run


def _queued(outputs: Any, grads: Any, inputs: Any, module: Any) -> tuple[Tensor | None, ...]:
    queue = cgp.WeightGradQueue()
    queue.backward(outputs, grads, inputs=inputs)
    queue.runner([(0, 0)], strict=False)()
    queue.finish()
    return tuple(i.grad for i in inputs)


@pytest.mark.parametrize("driver", ["split", "queue"])
def test_liger_block_gradients_and_launches_equal_the_full_backward(driver: str) -> None:
    ref, ref_counts = _reference()
    got, counts = _launches_per_microbatch(_split(True) if driver == "split" else _queued)
    assert set(got) == set(ref)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], msg=name)
    assert counts == ref_counts
    assert all(c["_rms_norm_backward_kernel"] == 5 and c["element_mul_kernel"] for c in counts)


def test_liger_block_under_torch_s_way_runs_twice_and_is_wrong() -> None:
    # run_functions_once=False re-runs each Function's backward in W, as torch's split does:
    # the in-place RMSNorm reads dX where it wrote over dY, the fused loss scales its kept
    # gradients a second time.
    ref, ref_counts = _reference()
    got, counts = _launches_per_microbatch(_split(False))
    assert counts[0]["_rms_norm_backward_kernel"] > ref_counts[0]["_rms_norm_backward_kernel"]
    wrong = [n for n in ref if not torch.allclose(got[n], ref[n], rtol=1e-4, atol=1e-6)]
    assert "1.layer.input_layernorm" in wrong and "1.head.lm_head" in wrong, wrong


@pytest.mark.parametrize("splitter", ["customgrad", pytest.param("torch", marks=TORCH_SPLIT)])
def test_explain_split_names_each_liger_function_and_how_it_ran(splitter: str) -> None:
    with L.liger_kernels():
        _, last = L.build()
        x, target = L.batch()
        h = x[: L.BATCH].requires_grad_()
        report = cg.explain_split(
            last(h, target[: L.BATCH]), [h], last.named_parameters(), splitter=splitter
        )
    runs = {(r.label.split(" ")[0], r.module): r for r in report.functions}
    rms = runs["LigerRMSNormFunction", "layer"]
    assert rms.calls == 2
    text = str(report)
    if splitter == "customgrad":
        how = {r.label.split(" ")[0]: r.how for r in report.functions}
        assert how == {
            "LigerRMSNormFunction": "once",
            "LigerSiLUMulFunction": "I",  # no weight edge: I only, as in torch's split
            "LigerRopeFunction": "I",
            "LigerFusedLinearCrossEntropyFunction": "once",
        }
        assert (
            "LigerRMSNormFunction (autograd.Function) in layer, 2 call(s): backward ran once"
            in text
        )
    else:
        assert rms.how == "twice"
    # The fused loss scales what it kept in place, by the rescaled loss's 1/2: a second backward
    # of the graph differs from the first, so explain_split's check has no reference.
    assert report.gradient_errors is None
    assert "Gradients not compared: a second backward of this graph differs" in text


class _InPlaceScale(torch.autograd.Function):
    """``x * w`` whose backward writes dX over dY, as Liger's RMSNorm does (``in_place=True``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        x, w = ctx.saved_tensors
        dw = (grad * x).sum(0)
        return grad.mul_(w), dw


def test_explain_split_shows_the_gradient_difference_of_torch_s_split() -> None:
    # A graph whose backward repeats (Liger's do not: its SwiGLU backward writes over what it
    # saved): torch's split gets the in-place Function's weight gradient wrong (W reads the dX
    # I wrote over dY), customgrad's split runs it once and gets it right.
    errors = {}
    for splitter in ("customgrad", "torch"):
        lin = torch.nn.Linear(4, 4)
        w = torch.nn.Parameter(torch.randn(4))
        x = torch.randn(3, 4, requires_grad=True)
        out = _InPlaceScale.apply(lin(x), w)
        weights = {"w": w, **dict(lin.named_parameters())}
        report = cg.explain_split([out], [x], weights, [torch.randn(3, 4)], splitter=splitter)
        errors[splitter] = report.gradient_errors
    assert errors["customgrad"] == {}
    assert errors["torch"] is not None and "w" in errors["torch"]
    assert "The split's gradients differ from the full backward's" in str(report)
    assert "_InPlaceScale (autograd.Function), 1 call(s): backward ran whole in I and again" in (
        str(report)
    )


def test_the_log_names_each_function_class_once(caplog: pytest.LogCaptureFixture) -> None:
    from customgrad.pipelining import _backward

    _backward._TOLD.clear()
    with caplog.at_level(logging.INFO, logger="customgrad"):
        _launches_per_microbatch(_split(True))
    told = [r.getMessage() for r in caplog.records if "cannot split" in r.getMessage()]
    # One line per class with weight edges (RMSNorm ran 10 times, the loss twice), none for
    # rope and SwiGLU, which have none (they run in I alone, as in any split).
    assert sorted(m.split(" ")[1] for m in told) == [
        "liger_kernel.ops.fused_linear_cross_entropy.LigerFusedLinearCrossEntropyFunction",
        "liger_kernel.ops.rms_norm.LigerRMSNormFunction",
    ]


def test_summary_names_the_function_classes_run_once() -> None:
    _launches_per_microbatch(_split(True))
    summary = cg.summary()
    text = str(summary)
    assert "Plain autograd.Functions customgrad's split ran once" in text
    assert "  liger_kernel.ops.rms_norm.LigerRMSNormFunction" in text
    # no weight edge: nothing to run once (ops that from_functions made of it may be listed)
    assert "liger_kernel.ops.rope.LigerRopeFunction" not in summary.functions
