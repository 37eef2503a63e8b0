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
import functools
import logging
import re
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

import customgrad as cg
import customgrad.pipelining as cgp
from customgrad._split_plan import runs_once
from customgrad.pipelining import _backward

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


class CastMatmul(torch.autograd.Function):
    """``x @ w``, whose forward breaks dynamo's graph: it runs eagerly, after the region that
    casts its weight (torchtitan's grouped experts: ``w.bfloat16().transpose(-2, -1)``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        torch._dynamo.graph_break()
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor]:
        x, w = ctx.saved_tensors
        return g @ w.T, x.T @ g


class CastBlock(nn.Module):
    """``tanh(x @ v)``, then :class:`CastMatmul` on float32 weights cast (and transposed: a view
    the region makes again outside it) inside the region, before the Function's graph break;
    ``two``: two Functions, both weights cast before the first one (into one region)."""

    def __init__(self, two: bool = False) -> None:
        super().__init__()
        self.two = two
        self.v = nn.Parameter(torch.randn(D, D, dtype=torch.float64) / D**0.5)
        self.w, self.u = (nn.Parameter(torch.randn(D, D) / D**0.5) for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(x @ self.v)
        w = self.w.double().transpose(0, 1)
        u = self.u.double()
        y = CastMatmul.apply(h, w)
        if self.two:
            y = y + CastMatmul.apply(torch.sin(h), u)
        out: Tensor = torch.sin(y)
        return out


class SharedCastBlock(CastBlock):
    """:class:`CastBlock` whose cast weight also meets the activation inside the region."""

    def forward(self, x: Tensor) -> Tensor:
        w = self.w.double()
        h = torch.tanh(x @ self.v) + x @ w
        out: Tensor = torch.sin(CastMatmul.apply(h, w.T))
        return out


CAST_BLOCKS = {"one": CastBlock(), "two": CastBlock(two=True), "shared": SharedCastBlock()}
COMPILED_CAST = {k: cg.compile(block, backend="aot_eager") for k, block in CAST_BLOCKS.items()}


def _cast_split(block: nn.Module, **split: bool) -> tuple[dict[str, int], dict[str, int]]:
    """FLOPs of the unsplit backward and of the split's I and W (the region's backward compiled
    in a first backward); the split's gradients equal the unsplit one's, exactly."""
    torch.manual_seed(0)
    x = torch.randn(B, D, dtype=torch.float64, requires_grad=True)
    g = torch.randn(B, D, dtype=torch.float64)
    block(x).backward(g)  # (the region's backward compiles in its first run)
    for t in [x, *block.parameters()]:
        t.grad = None
    out = block(x)
    full = {"full": _flops(lambda: out.backward(g))}
    want = [t.grad for t in [x, *block.parameters()]]
    for t in [x, *block.parameters()]:
        t.grad = None
    out = block(x)
    groups: list[Any] = []

    def input_pass() -> None:
        groups.append(cgp.stage_backward_input([out], [g], [x], block.parameters(), **split)[1])

    flops = {"I": _flops(input_pass)}
    flops["W"] = _flops(lambda: cgp.stage_backward_weight(block.parameters(), groups[0]))
    for t, expected in zip([x, *block.parameters()], want, strict=True):
        assert (t.grad is None) == (expected is None)  # (an op block leaves u unused)
        assert t.grad is None or torch.equal(t.grad, expected)
    return full, flops


@pytest.mark.parametrize(
    "block", ["one", "two", "shared"], ids=["one", "two-into-one-region", "cast-also-in-region"]
)
def test_function_on_a_weight_cast_in_the_region_splits_its_dw_into_w(block: str) -> None:
    # I: dx, dh (and the second Function's dh, or x @ w's dx); W: dv, dw (and du, or x @ w's
    # dw): the region's weight part gets the Functions' weight gradients in W
    n = 2 if block == "one" else 3
    full, flops = _cast_split(COMPILED_CAST[block])
    assert full == {"full": (2 * n) * MM}
    assert flops == {"I": n * MM, "W": n * MM}


def test_function_on_a_weight_cast_run_as_written_hands_the_region_its_gradient() -> None:
    # split_functions=False: the Function runs whole in I (its dw too, logged as run once); the
    # region's weight part still runs in W, from the gradient the Function sent it in I
    _, flops = _cast_split(COMPILED_CAST["one"], split_functions=False)
    assert flops == {"I": 3 * MM, "W": MM}


def test_function_on_a_weight_cast_left_in_i_says_why(caplog: pytest.LogCaptureFixture) -> None:
    # run_functions_once=False: the split is not planned (W would run the Function again);
    # its dw stays in I, with the reason logged once
    _backward._TOLD_REGIONS.clear()
    with caplog.at_level(logging.INFO, logger="customgrad"):
        _, flops = _cast_split(COMPILED_CAST["one"], run_functions_once=False)
        _cast_split(COMPILED_CAST["one"], run_functions_once=False)
    assert flops == {"I": 3 * MM, "W": MM}
    lines = [r.getMessage() for r in caplog.records if "compiled region" in r.getMessage()]
    expected = (
        re.escape(
            f"customgrad.pipelining: {__name__}.CastMatmul (a plain autograd.Function) runs its "
            "weight work in the input pass: the gradient it returns for its argument 'w' goes "
            "into the compiled region "
        )
        + r"CastBlock \(graph \d+\)"
        + re.escape(
            ", whose backward sends it only to the weights (w) but which the input pass runs "
            "for its activation gradients, and with run_functions_once=False the stage does not "
            "split it (the default does). Cast or transpose the weight inside its forward (its "
            "backward then returns the weight's own gradient), or outside the compiled region "
            "(before the compiled module, or under torch.compiler.disable)."
        )
    )
    assert len(lines) == 1 and re.fullmatch(expected, lines[0]), lines


class Matmul(torch.autograd.Function):
    """``x @ w``, for a customgrad op (:data:`MATMUL`)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor]:
        x, w = ctx.saved_tensors
        return g @ w.T, x.T @ g


MATMUL = cg.from_function(
    Matmul, "test_compiled_functions::matmul", weights=("w",),
    schema="(Tensor x, Tensor w) -> Tensor",
)  # fmt: skip


@torch.compiler.disable
def _eager_matmul(x: Tensor, w: Tensor) -> Tensor:
    out: Tensor = MATMUL(x, w)
    return out


class OpCastBlock(CastBlock):
    """:class:`CastBlock` with the customgrad op, called outside the region (a graph break)."""

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(x @ self.v)
        out: Tensor = torch.sin(_eager_matmul(h, self.w.double().transpose(0, 1)))
        return out


def test_customgrad_op_on_a_weight_cast_in_the_region_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # the op's weight edge leads into the region, which I runs: it cannot defer its weight
    # half (dw in I), and the stage says so, once
    torch.manual_seed(0)
    block = cg.compile(OpCastBlock(), backend="aot_eager")
    _backward._TOLD_REGIONS.clear()
    with caplog.at_level(logging.INFO, logger="customgrad"):
        _, flops = _cast_split(block)
        _cast_split(block)
    assert flops == {"I": 3 * MM, "W": MM}
    lines = [r.getMessage() for r in caplog.records if "compiled region" in r.getMessage()]
    expected = (
        re.escape(
            "customgrad.pipelining: customgrad op test_compiled_functions::matmul runs its "
            "weight work in the input pass: the gradient it returns for its argument 'w' goes "
            "into the compiled region "
        )
        + r"OpCastBlock \(graph \d+\)"
        + re.escape(
            ", whose backward sends it only to the weights (w) but which the input pass runs "
            "for its activation gradients, and a customgrad op defers only gradients that go "
            "straight to the weight side. Cast or transpose the weight inside the op"
        )
    )
    assert len(lines) == 1 and re.match(expected, lines[0]), lines


def test_customgrad_op_on_a_weight_cast_under_the_queue_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # the weight-gradient queue keeps the region's weight work in I, so the op's too: said once
    torch.manual_seed(0)
    block = cg.compile(OpCastBlock(), backend="aot_eager")
    x = torch.randn(B, D, dtype=torch.float64, requires_grad=True)
    block(x).sum().backward()  # (the region's backward compiles in its first run)
    want = [t.grad for t in [x, block.v, block.w]]
    for t in [x, block.v, block.w]:
        t.grad = None
    _backward._TOLD_REGIONS.clear()
    queue = cgp.WeightGradQueue()
    with caplog.at_level(logging.INFO, logger="customgrad"):
        with queue.microbatch(0, 0):
            out = block(x)
        queue.backward(out.sum(), None, inputs=[x])
    queue.finish()
    for t, expected in zip([x, block.v, block.w], want, strict=True):
        assert t.grad is not None and expected is not None and torch.equal(t.grad, expected)
    lines = [r.getMessage() for r in caplog.records if "compiled region" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(
        "customgrad.pipelining: customgrad op test_compiled_functions::matmul runs its weight "
        "work in the input pass: the gradient it returns for its argument 'w' goes into the "
        "compiled region OpCastBlock"
    ), lines


def test_the_first_backward_through_a_region_says_what_it_left_in_i(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # the region's backward compiles in its first run: that first split cannot see where the
    # Function's weight gradient goes (its dw in I, said once); the second splits it
    class FirstCastBlock(CastBlock):
        """:class:`CastBlock`, compiled here for the first time."""

    torch.manual_seed(0)
    block = cg.compile(FirstCastBlock(), backend="aot_eager")
    x = torch.randn(B, D, dtype=torch.float64, requires_grad=True)
    flops = []
    with caplog.at_level(logging.INFO, logger="customgrad"):
        for _ in range(2):
            out = block(x)
            groups = cgp.stage_backward_input([out.sum()], None, [x], block.parameters())[1]
            w_pass = functools.partial(cgp.stage_backward_weight, block.parameters(), groups)
            flops.append(_flops(w_pass))
    assert flops == [MM, 2 * MM]  # W: dv first; then dv and dw
    lines = [r.getMessage() for r in caplog.records if "compiled region" in r.getMessage()]
    expected = (
        re.escape(
            f"customgrad.pipelining: {__name__}.CastMatmul (a plain autograd.Function) ran its "
            "weight work in the input pass of the first backward through the compiled region "
        )
        + r".*FirstCastBlock \(graph \d+\)"
        + re.escape(
            ": the gradient it returns for its argument 'w' goes into the region, whose backward "
            "(compiled in that first run) sends it only to the weights (w). Later backwards "
            "through the region split it: its weight work goes to the weight pass with the "
            "region's."
        )
    )
    assert len(lines) == 1 and re.fullmatch(expected, lines[0]), lines
