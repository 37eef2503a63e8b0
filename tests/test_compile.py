"""customgrad.compile: compiled regions split their backward into I and W, nothing twice.

Compiled modules are shared per test module (compiling is slow on CPU): ``aot_eager`` where the
backend does not matter, inductor for the real path. FLOPs are counted around backwards only
(dynamo does not compile a frame that runs under a dispatch mode).
"""

from __future__ import annotations

import copy
import gc
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed.pipelining._backward as torch_split
from torch import Tensor, nn
from torch.distributed.pipelining.schedules import _check_torch_compile_compatibility
from torch.utils.flop_counter import FlopCounterMode

import customgrad as cg
import customgrad.pipelining as cg_split
from customgrad._compile import CompiledRegion, regions
from tests._skips import TORCH_SPLIT
from tests.conftest import linear_op

HOW = pytest.mark.parametrize("how", [pytest.param("torch", marks=TORCH_SPLIT), "customgrad"])

Split = tuple[Callable[..., Any], Callable[..., Any]]
SPLITS: dict[str, Split] = {
    "torch": (torch_split.stage_backward_input, torch_split.stage_backward_weight),
    "customgrad": (cg_split.stage_backward_input, cg_split.stage_backward_weight),
}


class Block(nn.Module):
    """Linear-ReLU-Linear with a residual: input and weight gradients share dpre."""

    def __init__(self, width: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class NormBlock(nn.Module):
    """LayerNorm-Linear-GELU, a graph break in the middle: two compiled pieces."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        torch._dynamo.graph_break()
        return nn.functional.gelu(self.fc(h))


OP = linear_op("test_compile::linear")


class OpBlock(nn.Module):
    """A customgrad op inside a compiled block."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.w2 = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x: Tensor) -> Tensor:
        return OP(torch.tanh(OP(x, self.w1)), self.w2)


def pair(module: nn.Module, **kwargs: Any) -> tuple[nn.Module, nn.Module]:
    """(eager reference, compiled copy), float64; the copy's regions in ``REGIONS``."""
    torch.manual_seed(0)
    ref = module.double()
    m = cg.compile(copy.deepcopy(ref), **kwargs)
    before = {id(r) for r in regions()}
    m(inputs()[0]).sum().backward()  # compiles (also a full backward)
    REGIONS[m] = [r for r in regions() if id(r) not in before]
    zero(m)
    return ref, m


REGIONS: dict[nn.Module, list[CompiledRegion]] = {}


@pytest.fixture(scope="module")
def block() -> tuple[nn.Module, nn.Module]:
    return pair(Block(), backend="aot_eager")


@pytest.fixture(scope="module")
def block_inductor() -> tuple[nn.Module, nn.Module]:
    return pair(Block(), backend="inductor")


def inputs(batch: int = 4, width: int = 8, seed: int = 1) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, width, dtype=torch.float64, generator=g).requires_grad_()
    dy = torch.randn(batch, width, dtype=torch.float64, generator=g)
    return x, dy


def flops(fn: Callable[[], Any]) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def zero(*modules: nn.Module) -> None:
    for m in modules:
        for p in m.parameters():
            p.grad = None


def grads(m: nn.Module) -> list[Tensor | None]:
    return [p.grad for p in m.parameters()]


def assert_same(got: list[Tensor | None], want: list[Tensor | None]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a is not None and b is not None
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def eager_reference(
    ref: nn.Module, x: Tensor, dy: Tensor
) -> tuple[Tensor, list[Tensor | None], int, int]:
    """Eager gradients, FLOPs of the full backward and of the input-gradient-only backward."""
    zero(ref)
    xr = x.detach().clone().requires_grad_()
    out = ref(xr)
    only_input = flops(lambda: torch.autograd.grad(out, [xr], dy, retain_graph=True))
    full = flops(lambda: out.backward(dy))
    assert xr.grad is not None
    return xr.grad, grads(ref), full, only_input


def region_of(m: nn.Module) -> CompiledRegion:
    (region,) = REGIONS[m]
    return region


def split_once(
    module: nn.Module, x: Tensor, dy: Tensor, how: str
) -> tuple[int, int, tuple[Any, ...]]:
    backward_input, backward_weight = SPLITS[how]
    params = list(module.parameters())
    out = module(x)
    result: dict[str, Any] = {}

    def run_i() -> None:
        result["i"] = backward_input([out], [dy], [x], iter(params))

    f_i = flops(run_i)
    _, param_groups = result["i"]
    f_w = flops(lambda: backward_weight(iter(params), param_groups))
    return f_i, f_w, result["i"][0]


def assert_splits_exactly(ref: nn.Module, m: nn.Module, x: Tensor, dy: Tensor, how: str) -> None:
    """Under torch's or customgrad's split (``how``): eager's gradients, I computes the input
    gradients only, and I + W does the full backward's FLOPs."""
    dx_ref, dw_ref, full, only_input = eager_reference(ref, x, dy)
    zero(m)
    xi = x.detach().clone().requires_grad_()
    f_i, f_w, dinputs = split_once(m, xi, dy, how)
    torch.testing.assert_close(dinputs[0], dx_ref, rtol=1e-10, atol=1e-12)
    assert_same(grads(m), dw_ref)
    assert (f_i, f_i + f_w) == (only_input, full)


# --------------------------------------------------------------------------------------------
# 1. In place, schedules accept the stage, bad input


def test_compile_is_in_place_and_torch_zero_bubble_schedules_accept_it(
    block: tuple[nn.Module, nn.Module],
) -> None:
    _, m = block
    assert isinstance(m, Block)  # not an OptimizedModule
    assert m._compiled_call_impl is not None

    class Stage:
        submod = nn.Sequential(m)

    _check_torch_compile_compatibility([Stage()], "ZBVZeroBubble")  # type: ignore[list-item]
    with pytest.raises(RuntimeError, match="not supported with stage modules"):

        class Plain:
            submod = nn.Sequential(torch.compile(Block(), backend="aot_eager"))

        _check_torch_compile_compatibility([Plain()], "ZBVZeroBubble")  # type: ignore[list-item]


def test_compile_a_function() -> None:
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)

    def f(x: Tensor) -> Tensor:
        return torch.relu(x @ w)

    fc = cg.compile(f, backend="aot_eager")
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    fc(x).sum().backward()
    assert w.grad is not None and x.grad is not None
    torch.testing.assert_close(x.grad, torch.autograd.grad(f(x).sum(), x)[0])


# --------------------------------------------------------------------------------------------
# 2. Split under torch's and customgrad's functions


@HOW
def test_split_gradients_and_flops_equal_eager(
    block: tuple[nn.Module, nn.Module], how: str
) -> None:
    ref, m = block
    x, dy = inputs()
    dx_ref, dw_ref, full, only_input = eager_reference(ref, x, dy)
    zero(m)
    f_i, f_w, dinputs = split_once(m, x, dy, how)
    torch.testing.assert_close(dinputs[0], dx_ref, rtol=1e-10, atol=1e-12)
    assert_same(grads(m), dw_ref)
    assert f_i + f_w == full
    assert f_i == only_input  # I computes input gradients only
    region = region_of(m)
    assert region.pending() == 0  # freed after W


@TORCH_SPLIT
def test_split_under_default_config_has_no_donated_buffer_error(
    block: tuple[nn.Module, nn.Module],
) -> None:
    import torch._functorch.config as functorch_config

    assert functorch_config.donated_buffer  # torch's default, left alone
    _, m = block
    x, dy = inputs(seed=2)
    split_once(m, x, dy, "torch")
    assert functorch_config.donated_buffer


@HOW
def test_inductor_region_splits_under_both(
    block_inductor: tuple[nn.Module, nn.Module], how: str
) -> None:
    ref, m = block_inductor
    assert_splits_exactly(ref, m, *inputs(seed=3), how)


@TORCH_SPLIT
def test_handoff_is_no_more_than_eager_split_holds(block: tuple[nn.Module, nn.Module]) -> None:
    ref, m = block
    x, dy = inputs(seed=4)

    def held(module: nn.Module) -> int:
        xi = x.detach().clone().requires_grad_()
        out = module(xi)
        _, groups = torch_split.stage_backward_input([out], [dy], [xi], iter(module.parameters()))
        captured = sum(
            g.untyped_storage().nbytes()
            for group in groups
            for t in group.get("grads") or ()
            for g in t
            if isinstance(g, Tensor)
        )
        extra = sum(r.handoff_bytes * r.pending() for r in regions())
        torch_split.stage_backward_weight(iter(module.parameters()), groups)
        return captured + extra

    zero(ref, m)
    assert held(m) <= held(ref)
    region = region_of(m)
    assert region.handoff  # dpre is kept, computed once
    assert region.handoff_bytes == 4 * 16 * 8  # one (batch, hidden) float64 tensor


@TORCH_SPLIT
def test_views_of_saved_values_are_recomputed_not_kept() -> None:
    # W needs x.t() (a view of a saved value) and tanh(x) (elementwise): both cost no FLOPs.
    w = nn.Parameter(torch.randn(6, 5, dtype=torch.float64))

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = w

        def forward(self, x: Tensor) -> Tensor:
            return torch.tanh(x).reshape(4, 6) @ self.w

    m = cg.compile(M(), backend="aot_eager")
    x, _ = inputs(batch=4, width=6, seed=5)
    before = {id(r) for r in regions()}
    out = m(x)
    dy = torch.randn_like(out)
    _, groups = torch_split.stage_backward_input([out], [dy], [x], iter([m.w]))
    (region,) = [r for r in regions() if id(r) not in before]
    assert region.status == "split" and region.handoff == ()
    torch_split.stage_backward_weight(iter([m.w]), groups)
    torch.testing.assert_close(m.w.grad, torch.tanh(x).reshape(4, 6).T @ dy)


@HOW
def test_customgrad_ops_inside_a_compiled_block_split(how: str) -> None:
    ref, m = pair(OpBlock(), backend="aot_eager")
    assert_splits_exactly(ref, m, *inputs(seed=6), how)


# --------------------------------------------------------------------------------------------
# 3. Full backward, any order


@TORCH_SPLIT
def test_full_backward_in_any_order_with_split_ones(block: tuple[nn.Module, nn.Module]) -> None:
    ref, m = block
    (x1, d1), (x2, d2), (x3, d3) = inputs(seed=7), inputs(seed=8), inputs(seed=9)
    want = [eager_reference(ref, x, d)[:2] for x, d in ((x1, d1), (x2, d2), (x3, d3))]
    zero(m)
    # full first
    m(x1).backward(d1)
    assert_same([x1.grad, *grads(m)], [want[0][0], *want[0][1]])
    # two microbatches of the same values: I1, I2, a full backward between, W2, W1
    zero(m)
    params = list(m.parameters())
    xa, xb = x2.detach().clone().requires_grad_(), x2.detach().clone().requires_grad_()
    oa, ob = m(xa), m(xb)
    _, ga = torch_split.stage_backward_input([oa], [d2], [xa], iter(params))
    _, gb = torch_split.stage_backward_input([ob], [d2], [xb], iter(params))
    region = region_of(m)
    assert region.pending() == 2
    m(x3).backward(d3)
    torch_split.stage_backward_weight(iter(params), gb)
    torch_split.stage_backward_weight(iter(params), ga)
    assert region.pending() == 0
    expected = [2 * a + b for a, b in zip(want[1][1], want[2][1])]  # type: ignore[operator]
    assert_same(grads(m), expected)  # type: ignore[arg-type]
    torch.testing.assert_close(xb.grad, want[1][0], rtol=1e-10, atol=1e-12)


@TORCH_SPLIT
def test_input_pass_alone_then_graph_freed_keeps_nothing(
    block: tuple[nn.Module, nn.Module],
) -> None:
    _, m = block
    x, dy = inputs(seed=10)
    out = m(x)
    _, groups = torch_split.stage_backward_input([out], [dy], [x], iter(m.parameters()))
    region = region_of(m)
    assert region.pending() == 1
    del out, groups
    gc.collect()
    assert region.pending() == 0


# --------------------------------------------------------------------------------------------
# 5. Fallbacks, graph breaks, dynamic shapes, caches


@TORCH_SPLIT
def test_no_split_runs_the_full_backward_in_each_pass(block: tuple[nn.Module, nn.Module]) -> None:
    ref, m = block
    x, dy = inputs(seed=11)
    dx_ref, dw_ref, full, _ = eager_reference(ref, x, dy)
    zero(m)
    with cg.no_split():
        f_i, f_w, dinputs = split_once(m, x, dy, "torch")
    assert (f_i, f_w) == (full, full)  # like a plain Function: whole backward each pass
    torch.testing.assert_close(dinputs[0], dx_ref)
    assert_same(grads(m), dw_ref)


# dynamo reads .grad of the resumed piece's non-leaf input while tracing (its own warning)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@HOW
def test_graph_breaks_each_piece_splits(how: str) -> None:
    ref, m = pair(NormBlock(), backend="aot_eager")
    x, dy = inputs(seed=12)
    dx_ref, dw_ref, full, only_input = eager_reference(ref, x, dy)
    zero(ref)
    eager_i, eager_w, _ = split_once(ref, x.detach().clone().requires_grad_(), dy, how)
    zero(m)
    xi = x.detach().clone().requires_grad_()
    f_i, f_w, dinputs = split_once(m, xi, dy, how)
    torch.testing.assert_close(dinputs[0], dx_ref, rtol=1e-10, atol=1e-12)
    assert_same(grads(m), dw_ref)
    assert f_i == only_input
    assert f_i + f_w == full  # each piece runs its own W: nothing computed twice
    assert f_i + f_w <= eager_i + eager_w
    pieces = [r for r in regions() if r.name.startswith("NormBlock")]  # made by the first run
    assert len(pieces) == 2 and all(r.status == "split" for r in pieces), pieces


@TORCH_SPLIT
def test_dynamic_shapes_and_recompiles_split() -> None:
    ref, m = pair(Block(), backend="aot_eager", dynamic=True)
    for batch in (3, 5, 7):
        x, dy = inputs(batch=batch, seed=batch)
        dx_ref, dw_ref, full, only_input = eager_reference(ref, x, dy)
        zero(m)
        f_i, f_w, dinputs = split_once(m, x, dy, "torch")
        torch.testing.assert_close(dinputs[0], dx_ref, rtol=1e-10, atol=1e-12)
        assert_same(grads(m), dw_ref)
        assert (f_i, f_i + f_w) == (only_input, full)


@TORCH_SPLIT
def test_aot_autograd_cache_never_mixes_split_and_plain_backwards() -> None:
    torch.manual_seed(0)
    plain_before = torch.compile(Block().double(), backend="inductor")
    x, dy = inputs(seed=13)
    plain_before(x).backward(dy)
    ref, m = pair(Block(), backend="inductor")
    _, dw_ref, full, only_input = eager_reference(ref, x, dy)
    zero(m)
    f_i, f_w, _ = split_once(m, x.detach().clone().requires_grad_(), dy, "torch")
    assert (f_i, f_i + f_w) == (only_input, full)  # not the cached unsplit backward
    assert_same(grads(m), dw_ref)
    runs = [dict(r.runs) for r in regions()]
    plain_after = torch.compile(copy.deepcopy(ref), backend="inductor")
    plain_after(x).backward(dy)
    assert [dict(r.runs) for r in regions()] == runs  # plain torch.compile never runs ours


@TORCH_SPLIT
def test_tensor_subclass_input_falls_back_with_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from torch.testing._internal.two_tensor import TwoTensor

    lin = cg.compile(nn.Linear(4, 4).double(), backend="aot_eager")
    a = torch.randn(2, 4, dtype=torch.float64)
    x = TwoTensor(a, a.clone()).requires_grad_()
    with caplog.at_level(logging.WARNING, logger="customgrad"):
        for _ in range(2):
            out = lin(x)
            _, groups = torch_split.stage_backward_input(
                [out], [torch.ones_like(out)], [x], iter(lin.parameters())
            )
            torch_split.stage_backward_weight(iter(lin.parameters()), groups)
    lines = [r for r in caplog.records if "runs its full backward" in r.getMessage()]
    assert len(lines) == 1
    assert "tensor-subclass input" in lines[0].getMessage()
    assert lin.weight.grad is not None


def test_regions_are_forgotten_with_their_module() -> None:
    m = cg.compile(nn.Linear(3, 3), backend="aot_eager")
    m(torch.randn(2, 3, requires_grad=True)).sum().backward()
    n = len(regions())
    del m
    torch._dynamo.reset()
    gc.collect()
    assert len(regions()) < n


@pytest.fixture(autouse=True)
def _no_leftover_handoffs() -> Iterator[None]:
    yield
    gc.collect()
    assert all(r.pending() == 0 for r in regions())


# --------------------------------------------------------------------------------------------
# 7. explain_split


@TORCH_SPLIT
def test_explain_split_reports_a_split_compiled_region(block: tuple[nn.Module, nn.Module]) -> None:
    from customgrad.graph import explain_split

    _, m = block
    x, _ = inputs(seed=14)
    report = explain_split(m(x), [x], list(m.parameters()), splitter="torch")
    (node,) = [n for n in report.nodes if n.kind == "compiled"]
    assert node.label == "Block (graph 0)" or node.label.startswith("Block (graph ")
    assert node.runs_in == "I+W" and not node.computes_twice
    assert node.flops["input"] + node.flops["weight"] == node.flops["full"] > 0
    assert node.compiled is not None and node.compiled.startswith("split: I runs a graph of")
    assert "for x; W runs a graph of" in node.compiled  # named after forward's argument
    assert "fc1.weight, fc1.bias, fc2.weight, fc2.bias" in node.compiled
    assert "I keeps 1 value for W (512 bytes per microbatch): 1 from " in node.compiled
    text = str(report)
    assert "Nothing computes twice." in text
    assert "make it a customgrad op" not in text
    assert f"Compiled regions (customgrad.compile):\n  - {node.label}: split:" in text


def test_explain_split_reports_a_fallen_back_region() -> None:
    from torch.testing._internal.two_tensor import TwoTensor

    from customgrad.graph import explain_split

    lin = cg.compile(nn.Linear(4, 4).double(), backend="aot_eager")
    a = torch.randn(2, 4, dtype=torch.float64)
    x = TwoTensor(a, a.clone()).requires_grad_()
    report = explain_split(lin(x), [x], list(lin.parameters()), splitter="torch")
    (node,) = [n for n in report.nodes if n.kind == "compiled"]
    assert node.computes_twice
    assert node.compiled is not None
    assert node.compiled.startswith(
        "fell back to its full backward in each pass: a tensor-subclass"
    )
    assert "runs its full backward in each pass" in node.advice()


# --------------------------------------------------------------------------------------------
# 9. The docs' code runs


@pytest.mark.parametrize(  # both pages run torch's own split over compiled regions
    "page",
    [
        pytest.param("models/torch-compile.md", marks=TORCH_SPLIT),
        pytest.param("pipelines/compiled-stages.md", marks=TORCH_SPLIT),
    ],
)
def test_compile_docs_code_runs(page: str) -> None:
    from tests.test_docs import _run_page

    _run_page(page)


def test_importing_customgrad_does_not_import_dynamo() -> None:
    import subprocess
    import sys

    code = (
        "import sys, customgrad; "
        "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', "
        "'torch._inductor', 'customgrad.pipelining'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_cuda_graphs_and_compiled_autograd_fall_back(caplog: pytest.LogCaptureFixture) -> None:
    """mode="reduce-overhead" (inductor's cudagraphs flag) and a backward run outside the
    autograd engine (compiled autograd traces it whole) take the full graph, logged once."""
    from torch._inductor.utils import BoxedBool

    from customgrad._compiled_backward import SplitCompiler

    def backward_graph() -> tuple[torch.fx.GraphModule, list[Tensor]]:
        def bw(x: Tensor, w: Tensor, g: Tensor) -> tuple[Tensor, Tensor, None]:
            return g @ w, g.T @ x, None  # gradients of the input, the weight, a non-tensor

        ex = [torch.randn(3, 4), torch.randn(5, 4), torch.randn(3, 5)]
        return torch.fx.symbolic_trace(bw), ex

    def nop(gm: torch.fx.GraphModule, ex: Any, **kw: Any) -> Any:
        return gm

    gm, ex = backward_graph()
    with caplog.at_level(logging.WARNING, logger="customgrad"):
        region = CompiledRegion(name="cudagraphs region")
        fn = SplitCompiler(region, [False, True, None], nop, None)(
            gm, ex, cudagraphs=BoxedBool(True)
        )
        fn(list(ex))
        fn(list(ex))
        assert (region.status, region.runs["full"]) == ("fallback", 2)
        assert region.reason == 'CUDA graphs (mode="reduce-overhead") replay one recorded backward'

        region = CompiledRegion(name="outside the engine")
        fn = SplitCompiler(region, [False, True, None], nop, None)(*backward_graph())
        assert region.status == "split"
        dx, dw, _ = fn(list(ex))  # no autograd node is running
        torch.testing.assert_close(dx, ex[2] @ ex[1])
        torch.testing.assert_close(dw, ex[2].T @ ex[0])
        assert region.status == "fallback" and region.reason is not None
        assert region.reason.startswith("no autograd node is running its backward")
    lines = [r.getMessage() for r in caplog.records if "runs its full backward" in r.getMessage()]
    assert lines == [
        "customgrad.compile: compiled region cudagraphs region runs its full backward in each "
        'pass (no input/weight split): CUDA graphs (mode="reduce-overhead") replay one '
        "recorded backward",
        "customgrad.compile: compiled region outside the engine runs its full backward in each "
        "pass (no input/weight split): no autograd node is running its backward (compiled "
        "autograd traces it whole)",
    ]


def test_summary_lists_compiled_regions(block: tuple[nn.Module, nn.Module]) -> None:
    _, m = block
    rows = {r.region: r for r in cg.summary().compiled_regions}
    for region in REGIONS[m]:
        row = rows[region.name]
        assert row.split == "split"
        assert row.detail.startswith("I computes ")
        assert f"I keeps {len(region.handoff)} value(s) for W" in row.detail
    assert "compiled region" in str(cg.summary())
    assert cg.summary("test_compile").compiled_regions == ()


def test_a_handoff_is_never_read_by_a_pass_of_other_output_gradients(
    block: tuple[nn.Module, nn.Module],
) -> None:
    # an input-only pass with one set of output gradients, then a weight-only pass of another
    # loss through the same graph: W must not read the first pass's hand-off
    ref, m = block
    x, _ = inputs(seed=5)
    out = m(x)
    g1, g2 = torch.randn_like(out), torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, [x], g1, retain_graph=True)
    dw = torch.autograd.grad(out, list(m.parameters()), g2)
    x_ref = x.detach().requires_grad_()
    out_ref = ref(x_ref)
    torch.testing.assert_close(dx, torch.autograd.grad(out_ref, [x_ref], g1, retain_graph=True)[0])
    for got, want in zip(dw, torch.autograd.grad(out_ref, list(ref.parameters()), g2)):
        torch.testing.assert_close(got, want)
    assert all(r.pending() == 0 for r in REGIONS[m])
