"""customgrad.explain_split on transformer stages: rows by module, compiled regions' kept values
named by module and source line, attention FLOPs counted, uncountable ops named."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import customgrad
from customgrad._flops import FlopCounter, count_flops, may_hide_flops
from tests.conftest import linear_op


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.attn = Attention(dim, heads=2)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.fc2(F.gelu(self.fc1(x)))


def _line(fn: Any, text: str) -> str:
    """``test_explain.py:N`` of the line of ``fn`` holding ``text``."""
    lines, start = inspect.getsourcelines(fn)
    (offset,) = [i for i, line in enumerate(lines) if text in line]
    return f"test_explain.py:{start + offset}"


# Per block, x of shape (2, 4, 8), 2 heads of 4: FLOPs of the backward's matmuls.
QKV, OUT_PROJ, FC1, FC2 = (
    2 * 2 * 8 * 8 * 24,
    2 * 2 * 8 * 8 * 8,
    2 * 2 * 8 * 8 * 16,
    2 * 2 * 8 * 16 * 8,
)
SDPA_BACKWARD = 5 * 2 * (2 * 2) * 4 * 4 * 4  # 5 batched matmuls of (4 x 4) by (4 x 4), 4 heads


def test_top_level_name() -> None:
    assert customgrad.explain_split is customgrad.graph.explain_split
    assert "explain_split" in customgrad.__all__


def test_eager_stage_rows_by_module_and_node_level() -> None:
    torch.manual_seed(0)
    stage = nn.Sequential(Block(8), Block(8))
    x = torch.randn(2, 4, 8, requires_grad=True)
    report = customgrad.explain_split(stage(x), [x], stage.named_parameters())
    modules = {m.module: m for m in report.modules}
    assert list(modules) == [
        "", "0", "0.norm", "0.attn", "0.attn.qkv", "0.attn.o", "0.fc1", "0.fc2",
        "1", "1.norm", "1.attn", "1.attn.qkv", "1.attn.o", "1.fc1", "1.fc2",
    ]  # fmt: skip
    for b in "01":
        assert modules[f"{b}.attn.qkv"].flops == {
            "full": QKV,
            "input": QKV // 2,
            "weight": QKV // 2,
        }
        assert modules[f"{b}.attn.o"].flops == {
            "full": OUT_PROJ,
            "input": OUT_PROJ // 2,
            "weight": OUT_PROJ // 2,
        }
        assert modules[f"{b}.fc1"].flops == {"full": FC1, "input": FC1 // 2, "weight": FC1 // 2}
        assert modules[f"{b}.fc2"].flops == {"full": FC2, "input": FC2 // 2, "weight": FC2 // 2}
        # The attention between qkv and o belongs to attn; its backward runs in I only.
        assert modules[f"{b}.attn"].flops == {"full": SDPA_BACKWARD, "input": SDPA_BACKWARD,
                                              "weight": 0}  # fmt: skip
        assert modules[f"{b}.attn"].runs_in == f"{len(modules[f'{b}.attn'].nodes)} I"
    per_block = QKV + OUT_PROJ + FC1 + FC2 + SDPA_BACKWARD
    assert report.flops["full"] == 2 * per_block
    text = str(report)
    assert "15 modules; rows by module, table('node') for each node" in text
    assert len(text.splitlines()) == 1 + 1 + 15 + 2
    node_table = report.table("node")
    assert f"{len(report.nodes)} autograd nodes, one row per node" in node_table
    assert len(node_table.splitlines()) == 1 + 1 + len(report.nodes) + 2
    assert all(n.module == "1.fc2" for n in report.nodes if n.label in ("1.fc2.weight",))
    with pytest.raises(ValueError, match="by must be 'module' or 'node', got 'nodes'"):
        report.table("nodes")  # type: ignore[arg-type]


class OpLinear(nn.Module):
    """A linear layer through a customgrad op (the pair: I computes dx, W computes dW)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        return _op_linear(x, self.weight)


_op_linear = linear_op("test_explain::linear")


def test_customgrad_ops_weight_pass_flops_are_on_their_modules_row() -> None:
    # customgrad's split runs an op's weight half outside the engine in W: its FLOPs count to
    # the op's node and module, so the module reads full = I + W and no row is left unnamed.
    torch.manual_seed(0)
    stage = nn.Sequential(OpLinear(8), nn.Tanh(), OpLinear(8))
    x = torch.randn(16, 8, requires_grad=True)
    report = customgrad.explain_split(stage(x), [x], stage.named_parameters())
    half = 2 * 16 * 8 * 8  # one matmul of the backward: dx, or dW
    modules = {m.module: m for m in report.modules}
    assert modules["0"].flops == {"full": 2 * half, "input": half, "weight": half}
    assert modules["2"].flops == {"full": 2 * half, "input": half, "weight": half}
    assert report.flops == {"full": 4 * half, "input": 2 * half, "weight": 2 * half}
    assert report.outside_flops == {"full": 0, "input": 0, "weight": 0}
    assert report.repeated_flops == 0
    assert "(outside nodes)" not in str(report)


def test_unnamed_weights_list_nodes() -> None:
    block = Block(8)
    x = torch.randn(2, 4, 8, requires_grad=True)
    report = customgrad.explain_split(block(x), [x], list(block.parameters()))
    assert str(report) == report.table("node")
    assert "one row per node" in str(report)


def test_compiled_region_names_kept_values_by_module_and_line() -> None:
    torch.manual_seed(0)
    block = customgrad.compile(Block(8), backend="aot_eager")
    x = torch.randn(2, 4, 8, requires_grad=True)
    report = customgrad.explain_split(block(x), [x], block.named_parameters())
    (node,) = [n for n in report.nodes if n.kind == "compiled"]
    assert node.flops == {
        "full": QKV + OUT_PROJ + FC1 + FC2 + SDPA_BACKWARD,
        "input": (QKV + OUT_PROJ + FC1 + FC2) // 2 + SDPA_BACKWARD,
        "weight": (QKV + OUT_PROJ + FC1 + FC2) // 2,
    }
    where = {(o.module, o.module_type, o.source, o.shape, o.dtype) for o in node.kept}
    assert where == {
        ("fc1", "Linear", _line(Block.forward, "self.fc1(x)"), (8, 16), "float32"),
        ("attn.o", "Linear", _line(Attention.forward, "self.o("), (8, 8), "float32"),
        ("attn.qkv", "Linear", _line(Attention.forward, "self.qkv(x)"), (8, 24), "float32"),
        ("attn.qkv", "Linear", _line(Attention.forward, "self.qkv(x)"), (2, 4, 8), "float32"),
    }
    assert all(o.code for o in node.kept)
    assert node.compiled is not None
    assert (
        "I keeps 4 values for W (1792 bytes per microbatch): 1 from fc1 (Linear), "
        "1 from attn.o (Linear), 2 from attn.qkv (Linear)"
    ) in node.compiled
    assert "; W recomputes 1 value (1 from fc2 (Linear); no FLOPs)" in node.compiled
    text = str(report)
    qkv = _line(Attention.forward, "self.qkv(x)")
    assert (
        "    I keeps for W (where the forward made each value):\n"
        "      fc1 (Linear): 1 value, 512 bytes\n"
        f"        {_line(Block.forward, 'self.fc1(x)')}: "
        "return x + self.fc2(F.gelu(self.fc1(x)))\n"
        "      attn.o (Linear): 1 value, 256 bytes\n"
        f"        {_line(Attention.forward, 'self.o(')}: "
        "return self.o(y.transpose(1, 2).reshape(b, t, d))\n"
        "      attn.qkv (Linear): 2 values, 1024 bytes\n"
        f"        {qkv}: q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1,…"
    ) in text  # source lines shortened to 72 characters
    assert "view_" not in text  # FX names only at the node level
    node_text = report.table("node")
    assert f"(8, 24) float32, 768 bytes from attn.qkv (Linear) at {qkv}: q, k, v" in node_text


@pytest.mark.parametrize("gqa", [False, True])
def test_cpu_flash_attention_backward_flops_match_the_math_path(gqa: bool) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, 16, generator=g, requires_grad=True)
    kv_heads = 2 if gqa else 4
    k = torch.randn(2, kv_heads, 8, 16, generator=g, requires_grad=True)
    v = torch.randn(2, kv_heads, 8, 16, generator=g, requires_grad=True)
    qk = 2 * (2 * 4) * 8 * 8 * 16  # q @ k^T over all query heads

    def run(fn: Any) -> tuple[FlopCounter, FlopCounter]:
        with FlopCounter(record=True) as forward:
            out = fn(q, k, v, is_causal=True, enable_gqa=gqa)
            out = out[0] if isinstance(out, tuple) else out
        with FlopCounter(record=True) as backward:
            out.sum().backward()
        return forward, backward

    flash_f, flash_b = run(F.scaled_dot_product_attention)
    assert flash_f.calls is not None and flash_b.calls is not None
    assert [c[0].__name__ for c in flash_b.calls] == [
        "_scaled_dot_product_flash_attention_for_cpu_backward.default"
    ]
    math_f, math_b = run(torch.ops.aten._scaled_dot_product_attention_math)
    assert flash_f.total == math_f.total == 2 * qk
    # The math path's backward differentiates two matmuls (4 matmuls); flash recomputes q @ k^T.
    assert math_b.total == 4 * qk
    assert flash_b.total == math_b.total + qk == 5 * qk  # 2.5x the forward, as torch counts
    assert not flash_b.uncounted


def test_grouped_mm_flops() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 16, generator=g)
    b = torch.randn(2, 16, 8, generator=g)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    out, flops = count_flops(torch._grouped_mm, a, b, offs)
    assert flops == 2 * 3 * 16 * 8 + 2 * 5 * 16 * 8
    torch.testing.assert_close(out, torch.cat([a[:3] @ b[0], a[3:] @ b[1]]))
    a2 = torch.randn(8, 16, generator=g)  # groups split the reduced dimension: (8, 16) x (16, 8)
    b2 = torch.randn(16, 8, generator=g)
    offs2 = torch.tensor([4, 16], dtype=torch.int32)
    _, flops = count_flops(torch._grouped_mm, a2.mT.contiguous().mT, b2, offs2)
    assert flops == 2 * 8 * 16 * 8


@torch.library.custom_op("test_explain::opaque_mm", mutates_args=())
def opaque_mm(x: Tensor, w: Tensor) -> Tensor:
    return x @ w.mT


@opaque_mm.register_fake
def _(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))


class OpaqueLinear(torch.autograd.Function):
    """A backward through an opaque kernel: its FLOPs are invisible to the formulas."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.mT

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor]:
        x, w = ctx.saved_tensors
        return opaque_mm(g, w.mT), g.mT @ x


def test_report_names_ops_it_could_not_count() -> None:
    assert may_hide_flops(torch.ops.test_explain.opaque_mm.default)
    assert may_hide_flops(torch.ops.aten._weight_int8pack_mm.default)
    assert not may_hide_flops(torch.ops.aten.mm.default)  # has a formula
    assert not may_hide_flops(torch.ops.aten.relu.default)  # no FLOPs to hide
    assert not may_hide_flops(torch.ops._c10d_functional.all_reduce.default)
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(5, 3, requires_grad=True)
    report = customgrad.explain_split(OpaqueLinear.apply(x, w), [x], [w], splitter="torch")
    assert report.flops["full"] == 2 * 4 * 5 * 3  # only g.mT @ x
    assert report.uncounted["full"] == {"test_explain::opaque_mm": 1}
    assert (
        "Not counted (no FLOP formula; their FLOPs are missing above): "
        "test_explain::opaque_mm (3 calls)."
    ) in str(report)


@pytest.mark.parametrize("layer", ["native", "customgrad"])
def test_nodes_w_calls_itself_count_to_their_rows(layer: str) -> None:
    # A layer sharing its weight with a layer before it: W calls it itself for its weight side
    # (outside the engine, where no hook fires); it still shows I+W, its W FLOPs on its row.
    from tests.test_split_parity import DT, MM, WIDTH, Layers

    if layer == "native":
        model = Layers([("native", 0), ("relu", 0), ("native", 0)])
    else:  # a customgrad op whose "weight" argument is the activation (it cannot defer)
        model = Layers([("pair", 0), ("relu", 0), ("swapped", 0)])
    x = torch.randn(6, WIDTH, dtype=DT, requires_grad=True)
    report = customgrad.explain_split(model(x), [x], dict(model.named_parameters()))
    assert report.outside_flops == {"full": 0, "input": 0, "weight": 0}
    top = next(n for n in report.nodes if n.flops["full"])
    assert top.phases == frozenset({"input", "weight"})
    assert (top.flops["input"], top.flops["weight"]) == (MM, MM)
    assert report.repeated_flops == 0
