"""``customgrad.summary()``: every registered op, how its backward splits, what it registered."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor

import customgrad as cg
from customgrad._summary import OpRow


def _linear(name: str, **kwargs: Any) -> Any:
    @cg.op(f"test_summary::{name}", weights=("w",), **kwargs)
    def linear(x: Tensor, w: Tensor) -> Tensor:
        return x @ w.mT

    @linear.register_fake
    def _(x: Tensor, w: Tensor) -> Tensor:
        return x.new_empty((*x.shape[:-1], w.shape[0]))

    @linear.register_save_for_backward
    def _(inputs: Any, output: Tensor) -> Any:
        return inputs.x, inputs.w

    return linear


def _backward(ctx: Any, saved: Any, g: Tensor) -> dict[str, Tensor]:
    x, w = saved
    return {"x": g @ w, "w": g.mT @ x}


def _branching(ctx: Any, saved: Any, g: Tensor) -> dict[str, Tensor]:
    x, w = saved
    if g.sum() > 0:  # a branch on a tensor value: not traceable
        g = g * 1.0
    return {"x": g @ w, "w": g.mT @ x}


def _run(op: Any) -> None:
    x = torch.randn(2, 3, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    op(x, w).sum().backward()


def _row(name: str) -> OpRow:
    (row,) = [r for r in cg.summary("test_summary").ops if r.op == f"test_summary::{name}"]
    return row


def test_a_single_backward_is_not_run_yet_then_traced() -> None:
    op = _linear("traced")
    op.register_backward(_backward)
    assert _row("traced") == OpRow(
        "test_summary::traced",
        "not run yet",
        "traced and split at its first backward",
        ("all",),
        ("fake",),
    )
    _run(op)
    assert _row("traced") == OpRow(
        "test_summary::traced",
        "traced",
        "traced: 3 ops; the input pass runs 1, the weight pass 2; 0 tensor(s) handed from the "
        "input pass to the weight pass, 0 op(s) recomputed there",
        ("all",),
        ("fake",),
    )


def test_a_backward_that_cannot_be_traced_fell_back_and_says_why() -> None:
    op = _linear("branching")
    op.register_backward(_branching)
    _run(op)
    row = _row("branching")
    assert row.split == "run once"
    lines, first = inspect.getsourcelines(_branching)
    at = f"{inspect.getsourcefile(_branching)}:{first + 2} (`{lines[2].strip()}`)"
    assert row.detail == (
        f"it branches on tensor values in Python at {at}; runs once, whole, in the first pass "
        "that needs a gradient; fix: compute with tensor ops instead (torch.where, masks), so "
        "the same ops run for every value"
    )


def test_pair_phase_none_and_registrations() -> None:
    pair = _linear("pair")
    pair.register_backward_input(lambda ctx, saved, g: {"x": g @ saved[1]})
    pair.register_backward_weight(
        lambda ctx, saved, g: {"w": g.mT @ saved[0]}, differentiable=False
    )
    pair.register_backward_shared(lambda ctx, saved, g: None)
    pair.register_jvp(lambda inputs, output, tangents: output)
    pair.register_kernel("cpu", lambda x, w: x @ w.mT)
    phase = _linear("phase")
    phase.register_backward(_backward, split="phase")
    _linear("none")
    assert _row("pair") == OpRow(
        "test_summary::pair",
        "pair",
        "registered: the input and weight halves (differentiable=False: weight)",
        ("all", "cpu"),
        ("fake", "jvp", "shared"),
    )
    assert _row("phase") == OpRow(
        "test_summary::phase",
        "phase",
        "split='phase': called whole in each pass, ctx.needs_input_grad set for it",
        ("all",),
        ("fake",),
    )
    assert _row("none").split == "none"


def test_the_table() -> None:
    @cg.op("test_summary_table::scale")
    def scale(x: Tensor) -> Tensor:
        return 2 * x

    scale.register_save_for_backward(lambda inputs, output: ())
    scale.register_backward_input(lambda ctx, saved, g: {"x": 2 * g})
    assert str(cg.summary("test_summary_table")).splitlines() == [
        "op                         backward  kernels  also registered  how it splits",
        "-------------------------  --------  -------  ---------------  -------------",
        "test_summary_table::scale  pair      all      -                registered: the input half",
    ]


def test_the_table_says_when_the_split_is_off_and_when_there_is_nothing() -> None:
    with cg.no_split():
        text = str(cg.summary("test_summary_nothing_here"))
    assert text.splitlines() == [
        "The split is off (CUSTOMGRAD_SPLIT=0 or customgrad.no_split()): every backward below "
        "runs whole in each pass that reaches it.",
        "No customgrad ops are registered.",
    ]
    assert "split is off" not in str(cg.summary("test_summary_nothing_here"))
