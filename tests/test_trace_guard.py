"""Trace reuse at least as safe as torch.compile's: a traced backward is reused only while it is
proven to read nothing but its arguments and immutable values; any other backward runs as
written, once per backward (issue 24's classes, and their relatives).

Each case changes, between two backwards, something the backward reads, in one way Python
allows; the split gradients (customgrad's I then W) must be those of calling it.
"""

from __future__ import annotations

import functools
import operator
import os
import re
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

import customgrad as cg
from customgrad._autosplit import AutoSplitter, Fallback, TracedSplit
from customgrad._guards import Impure, TraceGuard
from customgrad.pipelining import stage_backward_input, stage_backward_weight

DT = torch.float64
_ids = iter(range(10**6))


def linear_with(backward: Callable[..., Any]) -> cg.CustomOp[..., Tensor]:
    @cg.op(f"test_trace_guard{next(_ids)}::linear", weights=("weight",))
    def linear(x: Tensor, weight: Tensor) -> Tensor:
        return x @ weight.mT

    linear.register_fake(lambda x, weight: x.new_empty((*x.shape[:-1], weight.shape[0])))
    linear.register_save_for_backward(lambda i, o: (i.x, i.weight))
    linear.register_backward(backward)
    return linear


def split_grads(op: Callable[..., Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dw) through customgrad's I then W, and the unscaled reference (dx, dw)."""
    x = torch.randn(4, 3, dtype=DT, requires_grad=True)
    w = torch.randn(2, 3, dtype=DT, requires_grad=True)
    g = torch.randn(4, 2, dtype=DT)
    out = op(x, w)
    (gx,), groups = stage_backward_input([out], [g], [x], [w])
    stage_backward_weight([w], groups)
    assert w.grad is not None
    return gx, w.grad, g @ w.detach(), g.mT @ x.detach()


# --------------------------------------------------------------------------------------------
# State a backward may read, at module level (as users write it)

LOSS_SCALE = torch.tensor(1.0, dtype=DT)
SCALE = 1.0
ARRAY = np.array([1.0])


class Base:
    scale = 1.0


class Child(Base):
    pass


class Config:
    scale = 1.0


CFG = Config()


class Getter:
    _scale = 1.0

    @classmethod
    def get(cls) -> float:
        return cls._scale


class WithProperty:
    def __init__(self) -> None:
        self.value = 1.0

    @property
    def scale(self) -> float:
        return self.value


PROP = WithProperty()


class Descriptor:
    value = 1.0

    def __get__(self, obj: Any, owner: Any) -> float:
        return Descriptor.value


class HasDescriptor:
    scale = Descriptor()


class Dynamic:
    value = 1.0

    def __getattr__(self, name: str) -> float:
        return Dynamic.value


DYN = Dynamic()


@functools.lru_cache
def cached_scale() -> float:
    return CFG.scale


def times_scale(t: Tensor) -> Tensor:
    return t * SCALE


user_module = types.ModuleType("cg_user_config")
user_module.__file__ = "/nonexistent/cg_user_config.py"
user_module.SCALE = 1.0  # type: ignore[attr-defined]
sys.modules["cg_user_config"] = user_module
import cg_user_config  # type: ignore[import-not-found]  # noqa: E402


def _set_all(k: float) -> None:
    global SCALE, ARRAY
    LOSS_SCALE.fill_(k)
    SCALE = k
    ARRAY = np.array([k])
    Base.scale = k
    CFG.scale = k
    cached_scale.cache_clear()
    Getter._scale = k
    PROP.value = k
    Descriptor.value = k
    Dynamic.value = k
    cg_user_config.SCALE = k
    os.environ["CG_TEST_SCALE"] = str(k)


# Each: (name, backward's scale factor as read, whether it may be traced)
READS: list[tuple[str, Callable[[], Any], bool]] = [
    ("a global tensor read as a number", lambda: float(LOSS_SCALE), False),
    ("a global tensor's .item()", lambda: LOSS_SCALE.item(), False),
    ("a global tensor's .tolist()", lambda: LOSS_SCALE.tolist(), False),
    ("a global tensor in tensor math", lambda: LOSS_SCALE, False),
    ("an lru_cache helper after cache_clear", lambda: cached_scale(), False),
    ("an inherited class attribute", lambda: Child.scale, False),
    ("getattr by name", lambda: getattr(CFG, "scale"), False),  # noqa: B009
    ("a classmethod getter", lambda: Getter.get(), False),
    ("a property", lambda: PROP.scale, False),
    ("a descriptor", lambda: HasDescriptor.scale, False),
    ("__getattr__", lambda: DYN.anything, False),
    ("operator.attrgetter", lambda: operator.attrgetter("scale")(CFG), False),
    ("a user module's attribute", lambda: cg_user_config.SCALE, False),
    ("a numpy array", lambda: float(ARRAY[0]), False),
    ("os.environ", lambda: float(os.environ["CG_TEST_SCALE"])),  # type: ignore[list-item]
    ("a global float, rebound", lambda: SCALE, True),
]
READS = [(r[0], r[1], r[2] if len(r) > 2 else False) for r in READS]  # type: ignore[misc]


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    _set_all(1.0)
    yield
    _set_all(1.0)
    os.environ.pop("CG_TEST_SCALE", None)


@pytest.mark.parametrize(("case", "read", "traced"), READS, ids=[r[0] for r in READS])
def test_what_a_backward_reads_is_read_when_it_runs(
    case: str, read: Callable[[], Any], traced: bool
) -> None:
    def backward(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        x, w = saved
        return {"x": g @ w * read(), "weight": g.mT @ x}

    op = linear_with(backward)
    for k in (1.0, 3.0, 1.0):
        _set_all(k)
        gx, gw, want_x, want_w = split_grads(op)
        torch.testing.assert_close(gx, want_x * k, msg=f"{case}, scale {k}")
        torch.testing.assert_close(gw, want_w)
    auto = op.rules.auto
    assert isinstance(auto, AutoSplitter)
    assert isinstance(auto.last, TracedSplit if traced else Fallback), auto.last


def test_a_global_float_rebound_traces_again_and_back_reuses_the_first_trace() -> None:
    def backward(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        x, w = saved
        return {"x": times_scale(g @ w), "weight": g.mT @ x}

    op = linear_with(backward)
    auto = op.rules.auto
    assert isinstance(auto, AutoSplitter)
    for k, traces in ((1.0, 1), (3.0, 2), (1.0, 2), (3.0, 2)):
        _set_all(k)
        gx, _, want_x, _ = split_grads(op)
        torch.testing.assert_close(gx, want_x * k)
        assert auto.traces == traces


def test_a_closure_cell_rebound_traces_again() -> None:
    factor = 1.0

    def backward(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        x, w = saved
        return {"x": g @ w * factor, "weight": g.mT @ x}

    op = linear_with(backward)
    for k in (1.0, 2.0):
        factor = k
        gx, _, want_x, _ = split_grads(op)
        torch.testing.assert_close(gx, want_x * k)
    assert isinstance(op.rules.auto, AutoSplitter) and op.rules.auto.traces == 2


def test_a_helper_whose_code_is_replaced_traces_again() -> None:
    def helper(t: Tensor) -> Tensor:
        return t

    def backward(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        x, w = saved
        return {"x": helper(g @ w), "weight": g.mT @ x}

    op = linear_with(backward)
    gx, _, want_x, _ = split_grads(op)
    torch.testing.assert_close(gx, want_x)
    helper.__code__ = (lambda t: t * 2).__code__
    gx, _, want_x, _ = split_grads(op)
    torch.testing.assert_close(gx, want_x * 2)


def test_side_effects_happen_once_per_backward() -> None:
    calls: list[str] = []

    def backward(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        calls.append(ctx.phase)
        x, w = saved
        return {"x": g @ w, "weight": g.mT @ x}

    op = linear_with(backward)
    for _ in range(2):
        x = torch.randn(4, 3, dtype=DT, requires_grad=True)
        w = torch.randn(2, 3, dtype=DT, requires_grad=True)
        op(x, w).sum().backward()
    split_grads(op)
    assert calls == ["full", "full", "full"]  # two full backwards, one split: never traced


def test_a_backward_making_its_own_noise_from_a_seed_gets_the_same_noise() -> None:
    # Memory-saving dropout backwards remake their noise from a saved seed.
    @cg.op(f"test_trace_guard{next(_ids)}::noisy", weights=("weight",))
    def noisy(x: Tensor, weight: Tensor, seed: int) -> Tensor:
        return x @ weight.mT

    noisy.register_fake(lambda x, weight, seed: x.new_empty((*x.shape[:-1], weight.shape[0])))
    noisy.register_save_for_backward(lambda i, o: (i.x, i.weight, i.seed))

    @noisy.register_backward
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        x, w, seed = saved
        gen = torch.Generator().manual_seed(seed)
        mask = torch.rand(g.shape, generator=gen, dtype=g.dtype)
        return {"x": (g * mask) @ w, "weight": g.mT @ x}

    results = []
    for _ in range(3):
        x = torch.randn(4, 3, dtype=DT, generator=torch.Generator().manual_seed(1))
        x.requires_grad_()
        w = torch.randn(2, 3, dtype=DT, generator=torch.Generator().manual_seed(2))
        w.requires_grad_()
        g = torch.ones(4, 2, dtype=DT)
        (gx,), groups = stage_backward_input([noisy(x, w, 7)], [g], [x], [w])
        stage_backward_weight([w], groups)
        results.append(gx)
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)
    torch.testing.assert_close(results[2], results[0], rtol=0, atol=0)


def test_what_the_guard_refuses_is_named() -> None:
    def writes(ctx: Any, saved: Any, g: Tensor) -> Any:
        global SCALE
        SCALE = 2.0
        return {}

    def prints(ctx: Any, saved: Any, g: Tensor) -> Any:
        print(g)
        return {}

    def sets_a_flag(ctx: Any, saved: Any, g: Tensor) -> Any:
        torch.backends.cudnn.enabled = True  # process state, through a library module
        return {}

    decorated = functools.wraps(prints)(lambda ctx, saved, g: prints(ctx, saved, g))
    expected = [
        (writes, "a write to the global 'SCALE'"),
        (prints, "the builtin 'print'"),
        (sets_a_flag, re.escape("a write to an attribute ('enabled')")),
        (decorated, "a decorated function"),
        (lambda ctx, saved, g: CFG.scale, "the global 'CFG'"),
        (lambda ctx, saved, g: torch.manual_seed(0), "manual_seed"),
    ]
    for fn, words in expected:
        with pytest.raises(Impure, match=words):
            TraceGuard(fn).check()
    assert TraceGuard(lambda ctx, saved, g: {"x": torch.matmul(g, saved[0]) * SCALE}).check()
