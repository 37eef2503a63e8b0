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
