"""customgrad.graph.explain_split: names what computes twice, measures it, draws it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from customgrad.graph import SplitExplanation, explain_split
from tests._skips import TORCH_SPLIT
from tests.conftest import linear_op

linear = linear_op("test_graph::linear")


class PlainLinear(torch.autograd.Function):
    """A plain Function: its backward computes dx and dW in every pass."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.mT

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor]:
        x, w = ctx.saved_tensors
        return g @ w, g.mT @ x


@torch.library.custom_op("test_graph::lib_linear", mutates_args=())
def lib_linear(x: Tensor, w: Tensor) -> Tensor:
    return x @ w.mT


@lib_linear.register_fake
def _(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))


def _lib_linear_backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor]:
    x, w = ctx.saved_tensors
    return g @ w, g.mT @ x


def _lib_linear_setup(ctx: Any, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


lib_linear.register_autograd(_lib_linear_backward, setup_context=_lib_linear_setup)


def _stage(splitter: Any = "torch") -> tuple[SplitExplanation, dict[str, Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, generator=g, requires_grad=True)
    ws = {f"w{i}": torch.randn(3, 3, generator=g, requires_grad=True) for i in range(4)}
    h = linear(x, ws["w0"])
    h = PlainLinear.apply(torch.relu(h), ws["w1"])  # planted among customgrad ops
    h = lib_linear(h, ws["w2"])
    h = linear(h, ws["w3"])
    return explain_split(h, [x], ws, splitter=splitter), ws


@TORCH_SPLIT
def test_names_plain_function_and_custom_op_among_customgrad_ops() -> None:
    report, _ = _stage()
    twice = {n.label: n for n in report.computes_twice}
    assert set(twice) == {"PlainLinear (autograd.Function)", "test_graph::lib_linear"}
    assert twice["PlainLinear (autograd.Function)"].kind == "function"
    assert twice["test_graph::lib_linear"].kind == "custom_op"
    # Each repeats its whole backward: two 4x3x3 matmuls, 144 FLOPs.
    assert all(n.repeated_flops == 144 for n in twice.values())
    assert report.repeated_flops == 288
    cg_nodes = [n for n in report.nodes if n.kind == "customgrad"]
    assert [n.label for n in cg_nodes] == ["test_graph::linear", "test_graph::linear #2"]
    assert all(n.runs_in == "I+W" and not n.computes_twice for n in cg_nodes)
    assert all(n.flops == {"full": 144, "input": 72, "weight": 72} for n in cg_nodes)
    assert report.flops == {"full": 576, "input": 432, "weight": 432}


@TORCH_SPLIT
def test_str_lists_nodes_and_the_offenders() -> None:
    report, _ = _stage()
    text = str(report)
    assert "split by torch.distributed.pipelining" in text
    assert re.search(
        r"PlainLinear \(autograd\.Function\)\s+function\s+I\+W\s+144\s+144\s+144", text
    )
    assert "FLOPs: full backward 576, input pass 432, weight pass 432, repeated 288." in text
    assert (
        "  - PlainLinear (autograd.Function) (function): 144 FLOPs repeated; its backward runs "
        "whole in both passes; make it a customgrad op (register_backward_input/_weight)."
    ) in text
    assert "ReluBackward0" in text
    assert [n.label for n in report.input_only] == ["ReluBackward0", "input (4, 3)"]
    assert {n.label for n in report.weight_only} >= {"w0", "w1", "w2", "w3"}


@TORCH_SPLIT
def test_grads_are_restored() -> None:
    report, ws = _stage()
    assert report.nodes
    assert all(w.grad is None for w in ws.values())


@TORCH_SPLIT
def test_shared_weights_torch_split_repeats_customgrad_split_does_not() -> None:
    def run(splitter: Any) -> SplitExplanation:
        x = torch.randn(4, 3, requires_grad=True)
        w = torch.randn(3, 3, requires_grad=True)
        return explain_split(linear(torch.relu(linear(x, w)), w), [x], [w], splitter=splitter)

    torch_split = run("torch")
    assert torch_split.repeated_flops == 72
    assert [n.label for n in torch_split.computes_twice] == ["test_graph::linear"]
    ours = run("customgrad")
    assert ours.repeated_flops == 0
    assert not ours.computes_twice
    assert ours.splitter == "customgrad.pipelining"
    assert all(n.deferred for n in ours.nodes if n.kind == "customgrad")
    # The deferred weight halves count to their nodes: each linear's dW is 2 * 4 * 3 * 3.
    assert [n.flops["weight"] for n in ours.nodes if n.kind == "customgrad"] == [72, 72]
    assert ours.outside_flops["weight"] == 0
    assert "(outside nodes)" not in str(ours)


@TORCH_SPLIT
def test_to_dot() -> None:
    report, _ = _stage()
    dot = report.to_dot()
    assert dot.startswith("digraph split {") and dot.endswith("}")
    assert (
        'label="PlainLinear (autograd.Function)\\nfunction · I+W\\nTWICE (144 FLOPs repeated)"'
        in dot
    )
    assert dot.count("->") == len(report.edges)


@TORCH_SPLIT
@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_draw(tmp_path: Path, suffix: str) -> None:
    report, _ = _stage()
    path = report.draw(tmp_path / f"split{suffix}")
    data = path.read_bytes()
    if suffix == ".png":
        assert data.startswith(b"\x89PNG")
    else:
        assert b"<svg" in data[:1000]


@TORCH_SPLIT
def test_errors() -> None:
    report, _ = _stage()
    with pytest.raises(
        ValueError,
        match=re.escape(
            "explain_split(...).draw('split.pdf'): cannot tell the format from the suffix "
            "'.pdf'. Use a path ending in .png or .svg."
        ),
    ):
        report.draw("split.pdf")
    x = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(
        ValueError,
        match=re.escape("explain_split: unknown splitter 'mine'. Use 'customgrad' or 'torch'"),
    ):
        explain_split(x * 2, [x], [], splitter="mine")  # type: ignore[arg-type]
