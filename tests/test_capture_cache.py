"""The one capture cache of the automatic split, for customgrad ops and plain Functions alike.

A single backward (an op's ``register_backward``, a plain Function's ``backward`` in customgrad's
stage) is captured per input signature by one :class:`customgrad._autosplit.AutoSplitter`: the
same retry rule (a new capture per shapes, up to ``RECAPTURES`` guard failures each), and
nothing of a capture kept alive but its graph: no stand-in or gradient-sized tensor in dynamo's
cache entry or customgrad's capture, however many shapes were captured.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import customgrad as cg
from customgrad._autosplit import RECAPTURES, AutoSplitter, TracedSplit
from customgrad.pipelining import _function_split, stage_backward_input, stage_backward_weight
from tests._skips import UNBACKED_SLICE_WRITES

_ids = itertools.count()


def linear_op() -> cg.CustomOp[..., Tensor]:
    @cg.op(f"test_capture_cache{next(_ids)}::linear", weights=("weight",))
    def linear(x: Tensor, weight: Tensor) -> Tensor:
        return x @ weight.mT

    linear.register_fake(lambda x, weight: x.new_empty((*x.shape[:-1], weight.shape[0])))
    linear.register_save_for_backward(lambda i, o: (i.x, i.weight))

    @linear.register_backward
    def _(ctx: Any, saved: Any, g: Tensor) -> dict[str, Tensor]:
        x, w = saved
        return {"x": g @ w, "weight": g.mT @ x}

    return linear


def linear_function() -> type[torch.autograd.Function]:
    class Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
            ctx.save_for_backward(x, w)
            return x @ w.mT

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor]:
            x, w = ctx.saved_tensors
            return g @ w, g.mT @ x

    return Linear


def made(kind: str) -> tuple[Callable[..., Tensor], Callable[[], AutoSplitter]]:
    """An op or a plain Function computing ``x @ w.T``, and its splitter."""
    if kind == "op":
        op = linear_op()
        auto = op.rules.auto
        assert isinstance(auto, AutoSplitter)
        return op, lambda: auto
    fn = linear_function()

    def splitter() -> AutoSplitter:
        (found,) = (s for (c, *_), s in _function_split._SPLITTERS.items() if c is fn)
        return found

    return fn.apply, splitter


def split_step(apply: Callable[..., Tensor], n: int, d: int, dtype: torch.dtype) -> None:
    """One split backward (I, then W) of ``apply`` on a batch of ``n``, gradients checked."""
    x = torch.randn(n, d, dtype=dtype, requires_grad=True)
    w = torch.randn(d, d, dtype=dtype, requires_grad=True)
    g = torch.randn(n, d, dtype=dtype)
    (gx,), groups = stage_backward_input([apply(x, w)], [g], [x], [w])
    stage_backward_weight([w], groups)
    torch.testing.assert_close((gx, w.grad), (g @ w, g.mT @ x), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["op", "function"])
def test_every_new_shape_is_captured_beyond_the_recapture_limit(kind: str) -> None:
    """One retry rule: a new shape is a new signature, captured whatever came before. (A plain
    Function counted every shape against one limit, and ran once for good after 8.)"""
    apply, splitter = made(kind)
    for n in range(1, RECAPTURES + 4):
        split_step(apply, n, 3, torch.float64)
        assert isinstance(splitter().last, TracedSplit), (n, splitter().last)
    assert splitter().traces == RECAPTURES + 3


def alive_bytes() -> int:
    """The bytes of every CPU tensor's storage alive now (fake and meta tensors have none)."""
    gc.collect()
    storages: dict[int, int] = {}
    for o in gc.get_objects():
        if type(o) is torch.Tensor and o.device.type == "cpu":
            storage = o.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("kind", ["op", "function"])
def test_captures_of_new_shapes_keep_no_tensor_alive(kind: str) -> None:
    """After captures of 4 shapes, the tensors alive are those before: dynamo's cache entry
    keeps neither a stand-in of a gradient's size nor the call's saved tensors. (Each capture
    kept one tensor per gradient, 64 KiB here for the weight's.)"""
    d = 128
    apply, splitter = made(kind)
    split_step(apply, 1, d, torch.float32)  # the first capture imports and caches what it uses
    before = alive_bytes()
    for n in range(2, 6):
        split_step(apply, n, d, torch.float32)
    grown = alive_bytes() - before
    assert splitter().traces == 5
    assert grown < d * d * 4, f"{grown} bytes kept alive by 4 captures"


# --------------------------------------------------------------------------------------------
# Routing-dependent sizes: one capture for every routing of a mixture of experts

E, T, K, N = 4, 12, 6, 5  # experts, tokens, features in and out


def group_sizes(offs: Tensor) -> list[int]:
    """The tokens of each expert, from the end offsets of their groups (as torchtitan passes
    them to its grouped GEMM): Python ints, new with every routing."""
    return torch.diff(offs, prepend=offs.new_zeros(1)).tolist()


def grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """Tokens sorted by expert, each group times its expert's weight: a loop over experts."""
    return torch.cat([xe @ w[e] for e, xe in enumerate(torch.split(x, group_sizes(offs)))])


def grouped_mm_backward(x: Tensor, w: Tensor, offs: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """dX (one GEMM per expert, for I) and dW (one per expert, for W), as a kernel's backward
    reads the group sizes: as Python ints, from the offsets."""
    sizes = group_sizes(offs)
    dx, dw = [], []
    for e, (xe, ge) in enumerate(zip(torch.split(x, sizes), torch.split(g, sizes))):
        dx.append(ge @ w[e].mT)
        dw.append(xe.mT @ ge)
    return torch.cat(dx), torch.stack(dw)


class GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
        ctx.save_for_backward(x, w, offs)
        return grouped_mm(x, w, offs)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor, None]:
        x, w, offs = ctx.saved_tensors
        return (*grouped_mm_backward(x, w, offs, g), None)


def grouped_mm_op() -> cg.CustomOp[..., Tensor]:
    @cg.op(f"test_capture_cache{next(_ids)}::grouped_mm", weights=("w",))
    def op(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
        return grouped_mm(x, w, offs)

    op.register_fake(lambda x, w, offs: x.new_empty(x.shape[0], w.shape[-1]))
    op.register_save_for_backward(lambda i, o: (i.x, i.w, i.offs))

    @op.register_backward
    def _(ctx: Any, saved: Any, g: Tensor) -> dict[str, Tensor]:
        dx, dw = grouped_mm_backward(*saved, g)
        return {"x": dx, "w": dw}

    return op


def routing(step: int) -> Tensor:
    """A routing of the ``T`` tokens to the ``E`` experts (some left without tokens)."""
    gen = torch.Generator().manual_seed(step)
    cuts = torch.randint(0, T + 1, (E - 1,), generator=gen).sort().values
    return torch.cat([cuts, torch.tensor([T])])


@pytest.mark.parametrize("kind", ["op", "function"])
def test_a_grouped_gemm_reading_its_group_sizes_splits_for_every_routing(kind: str) -> None:
    """A backward that loops over experts with ``offs.tolist()`` is captured once for all
    routings (the sizes are unbacked: the passes read them from ``offs``), not once per routing
    and then run once: every microbatch splits, I runs the dX GEMMs and W the dW GEMMs."""
    from torch.utils.flop_counter import FlopCounterMode

    if kind == "op":
        op = grouped_mm_op()
        apply: Callable[..., Tensor] = op
        auto = op.rules.auto
        assert isinstance(auto, AutoSplitter)
        splitter: Callable[[], AutoSplitter] = lambda: auto  # noqa: E731
    else:
        apply = GroupedMM.apply

        def splitter() -> AutoSplitter:
            (found,) = (s for (c, *_), s in _function_split._SPLITTERS.items() if c is GroupedMM)
            return found

    gemms = 2 * T * K * N  # the FLOPs of the dX GEMMs, and of the dW GEMMs, whatever the routing
    seen: set[tuple[int, ...]] = set()
    for step in range(12):
        offs = routing(step)
        seen.add(tuple(offs.tolist()))
        x = torch.randn(T, K, dtype=torch.float64, requires_grad=True)
        w = torch.randn(E, K, N, dtype=torch.float64, requires_grad=True)
        g = torch.randn(T, N, dtype=torch.float64)
        want = torch.autograd.grad(grouped_mm(x, w, offs), (x, w), g)
        out = apply(x, w, offs)
        with FlopCounterMode(display=False) as input_pass:
            (gx,), groups = stage_backward_input([out], [g], [x], [w])
        with FlopCounterMode(display=False) as weight_pass:
            stage_backward_weight([w], groups)
        torch.testing.assert_close((gx, w.grad), want, rtol=0, atol=1e-12)
        assert isinstance(splitter().last, TracedSplit), (step, splitter().last)
        assert (input_pass.get_total_flops(), weight_pass.get_total_flops()) == (gemms, gemms)
    assert len(seen) == 12  # twelve routings,
    assert splitter().traces == 1  # one capture


class CtxGroupedMM(torch.autograd.Function):
    """The grouped GEMM with each expert's ``(start, end)`` rows read once, in the forward, and
    kept on ``ctx`` as Python ints: constants of a capture, new with every routing. Its backward
    writes each expert's rows (slices)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
        ends = offs.tolist()
        ctx.groups = list(zip([0, *ends[:-1]], ends))
        ctx.save_for_backward(x, w)
        return grouped_mm(x, w, offs)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor, None]:
        x, w = ctx.saved_tensors
        dx, dw = torch.zeros_like(x), torch.zeros_like(w)
        for e, (start, end) in enumerate(ctx.groups):
            dx[start:end] = g[start:end] @ w[e].mT
            dw[e] = x[start:end].mT @ g[start:end]
        return dx, dw, None


class CtxSizesGroupedMM(torch.autograd.Function):
    """The same with the experts' sizes kept on ``ctx``, its backward splitting and
    concatenating the rows."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
        ctx.sizes = group_sizes(offs)
        ctx.save_for_backward(x, w)
        return grouped_mm(x, w, offs)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor, None]:
        x, w = ctx.saved_tensors
        dx, dw = [], []
        for e, (xe, ge) in enumerate(zip(torch.split(x, ctx.sizes), torch.split(g, ctx.sizes))):
            dx.append(ge @ w[e].mT)
            dw.append(xe.mT @ ge)
        return torch.cat(dx), torch.stack(dw), None


@pytest.mark.parametrize(
    "fn", [pytest.param(CtxGroupedMM, marks=UNBACKED_SLICE_WRITES), CtxSizesGroupedMM]
)
def test_group_sizes_kept_on_ctx_as_ints_split_for_every_routing(fn: Any) -> None:
    """Ints on ctx that change between backwards are read by the capture from a tensor of
    their values (unbacked): a second capture, then it serves every routing."""
    from torch.utils.flop_counter import FlopCounterMode

    gemms = 2 * T * K * N
    for step in range(12):
        offs = routing(step)
        x = torch.randn(T, K, dtype=torch.float64, requires_grad=True)
        w = torch.randn(E, K, N, dtype=torch.float64, requires_grad=True)
        g = torch.randn(T, N, dtype=torch.float64)
        want = torch.autograd.grad(grouped_mm(x, w, offs), (x, w), g)
        out = fn.apply(x, w, offs)
        with FlopCounterMode(display=False) as input_pass:
            (gx,), groups = stage_backward_input([out], [g], [x], [w])
        with FlopCounterMode(display=False) as weight_pass:
            stage_backward_weight([w], groups)
        torch.testing.assert_close((gx, w.grad), want, rtol=0, atol=1e-12)
        (splitter,) = (s for (c, *_), s in _function_split._SPLITTERS.items() if c is fn)
        assert isinstance(splitter.last, TracedSplit), (step, splitter.last)
        assert (input_pass.get_total_flops(), weight_pass.get_total_flops()) == (gemms, gemms)
    assert splitter.traces == 2  # the first routing's, then one for every routing


class SumsAlong(torch.autograd.Function):
    """``(x * w).sum(dim)`` with ``dim`` an int on ctx that changes: a size it cannot be."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, dim: int) -> Tensor:
        ctx.dim = dim
        ctx.save_for_backward(x, w)
        return (x * w).sum(dim)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor, None]:
        x, w = ctx.saved_tensors
        grown = g.unsqueeze(ctx.dim).expand_as(x)
        return grown * w, grown * x, None


def test_an_int_on_ctx_the_backward_needs_as_a_constant_is_one_again() -> None:
    """Read from a tensor, ``dim`` would be unbacked, which ``unsqueeze`` refuses: the capture
    takes it as a constant again, at once (one capture per value), and every step splits."""
    for step, dim in enumerate((0, 1, 0, 1, 1)):
        x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
        w = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
        g = torch.randn(4 if dim == 0 else 3, dtype=torch.float64)
        want = torch.autograd.grad((x * w).sum(dim), (x, w), g)
        (gx,), groups = stage_backward_input([SumsAlong.apply(x, w, dim)], [g], [x], [w])
        stage_backward_weight([w], groups)
        torch.testing.assert_close((gx, w.grad), want, rtol=0, atol=0)
        (splitter,) = (s for (c, *_), s in _function_split._SPLITTERS.items() if c is SumsAlong)
        assert isinstance(splitter.last, TracedSplit), (step, splitter.last)
    assert splitter.traces == 3  # dim 0, dim 1 from a tensor (refused), dim 1
