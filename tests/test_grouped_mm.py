"""``customgrad.ops.grouped_mm``: a mixture-of-experts grouped GEMM as a customgrad op, split
exactly, with torch's kernels (``torch._grouped_mm``, a loop over the experts where it does not
take the operands) and Triton's (``triton_grouped_mm``; on CPU through Triton's interpreter).

Checked against torch autograd of a loop over the experts (:func:`tests._torchtitan.reference_grouped_mm`)
in float32 and bfloat16, for routings with empty experts, all tokens on one expert, rows past the
last expert and no tokens at all; ``check_op``; the split under ``stage_backward_input`` /
``stage_backward_weight`` (I: the dX GEMMs' FLOPs, W: the dW GEMMs', kernel launches per pass for
Triton) for several routings; ``torch.compile`` keeping one graph across routings; torchtitan's
``GroupedExperts`` with the op through its ``_grouped_mm`` seam.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

import customgrad as cg
import customgrad.ops as ops
from customgrad._compile import regions
from customgrad._flops import FlopCounter
from customgrad._torch import grouped_mm as torch_grouped
from customgrad.ops import _triton_grouped_mm as triton_kernels
from customgrad.pipelining import stage_backward_input, stage_backward_weight
from customgrad.testing import check_op
from tests._skips import optional_package
from tests._torchtitan import reference_grouped_mm
from tests._triton_support import count_launches

TRITON_CPU = pytest.mark.skipif(
    not triton_kernels.INTERPRETED,
    reason=optional_package("triton", "make install pins one")
    if not triton_kernels.HAS_TRITON
    else "TRITON_INTERPRET=0: the Triton kernels are compiled for CUDA, not run on CPU",
)

OPS = [
    pytest.param(ops.grouped_mm, id="torch"),
    pytest.param(ops.triton_grouped_mm, id="triton", marks=TRITON_CPU),
]

M, K, N = 12, 16, 8
ROUTINGS = {
    "spread": [3, 3, 7, 12],  # expert 1 empty
    "first-and-last-empty": [0, 5, 12, 12],
    "one-expert": [0, 0, 12, 12],
    "rows-past-the-last": [2, 4, 6, 9],  # rows 9-11 go to no expert: zero, zero gradient
}

TOLERANCES = {
    torch.float64: {"atol": 1e-12, "rtol": 1e-12},
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


def _offs(ends: list[int]) -> Tensor:
    return torch.tensor(ends, dtype=torch.int32)


def _args(
    dtype: torch.dtype, m: int = M, k: int = K, n: int = N, experts: int = 4, seed: int = 0
) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).requires_grad_()
    # as torchtitan passes it: the (E, N, K) parameter transposed
    w = torch.randn(experts, n, k, generator=g).to(dtype).transpose(-2, -1)
    w = w.detach().requires_grad_()
    return x, w


def _compare(op: cg.CustomOp[..., Tensor], x: Tensor, w: Tensor, offs: Tensor) -> None:
    y = op(x, w, offs)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(y.dtype)
    dx, dw = torch.autograd.grad(y, (x, w), g)
    ref = reference_grouped_mm(x, w, offs)
    rx, rw = torch.autograd.grad(ref, (x, w), g, allow_unused=True, materialize_grads=True)
    tol = TOLERANCES[x.dtype]
    torch.testing.assert_close(y, ref, **tol)
    torch.testing.assert_close(dx, rx, **tol)
    torch.testing.assert_close(dw, rw, **tol)
    assert (dx.dtype, dw.dtype, dw.shape) == (x.dtype, w.dtype, w.shape)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("op", OPS)
def test_forward_and_gradients_match_a_loop_over_experts(
    op: cg.CustomOp[..., Tensor], dtype: torch.dtype, routing: str
) -> None:
    x, w = _args(dtype)
    _compare(op, x, w, _offs(ROUTINGS[routing]))


@pytest.mark.parametrize("op", OPS)
def test_no_tokens_at_all(op: cg.CustomOp[..., Tensor]) -> None:
    x, w = _args(torch.float32, m=0)
    y = op(x, w, _offs([0, 0, 0, 0]))
    dx, dw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
    assert y.shape == (0, N) and dx.shape == (0, K)
    assert torch.equal(dw, torch.zeros_like(w))


def test_torch_kernel_loops_over_experts_where_torch_grouped_mm_does_not_take_the_operands() -> (
    None
):
    # float64, and rows that are not a multiple of 16 bytes: the loop; it agrees with the loop
    # of plain ops and with torch._grouped_mm
    x64, w64 = _args(torch.float64)
    xu, wu = _args(torch.float32, k=5, n=3)
    assert not torch_grouped.takes(x64, w64) and not torch_grouped.takes(xu, wu)
    offs = _offs(ROUTINGS["spread"])
    _compare(ops.grouped_mm, x64, w64, offs)
    _compare(ops.grouped_mm, xu, wu, offs)
    x, w = _args(torch.float32)
    assert torch_grouped.takes(x, w)
    torch.testing.assert_close(
        ops.grouped_mm(x.double(), w.double(), offs).float(), ops.grouped_mm(x, w, offs)
    )


def test_flop_counters_see_the_op_and_its_weight_gradient() -> None:
    x, w = _args(torch.bfloat16)
    offs = _offs(ROUTINGS["spread"])
    with FlopCounterMode(display=False) as counter:  # torch's own counter
        y = ops.grouped_mm(x, w, offs)
        y.backward(torch.ones_like(y))
    assert counter.get_total_flops() == 3 * 2 * M * K * N  # forward, dX, dW
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    assert counts == {
        "customgrad.grouped_mm": 2 * 2 * M * K * N,
        "customgrad.grouped_mm_weight_grad": 2 * M * K * N,
    }


def test_check_op_passes_torch_kernels_in_float64_and_bfloat16() -> None:
    x, w = (t.detach() for t in _args(torch.float32, m=7, k=4, n=5))
    offs = _offs([2, 2, 6, 7])
    report = check_op(ops.grouped_mm, x, w, offs)  # float64: the loop
    assert report.ok, str(report)
    gemm = 2 * 7 * 4 * 5
    assert report.flops == {"full": 2 * gemm, "input": gemm, "weight": gemm}
    assert report.launches["input"] == {"customgrad::grouped_mm": 1}
    assert report.launches["weight"] == {"customgrad::grouped_mm_weight_grad": 1}
    # the integer offsets get no gradient: the report names only the gradients each half gives
    assert report.backward == (
        "the pair: backward_input returns 'x' in the input pass; backward_weight returns 'w' "
        "in the weight pass"
    )
    xb, wb = (t.detach() for t in _args(torch.bfloat16))
    report = check_op(ops.grouped_mm, xb, wb, _offs(ROUTINGS["spread"]), dtype="own")
    assert report.ok and report["split"].dtype == "bfloat16", str(report)
    assert report.flops["weight"] == report.flops["input"] == 2 * M * K * N


@TRITON_CPU
def test_check_op_passes_triton_kernels_in_float32() -> None:
    # gradgradcheck left out: it runs the interpreted kernels hundreds of times (the double
    # backward is the torch family's, checked above: the same registrations)
    x, w = (t.detach() for t in _args(torch.float32, m=5, k=3, n=2, experts=3))
    offs = _offs([1, 1, 5])
    checks = ["opcheck", "fake", "gradcheck", "split", "flops"]
    report = check_op(ops.triton_grouped_mm, x, w, offs, dtype=torch.float32, checks=checks)
    assert report.ok, str(report)
    gemm = 2 * 5 * 3 * 2
    assert report.flops == {"full": 2 * gemm, "input": gemm, "weight": gemm}
    assert report.launches["input"] == {"customgrad::triton_grouped_mm": 1}
    assert report.launches["weight"] == {"customgrad::triton_grouped_mm_weight_grad": 1}


def _experts(op: cg.CustomOp[..., Tensor], x: Tensor, ws: list[Tensor], offs: Tensor) -> Tensor:
    """torchtitan's ``GroupedExperts.forward``: SwiGLU over three grouped GEMMs."""
    w1, w2, w3 = (w.transpose(-2, -1) for w in ws)
    h = torch.nn.functional.silu(op(x, w1, offs)) * op(x, w3, offs)
    return op(h, w2, offs)


def _expert_weights(dtype: torch.dtype, hidden: int = 2 * K) -> list[Tensor]:
    g = torch.Generator().manual_seed(3)
    shapes = [(4, hidden, K), (4, K, hidden), (4, hidden, K)]  # w1 (E, F, D), w2 (E, D, F), w3
    return [(torch.randn(s, generator=g) / 4).to(dtype).requires_grad_() for s in shapes]


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("op", OPS)
def test_split_under_stage_backward_holds_dx_in_i_and_dw_in_w(
    op: cg.CustomOp[..., Tensor], routing: str
) -> None:
    offs = _offs(ROUTINGS[routing])
    ws = _expert_weights(torch.float32)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(4)).requires_grad_()
    out = _experts(op, x, ws, offs)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(8))
    full = torch.autograd.grad(out, (x, *ws), grad, retain_graph=True)
    kernels = triton_kernels.kernels() if op is ops.triton_grouped_mm else ()
    with count_launches(*kernels) as launches, FlopCounter() as counter:
        counter.key = "I"
        _, groups = stage_backward_input([out], [grad], [x], iter(ws))
        after_input = dict(launches)
        counter.key = "W"
        stage_backward_weight(iter(ws), groups)
    gemm = 2 * M * K * (2 * K)  # each of the three GEMMs: (M, K) x (K, 2K)
    assert counter.by_key == {"I": 3 * gemm, "W": 3 * gemm}  # dX GEMMs in I, dW GEMMs in W
    if kernels:
        assert after_input == {"_grouped_mm_kernel": 3, "_grouped_weight_grad_kernel": 0}
        assert launches == {"_grouped_mm_kernel": 3, "_grouped_weight_grad_kernel": 3}
    assert x.grad is not None
    torch.testing.assert_close(x.grad, full[0])
    for w, g in zip(ws, full[1:]):
        torch.testing.assert_close(w.grad, g)


def test_compiled_experts_keep_one_graph_across_routings_and_split_each() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    ws = _expert_weights(torch.float32)

    class Experts(torch.nn.Module):
        def forward(self, x: Tensor, offs: Tensor) -> Tensor:
            return _experts(ops.grouped_mm, x, ws, offs)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(Experts(), backend=counter, fullgraph=True)
    split = cg.compile(Experts(), backend="aot_eager", fullgraph=True)
    for seed, ends in enumerate(ROUTINGS.values()):
        offs = _offs(ends)
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(M, K, generator=gen)
        eager = _experts(ops.grouped_mm, x.requires_grad_(), ws, offs)
        g = torch.randn(eager.shape, generator=gen)
        want = torch.autograd.grad(eager, (x, *ws), g)
        got = torch.autograd.grad(compiled(x, offs), (x, *ws), g)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
        for w in ws:
            w.grad = None
        out = split(x, offs)
        with FlopCounter() as flops:
            flops.key = "I"
            _, groups = stage_backward_input([out], [g], [x], iter(ws))
            flops.key = "W"
            stage_backward_weight(iter(ws), groups)
        gemm = 2 * M * K * (2 * K)
        assert flops.by_key == {"I": 3 * gemm, "W": 3 * gemm}, ends
        for w, b in zip(ws, want[1:]):
            torch.testing.assert_close(w.grad, b)
            w.grad = None
    assert counter.frame_count == 1  # the offsets are a tensor: a new routing is no new graph
    assert [r.status for r in regions() if "Experts" in r.name][-1:] == ["split"]


@pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason=optional_package("torchtitan", "make install pins torchtitan 0.3.0"),
)
@pytest.mark.filterwarnings("ignore:In CPU autocast, but the target dtype is not supported")
def test_torchtitan_grouped_experts_through_the_seam_give_torchtitans_results() -> None:
    from tests import _torchtitan as tt

    # one MoE layer of the tiny Qwen3-MoE, torchtitan's grouped GEMM and the op's
    layers = [tt.model("qwen3", k).layers["1"].moe for k in ("native", "customgrad")]  # type: ignore[index, union-attr]
    x = torch.randn(2, tt.SEQ, tt.DIM, generator=torch.Generator().manual_seed(5))
    inputs = [x.clone().requires_grad_() for _ in layers]
    outs = [m(xi) for m, xi in zip(layers, inputs)]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)  # bit for bit
    g = torch.randn(outs[0].shape, generator=torch.Generator().manual_seed(9))
    split_flops = []
    for m, xi, out in zip(layers, inputs, outs):
        weights = list(m.parameters())
        with FlopCounter() as flops:
            flops.key = "I"
            _, groups = stage_backward_input([out], [g], [xi], iter(weights))
            flops.key = "W"
            stage_backward_weight(iter(weights), groups)
        split_flops.append(dict(flops.by_key))
    rows = 2 * tt.SEQ * tt.TOP_K  # tokens routed to experts
    gemm = 2 * rows * tt.DIM * tt.EXPERT_DIM
    assert split_flops[0] == split_flops[1]  # the op splits as torch's own grouped GEMM
    assert split_flops[1]["W"] >= 3 * gemm  # the three dW GEMMs (and the router's)
    torch.testing.assert_close(inputs[0].grad, inputs[1].grad, rtol=0, atol=0)
    swapped = dict(layers[1].named_parameters())
    for name, p in layers[0].named_parameters():
        torch.testing.assert_close(p.grad, swapped[name].grad, rtol=0, atol=0)
