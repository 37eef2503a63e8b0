"""A captured backward is never silently stale: issue 30's classes, under every split.

The automatic split captures a single backward with dynamo and reuses the capture only while
dynamo's guards hold, with customgrad's checks on top where dynamo's miss (a complex 0j rebound
to -0j, ``is_leaf`` of an argument, ``getattr(module, name, default)`` for an attribute set
later); what dynamo cannot capture runs once, whole. Each case below is one class of state a
backward may read, written the way training code writes it. Between two steps the state
changes; the gradients of each step must be those of calling the backward directly then, under
torch's split (``torch.distributed.pipelining``'s ``stage_backward_input``/``_weight``),
customgrad's split and the weight-gradient queue.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import inspect
import logging
import math
import os
import re
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import Tensor

import customgrad as cg
from customgrad._autosplit import RECAPTURES, AutoSplitter, Fallback, TracedSplit
from customgrad._torch.pipelining import torch_split
from customgrad.pipelining import (
    WeightGradQueue,
    _function_split,
    stage_backward_input,
    stage_backward_weight,
)
from tests._skips import TORCH_SPLIT

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


# --------------------------------------------------------------------------------------------
# The three splits: (dx, dw) of one step; ``between`` runs between I and W


def by_customgrad(op: Any, x: Tensor, w: Tensor, g: Tensor, between: Callable[[], Any]) -> Any:
    (gx,), groups = stage_backward_input([op(x, w)], [g], [x], [w])
    between()
    stage_backward_weight([w], groups)
    return gx, w.grad


def by_torch(op: Any, x: Tensor, w: Tensor, g: Tensor, between: Callable[[], Any]) -> Any:
    backward_input, backward_weight = torch_split()
    (gx,), groups = backward_input([op(x, w)], [g], [x], [w])
    between()
    backward_weight([w], groups)
    return gx, w.grad


def by_queue(op: Any, x: Tensor, w: Tensor, g: Tensor, between: Callable[[], Any]) -> Any:
    queue = WeightGradQueue()
    with queue.microbatch(0, 0):
        out = op(x, w)
    queue.backward(out, g, inputs=[x])
    gx = x.grad
    between()
    queue.run(0, 0)
    queue.finish()
    return gx, w.grad


SPLITS = {"torch": by_torch, "customgrad": by_customgrad, "queue": by_queue}


# --------------------------------------------------------------------------------------------
# The classes: each a backward reading some state, and how a step changes it


@dataclass
class Case:
    backward: Callable[..., Any]
    set_state: Callable[[int], None]
    """Set the state for step ``k`` (0, 1, 2)."""
    split: bool | None
    """Whether it is captured and split (else it runs once, with a named reason); None where
    that is dynamo's choice by release (the gradients are checked either way)."""
    x_of: Callable[[Tensor, int], Tensor] = lambda x, k: x
    """The op's ``x`` at step ``k`` from a fresh leaf (a view, a non-leaf)."""


def scaled(s: Any) -> Callable[..., Any]:
    """A backward scaling both gradients by ``s()`` as it reads it."""

    def backward(ctx: Any, saved: Any, g: Tensor) -> dict[str, Any]:
        x, w = saved
        k = s(ctx, x)
        return {"x": g @ w * k, "weight": g.mT @ x * k}

    return backward


class Mode(enum.Enum):
    A = 1


Record = collections.namedtuple("Record", ["a", "b"], defaults=([1.0],))
STATE: dict[str, Any] = {}
PARAM = torch.nn.Parameter(torch.zeros(1))
OPTIMIZER = torch.optim.SGD([PARAM], lr=1.0)
DISTRIBUTION = torch.distributions.Uniform(0.0, 1.0)
NUMBER = torch.ones(())
ITEM = NUMBER.item  # a global bound method
Z = 0j
SEED = 1
seed_alias = torch.manual_seed


def library_function(k: int) -> None:
    setattr(F, "softsign", lambda t, k=k: t * (k + 1))  # noqa: B010 (monkeypatched)


def float32_precision(k: int) -> None:
    torch.set_float32_matmul_precision(("highest", "high", "highest")[k])


def mkldnn_flag(k: int) -> None:
    torch.backends.mkldnn.enabled = k != 1


def optimizer_lr(k: int) -> None:
    OPTIMIZER.param_groups[0]["lr"] = float(k + 1)


def distribution_field(k: int) -> None:
    DISTRIBUTION.high = torch.tensor(float(k + 1))


def bound_method(k: int) -> None:
    NUMBER.fill_(k + 1)


def op_attribute(k: int) -> None:
    STATE["op"].scale = float(k + 1)


def complex_zero(k: int) -> None:
    global Z
    Z = -0j if k == 1 else 0j


def enum_attribute(k: int) -> None:
    Mode.A.scale = float(k + 1)  # type: ignore[attr-defined]


def namedtuple_default(k: int) -> None:
    Record._field_defaults["b"][0] = float(k + 1)


def module_attribute(k: int) -> None:
    if k == 1:
        torch.cg_test_scale = 3.0  # type: ignore[attr-defined]
    elif hasattr(torch, "cg_test_scale"):
        del torch.cg_test_scale  # type: ignore[attr-defined]


NAME = "cg_test_named"  # an attribute name kept in a global
PART = "built"  # part of a name made with an f-string
COMPILING = torch.compiler.is_compiling  # an alias
ACTIVATION = torch.tanh  # a global alias rebound between steps


def named_attribute(k: int) -> None:
    """An attribute of torch added after the capture and removed again, by a name the
    backward's code never spells."""
    if k == 1:
        setattr(torch, NAME, 3.0)
    elif hasattr(torch, NAME):
        delattr(torch, NAME)


def built_attribute(k: int) -> None:
    if k == 1:
        setattr(torch, "cg_test_" + PART, 3.0)
    elif hasattr(torch, "cg_test_" + PART):
        delattr(torch, "cg_test_" + PART)


def computed_flag(k: int) -> None:
    name = "".join(("cg_", "test_", "flag"))
    if k == 1:
        setattr(F, name, True)
    elif hasattr(F, name):
        delattr(F, name)


def removed_attribute(k: int) -> None:
    if k == 1:
        del torch.cg_test_removed  # type: ignore[attr-defined]
    else:
        torch.cg_test_removed = 2.0  # type: ignore[attr-defined]


class Helper:
    def scale(self) -> float:
        return 1.0


HELPER = Helper()


def method_rebound(k: int) -> None:
    Helper.scale = (lambda self: 1.0, lambda self: 3.0, lambda self: 1.0)[k]  # type: ignore[method-assign]


OWN = "cg_test_own"  # a name this module gains and loses


def own_attribute(k: int) -> None:
    module = sys.modules[__name__]
    if k == 1:
        setattr(module, OWN, 3.0)
    elif hasattr(module, OWN):
        delattr(module, OWN)


def alias_rebound(k: int) -> None:
    global ACTIVATION
    ACTIVATION = (torch.tanh, torch.sigmoid, torch.tanh)[k]


def seed_value(k: int) -> None:
    global SEED
    SEED = k + 1


def nothing(k: int) -> None:
    pass


def seeded(ctx: Any, saved: Any, g: Tensor) -> dict[str, Any]:
    x, w = saved
    seed_alias(SEED)  # seeding through another name
    noise = torch.rand_like(g)
    return {"x": (g * noise) @ w, "weight": g.mT @ x}


def noisy_weight(ctx: Any, saved: Any, g: Tensor) -> dict[str, Any]:
    x, w = saved
    return {"x": g @ w, "weight": (g * torch.rand_like(g)).mT @ x}  # drawn for W only


CASES: dict[str, Case] = {
    "monkeypatched library function": Case(
        scaled(lambda ctx, x: F.softsign(torch.ones((), dtype=DT))), library_function, True
    ),
    "torch flag": Case(
        scaled(lambda ctx, x: 2.0 if torch.backends.mkldnn.enabled else 1.0), mkldnn_flag, True
    ),
    "torch process state": Case(
        scaled(lambda ctx, x: 2.0 if torch.get_float32_matmul_precision() == "high" else 1.0),
        float32_precision,
        False,
    ),
    "optimizer lr in a global": Case(
        scaled(lambda ctx, x: OPTIMIZER.param_groups[0]["lr"]), optimizer_lr, True
    ),
    "distribution field": Case(scaled(lambda ctx, x: DISTRIBUTION.high), distribution_field, False),
    "global bound method": Case(scaled(lambda ctx, x: ITEM()), bound_method, False),
    "ctx.op attribute": Case(scaled(lambda ctx, x: ctx.op.scale), op_attribute, True),
    "complex 0j and -0j": Case(
        scaled(lambda ctx, x: math.copysign(1.0, Z.imag) + 2.0), complex_zero, True
    ),
    "enum member attribute": Case(scaled(lambda ctx, x: Mode.A.scale), enum_attribute, True),
    "namedtuple mutable default": Case(
        scaled(lambda ctx, x: Record(0).b[0]), namedtuple_default, True
    ),
    "getattr(torch, name, default)": Case(
        scaled(lambda ctx, x: getattr(torch, "cg_test_scale", 1.0)), module_attribute, True
    ),
    "storage_offset": Case(
        scaled(lambda ctx, x: 1.0 + x.storage_offset()),
        nothing,
        None,  # dynamo refuses storage_offset() up to torch 2.14; 2.15 captures and guards it
        lambda x, k: torch.cat([x.new_zeros(k, 3), x]).detach()[k:].requires_grad_(),
    ),
    "is_leaf": Case(
        scaled(lambda ctx, x: 1.0 if x.is_leaf else 3.0),
        nothing,
        True,
        lambda x, k: x * 1 if k == 1 else x,
    ),
    "getattr(torch, NAME, default), NAME a global": Case(
        scaled(lambda ctx, x: getattr(torch, NAME, 1.0)), named_attribute, True
    ),
    "getattr(torch, f-string, default)": Case(
        scaled(lambda ctx, x: getattr(torch, f"cg_test_{PART}", 1.0)), built_attribute, True
    ),
    "hasattr(F, computed name)": Case(
        scaled(lambda ctx, x: 3.0 if hasattr(F, "cg_test_" + "flag") else 1.0),
        computed_flag,
        True,
    ),
    "module attribute removed": Case(
        scaled(lambda ctx, x: getattr(torch, "cg_test_removed", 1.0)), removed_attribute, True
    ),
    "method monkeypatched on its class": Case(
        scaled(lambda ctx, x: HELPER.scale()), method_rebound, True
    ),
    "own module by a computed name": Case(
        scaled(lambda ctx, x: getattr(sys.modules[__name__], OWN, 1.0)),
        own_attribute,
        True,
    ),
    "global alias rebound": Case(
        scaled(lambda ctx, x: 1.0 + ACTIVATION(torch.ones((), dtype=DT))), alias_rebound, True
    ),
    "torch.compiler.is_compiling()": Case(
        scaled(lambda ctx, x: 3.0 if torch.compiler.is_compiling() else 1.0), nothing, False
    ),
    "torch._dynamo.is_compiling()": Case(
        scaled(lambda ctx, x: 3.0 if torch._dynamo.is_compiling() else 1.0), nothing, False
    ),
    "torch.compiler.is_dynamo_compiling()": Case(
        scaled(lambda ctx, x: 3.0 if torch.compiler.is_dynamo_compiling() else 1.0),
        nothing,
        False,
    ),
    "is_compiling through an alias": Case(
        scaled(lambda ctx, x: 3.0 if COMPILING() else 1.0), nothing, False
    ),
    "seeding through an alias": Case(seeded, seed_value, False),
    "RNG between I and W": Case(noisy_weight, nothing, True),
}


@pytest.fixture
def state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every piece of state the cases change, put back after the test."""
    monkeypatch.setattr(F, "softsign", F.softsign)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", torch.backends.mkldnn.enabled)
    monkeypatch.setattr(DISTRIBUTION, "high", DISTRIBUTION.high)
    monkeypatch.setattr(Mode.A, "scale", 1.0, raising=False)
    precision = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(precision)
    for k in (0,):
        optimizer_lr(k), bound_method(k), complex_zero(k), namedtuple_default(k)
        module_attribute(k), seed_value(k), built_attribute(k), computed_flag(k)
        alias_rebound(k), method_rebound(k), own_attribute(k)
    for name in (NAME, "cg_test_removed"):
        if hasattr(torch, name):
            delattr(torch, name)


def reference(op: Any, backward: Callable[..., Any], x: Tensor, w: Tensor, g: Tensor) -> Any:
    """The backward called directly, as the op's own backward would be called."""
    ctx = cg.BackwardContext(op, "full", frozenset({"x", "weight"}))
    with torch.no_grad():
        got = backward(ctx, (x, w), g)
    return got["x"], got["weight"]


def between_draw() -> Tensor:
    """What runs between I and W: the next microbatch's dropout, drawing from the generator."""
    return torch.rand(5)


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("split", [pytest.param("torch", marks=TORCH_SPLIT), "customgrad", "queue"])
@pytest.mark.parametrize("name", list(CASES))
def test_state_changed_between_steps_gives_the_gradients_of_a_call(
    name: str, split: str, state: None
) -> None:
    case = CASES[name]
    op = linear_with(case.backward)
    op.scale = 1.0  # type: ignore[attr-defined]  # read through ctx.op
    STATE["op"] = op
    auto = op.rules.auto
    assert isinstance(auto, AutoSplitter)
    for k in (0, 1, 2):
        case.set_state(k)
        leaf = torch.randn(4, 3, dtype=DT, requires_grad=True)
        x = case.x_of(leaf, k)
        w = torch.randn(2, 3, dtype=DT, requires_grad=True)
        g = torch.randn(4, 2, dtype=DT)
        torch.manual_seed(k)
        want_x, want_w = reference(op, case.backward, x, w, g)
        want_between = between_draw()
        torch.manual_seed(k)
        between: list[Tensor] = []
        gx, gw = SPLITS[split](op, x, w, g, lambda b=between: b.append(between_draw()))
        torch.testing.assert_close(gx, want_x, rtol=0, atol=0, msg=f"{name}, step {k}: dx")
        torch.testing.assert_close(gw, want_w, rtol=0, atol=0, msg=f"{name}, step {k}: dw")
        torch.testing.assert_close(between[0], want_between, rtol=0, atol=0)
        if case.split is None:
            assert isinstance(auto.last, TracedSplit) or auto.last.logged, auto.last
        elif case.split:
            assert isinstance(auto.last, TracedSplit), auto.describe()
        else:
            assert isinstance(auto.last, Fallback) and auto.last.logged, auto.last


def function_with(backward: Callable[..., Any]) -> type[torch.autograd.Function]:
    """A plain Function whose backward is ``backward`` (called with ``(x, w)`` as saved)."""

    class Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
            ctx.save_for_backward(x, w)
            ctx.op = STATE["op"]  # read through ctx.op
            return x @ w.mT

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor]:
            got = backward(ctx, ctx.saved_tensors, g)
            return got["x"], got["weight"]

    return Linear


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("name", list(CASES))
def test_state_changed_between_steps_gives_the_gradients_of_a_call_for_a_plain_function(
    name: str, state: None
) -> None:
    """The same classes read by a plain Function's backward, split in customgrad's stage: the
    Function's split uses the op's capture cache and checks."""
    case = CASES[name]
    STATE["op"] = types.SimpleNamespace(scale=1.0)
    fn = function_with(case.backward)
    for k in (0, 1, 2):
        case.set_state(k)
        leaf = torch.randn(4, 3, dtype=DT, requires_grad=True)
        x = case.x_of(leaf, k)
        w = torch.randn(2, 3, dtype=DT, requires_grad=True)
        g = torch.randn(4, 2, dtype=DT)
        torch.manual_seed(k)
        with torch.no_grad():
            want = case.backward(types.SimpleNamespace(op=STATE["op"]), (x, w), g)
        want_between = between_draw()
        torch.manual_seed(k)
        between: list[Tensor] = []
        gx, gw = by_customgrad(fn.apply, x, w, g, lambda b=between: b.append(between_draw()))
        torch.testing.assert_close(gx, want["x"], rtol=0, atol=0, msg=f"{name}, step {k}: dx")
        torch.testing.assert_close(gw, want["weight"], rtol=0, atol=0, msg=f"{name}, step {k}: dw")
        torch.testing.assert_close(between[0], want_between, rtol=0, atol=0)
        (last,) = (s.last for (c, *_), s in _function_split._SPLITTERS.items() if c is fn)
        if case.split is None:
            assert isinstance(last, TracedSplit) or last.logged, last
        elif case.split:
            assert isinstance(last, TracedSplit), last
        else:
            assert isinstance(last, Fallback) and last.logged, last


# --------------------------------------------------------------------------------------------
# What runs once, and why, in words a user can act on


def undefined_name(ctx: Any, saved: Any, g: Tensor) -> dict[str, Any]:
    x, w = saved
    return {"x": _gelu_and_grad(g) @ w, "weight": g.mT @ x}  # type: ignore[name-defined]  # noqa: F821


def prints(ctx: Any, saved: Any, g: Tensor) -> dict[str, Any]:
    x, w = saved
    print("backward")
    return {"x": g @ w, "weight": g.mT @ x}


LOG: list[int] = []


def appends(ctx: Any, saved: Any, g: Tensor) -> dict[str, Any]:
    x, w = saved
    LOG.append(1)
    return {"x": g @ w, "weight": g.mT @ x}


def line_of(fn: Callable[..., Any], text: str) -> str:
    """``file:line (`text`)`` of the line of ``fn`` that contains ``text``."""
    lines, first = inspect.getsourcelines(fn)
    (i,) = (i for i, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(fn)}:{first + i} (`{lines[i].strip()}`)"


def run_once_reason(backward: Callable[..., Any]) -> Fallback:
    op = linear_with(backward)
    x = torch.randn(4, 3, dtype=DT, requires_grad=True)
    w = torch.randn(2, 3, dtype=DT, requires_grad=True)
    with contextlib.suppress(NameError):  # run once, as written: it raises its own error
        by_customgrad(op, x, w, torch.randn(4, 2, dtype=DT), lambda: None)
    fallback = op.rules.auto.last  # type: ignore[union-attr]
    assert isinstance(fallback, Fallback)
    return fallback


def test_an_undefined_name_is_said_as_a_name_error_first(
    capsys: pytest.CaptureFixture[str],
) -> None:
    fallback = run_once_reason(undefined_name)
    assert fallback.why == (
        "NameError: name '_gelu_and_grad' is not defined at "
        + line_of(undefined_name, "_gelu_and_grad(g)")
    )
    assert fallback.fix == "define or import '_gelu_and_grad' in the module of the backward"
    # Run once, the backward raises the NameError itself.
    op = linear_with(undefined_name)
    x = torch.randn(4, 3, dtype=DT, requires_grad=True)
    with pytest.raises(NameError, match=re.escape("name '_gelu_and_grad' is not defined")):
        op(x, torch.randn(2, 3, dtype=DT)).sum().backward()


def test_asking_whether_dynamo_compiles_runs_once_with_that_reason() -> None:
    fallback = run_once_reason(CASES["is_compiling through an alias"].backward)
    assert (fallback.why, fallback.fix) == (
        "it asks whether dynamo is compiling (torch.compiler.is_compiling(), "
        "torch._dynamo.is_compiling()), which is True while dynamo captures it and False when "
        "it is called, so a capture would not compute what a call does",
        "decide it outside the backward (in the forward, saved as a plain value with "
        "save_for_backward), or drop the check",
    )


def test_print_and_side_effects_run_once_with_the_line_or_what_changed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    fallback = run_once_reason(prints)
    assert fallback.why == (
        "dynamo cannot capture it at " + line_of(prints, 'print("backward")') + ": Dynamo does "
        "not know how to trace builtin operator `print` with argument types ['str'] "
        "(has_kwargs False)"
    )
    assert capsys.readouterr().out == "backward\n"  # once: run as written
    LOG.clear()
    fallback = run_once_reason(appends)
    assert fallback.why.startswith("it changes state outside itself (")
    assert "LOG" in fallback.why
    assert LOG == [1]  # appended once, by the one call


def test_a_guard_failing_every_step_recaptures_up_to_the_limit_then_runs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    op = linear_with(scaled(lambda ctx, x: OPTIMIZER.param_groups[0]["lr"]))
    auto = op.rules.auto
    assert isinstance(auto, AutoSplitter)
    try:
        for k in range(RECAPTURES + 2):
            optimizer_lr(k)  # a new learning rate each step: a new capture each
            x = torch.randn(4, 3, dtype=DT, requires_grad=True)
            w = torch.randn(2, 3, dtype=DT, requires_grad=True)
            g = torch.randn(4, 2, dtype=DT)
            want = reference(op, op.rules.backward, x, w, g)  # type: ignore[arg-type]
            gx, gw = by_customgrad(op, x, w, g, lambda: None)
            torch.testing.assert_close((gx, gw), want, rtol=0, atol=0)
    finally:
        optimizer_lr(0)
    assert auto.traces == RECAPTURES
    fallback = auto.last
    assert isinstance(fallback, Fallback)
    assert fallback.why == (
        f"what it reads changed {RECAPTURES} times (dynamo's guards failed: a global rebound, a "
        f"flag flipped, an object's or ctx's field set; the latest: "
        f"`tests.test_trace_guard.OPTIMIZER.param_groups[0]['lr'] == {RECAPTURES:.1f}` no longer "
        f"holds), and each change needs a new capture"
    )
    messages = [r.getMessage() for r in caplog.records if r.name == "customgrad"]
    assert len(messages) == 1 and fallback.why in messages[0]


def test_captures_are_apart_from_the_users_torch_compile() -> None:
    """customgrad's captures have their own code objects: the user's compiled function of the
    same backward compiles, guards and recompiles as without customgrad, and no
    ``torch._dynamo.reset()`` is needed between them."""
    backward = scaled(lambda ctx, x: OPTIMIZER.param_groups[0]["lr"])
    op = linear_with(backward)
    compiled = torch.compile(backward, backend="eager", fullgraph=True)
    x, w = torch.randn(4, 3, dtype=DT), torch.randn(2, 3, dtype=DT)
    g = torch.randn(4, 2, dtype=DT)
    try:
        for k in (0, 1, 0):
            optimizer_lr(k)
            mine = compiled(None, (x, w), g)
            leaf = x.clone().requires_grad_()
            gx, _ = by_customgrad(op, leaf, w.clone().requires_grad_(), g, lambda: None)
            torch.testing.assert_close(mine["x"], g @ w * (k + 1))
            torch.testing.assert_close(gx, mine["x"])
    finally:
        optimizer_lr(0)
    assert op.rules.auto.traces == 2  # type: ignore[union-attr]


def test_a_capture_is_reused_under_a_flop_counter_or_another_dispatch_mode() -> None:
    """A dispatch mode adds the Python key to every tensor's dispatch keys, which dynamo's
    tensor guards compare: the check runs as the capture did, without the modes."""
    from torch.utils.flop_counter import FlopCounterMode

    op = linear_with(scaled(lambda ctx, x: 2.0))
    for _ in range(3):
        x = torch.randn(4, 3, dtype=DT, requires_grad=True)
        w = torch.randn(2, 3, dtype=DT, requires_grad=True)
        out = op(x, w)
        g = torch.ones(4, 2, dtype=DT)
        with FlopCounterMode(display=False) as counter:  # the passes that run the capture
            torch.autograd.grad(out, [x], g, retain_graph=True)
            torch.autograd.grad(out, [w], g)
        assert counter.get_total_flops() == 2 * (2 * 4 * 2 * 3)
    assert op.rules.auto.traces == 1  # type: ignore[union-attr]


# --------------------------------------------------------------------------------------------
# Never twice: where torch.compile is off, a capture never runs the backward


KERNEL_CALLS: collections.Counter[str] = collections.Counter()


@torch.library.custom_op("test_trace_guard::counted_mm", mutates_args=())
def counted_mm(a: Tensor, b: Tensor) -> Tensor:
    """A matmul kernel that counts its calls (a capture sees its fake kernel, not this)."""
    KERNEL_CALLS["mm"] += 1
    return a @ b


@counted_mm.register_fake
def _(a: Tensor, b: Tensor) -> Tensor:
    return a.new_empty(a.shape[0], b.shape[1])


def counted(ctx: Any, saved: Any, g: Tensor) -> dict[str, Any]:
    x, w = saved
    return {"x": counted_mm(g, w), "weight": counted_mm(g.mT, x)}


@contextlib.contextmanager
def compile_off(how: str) -> Iterator[None]:
    if how == "force_eager":
        with torch.compiler.set_stance("force_eager"):
            yield
    else:
        with torch._dynamo.config.patch(disable=True):
            yield


def split_with(kind: str, backward: Callable[..., Any]) -> tuple[Any, Callable[[], Any]]:
    """An op or a plain Function with ``backward``, and what its latest split found."""
    if kind == "op":
        op = linear_with(backward)
        return op, lambda: op.rules.auto.last  # type: ignore[union-attr]
    STATE["op"] = None
    fn = function_with(backward)

    def last() -> Any:
        (found,) = (s.last for (c, *_), s in _function_split._SPLITTERS.items() if c is fn)
        return found

    return fn.apply, last


@pytest.mark.parametrize("off", ["force_eager", "config.disable"])
@pytest.mark.parametrize("kind", ["op", "function"])
def test_with_torch_compile_off_the_backward_runs_once_and_splits_once_it_is_on(
    kind: str, off: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Under ``set_stance("force_eager")`` or ``torch._dynamo.config.disable`` the capture does
    not run the backward eagerly (then again as the fallback): its kernels run once per
    backward, 2 calls, and the reason is not kept, so it splits once torch.compile runs."""
    caplog.set_level(logging.INFO, logger="customgrad")
    apply, last = split_with(kind, counted)
    x = torch.randn(4, 3, dtype=DT, requires_grad=True)
    w = torch.randn(2, 3, dtype=DT, requires_grad=True)
    g = torch.randn(4, 2, dtype=DT)
    for step in ("off", "off again", "on"):
        KERNEL_CALLS.clear()
        with compile_off(off) if step != "on" else contextlib.nullcontext():
            gx, gw = by_customgrad(apply, x, w, g, lambda: None)
        assert KERNEL_CALLS["mm"] == 2, step
        torch.testing.assert_close((gx, gw), (g @ w, g.mT @ x), rtol=0, atol=0)
        w.grad = None
        found = last()
        if step == "on":
            assert isinstance(found, TracedSplit), found
        else:
            assert found.why == (
                "torch.compile is off here (torch.compiler.set_stance('force_eager'), "
                "torch._dynamo.config.disable or TORCHDYNAMO_DISABLE=1), so dynamo cannot "
                "capture it; it is captured again once torch.compile runs"
            )
    messages = [r.getMessage() for r in caplog.records if r.name == "customgrad"]
    assert sum("torch.compile is off here" in m for m in messages) == 1, messages


def test_with_torchdynamo_disable_in_the_environment_the_backward_runs_once() -> None:
    """``TORCHDYNAMO_DISABLE=1``: an op's and a plain Function's backward run once each, their
    kernels 2 calls each (a fresh process: the variable is read at import)."""
    script = """
import torch
import tests.test_trace_guard as t
x = torch.randn(4, 3, dtype=t.DT, requires_grad=True)
w = torch.randn(2, 3, dtype=t.DT, requires_grad=True)
g = torch.randn(4, 2, dtype=t.DT)
for kind in ("op", "function"):
    apply, last = t.split_with(kind, t.counted)
    t.KERNEL_CALLS.clear()
    gx, gw = t.by_customgrad(apply, x, w, g, lambda: None)
    torch.testing.assert_close((gx, gw), (g @ w, g.mT @ x), rtol=0, atol=0)
    w.grad = None
    print(kind, t.KERNEL_CALLS["mm"], "torch.compile is off here" in last().why)
"""
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-3:-1] == ["op 2 True", "function 2 True"], done.stdout
