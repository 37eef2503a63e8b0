"""``torch.autograd.Function``\\ s inside a ``customgrad.compile``\\ d region, under customgrad's split.

Dynamo traces a Function whose forward and backward it can trace into the region's graph: the
region's backward is then one AOTAutograd graph, cut into I and W like the rest of it, and the
Function's weight gradient is computed in W. A Function whose backward it cannot trace (here a
side effect: a global dict written) is a graph break: the region becomes two graphs and the
Function runs between them as a plain node, which customgrad's split runs once, in I, handing W
the weight gradient it returned. Either way I + W do the full backward's FLOPs, and the
gradients are the eager module's.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

import customgrad as cg
import customgrad.pipelining as cgp
from customgrad._split_plan import runs_once

# dynamo's tracing of a Function instantiates torch's Function base class (torch 2.13), which
# warns; not this code's doing.
pytestmark = pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning"
)

CALLS = {"backward": 0}
D, B = 8, 4
MM = 2 * B * D * D  # one matmul of the block's backward


class TracedLinear(torch.autograd.Function):
    """``x @ w.T`` with a backward dynamo traces."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.T

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor]:
        x, w = ctx.saved_tensors
        return g @ w, g.T @ x


class BreakingLinear(torch.autograd.Function):
    """The same, with a backward that writes a global dict: dynamo cannot put it in a graph."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.T

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor]:
        CALLS["backward"] += 1
        x, w = ctx.saved_tensors
        return g @ w, g.T @ x


class Block(nn.Module):
    """Linear, ReLU, the Function (``FN``), tanh, linear."""

    FN: type[torch.autograd.Function] = TracedLinear

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = (nn.Parameter(torch.randn(D, D) / D**0.5) for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(x @ self.w1.T)
        h = self.FN.apply(h, self.w2)
        out: Tensor = torch.tanh(h) @ self.w3.T
        return out


class BreakingBlock(Block):
    FN = BreakingLinear


BLOCKS = {TracedLinear: Block, BreakingLinear: BreakingBlock}


def _flops(fn: Any) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def _run(
    fn: type[torch.autograd.Function],
) -> tuple[list[tuple[str, bool]], dict[str, int], int, int]:
    """The compiled block's split backward against the eager block's: the nodes the output's node
    sends gradients to (their type, whether customgrad runs them once), read before the backward
    (on torch 2.11 and 2.12 a node's handle does not keep the node alive once the output is
    gone), FLOPs per pass (and the full backward's), the Function's backward calls in I and in
    W."""
    torch.manual_seed(0)
    ref = BLOCKS[fn]()
    block = cg.compile(copy.deepcopy(ref), backend="aot_eager")
    x = torch.randn(B, D, requires_grad=True)
    xr = x.detach().requires_grad_()
    out_ref = ref(xr)
    g = torch.randn_like(out_ref)
    flops = {"full": _flops(lambda: out_ref.backward(g))}
    out = block(x)
    edges = [(type(fn).__name__, runs_once(fn)) for fn, _ in out.grad_fn.next_functions]
    groups: list[Any] = []

    def input_pass() -> None:
        groups.append(cgp.stage_backward_input([out], [g], [x], block.parameters())[1])

    CALLS["backward"] = 0
    flops["I"] = _flops(input_pass)
    in_i = CALLS["backward"]
    flops["W"] = _flops(lambda: cgp.stage_backward_weight(block.parameters(), groups[0]))
    in_w = CALLS["backward"] - in_i
    torch.testing.assert_close(x.grad, xr.grad)
    for p, r in zip(block.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad)
    return edges, flops, in_i, in_w


def test_traceable_function_is_part_of_the_region_and_splits() -> None:
    edges, flops, _, _ = _run(TracedLinear)
    # one region: its edges go to the leaves (x, w1, w2, w3), no Function node in between
    assert edges == [("AccumulateGrad", False)] * 4
    assert flops == {"full": 6 * MM, "I": 3 * MM, "W": 3 * MM}  # w2's gradient in W


def test_function_dynamo_cannot_trace_breaks_the_region_and_runs_once() -> None:
    edges, flops, in_i, in_w = _run(BreakingLinear)
    assert edges[0] == ("BreakingLinearBackward", True)
    assert (in_i, in_w) == (1, 0)
    # the Function's whole backward (dh and dw2) in I; the two regions split around it
    assert flops == {"full": 6 * MM, "I": 4 * MM, "W": 2 * MM}


@pytest.mark.parametrize("fn", [TracedLinear, BreakingLinear], ids=["traced", "graph-break"])
def test_explain_split_of_functions_in_a_region(fn: type[torch.autograd.Function]) -> None:
    torch.manual_seed(0)
    block = cg.compile(BLOCKS[fn](), backend="aot_eager")
    x = torch.randn(B, D, requires_grad=True)
    report = cg.explain_split(block(x), [x], dict(block.named_parameters()))
    assert report.repeated_flops == 0 and report.computes_twice == []
    functions = [n for n in report.nodes if n.kind == "function"]
    if fn is TracedLinear:
        assert functions == []  # inside the region's graph
    else:
        assert [(n.label, n.phases) for n in functions] == [
            ("BreakingLinear (autograd.Function)", frozenset({"input"}))
        ]
        assert report.ran_once == frozenset({"BreakingLinear (autograd.Function)"})
