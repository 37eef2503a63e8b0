"""torch's saved-tensor rule across the split: a tensor the weight pass (W) reads of what the
input pass (I) had (a saved tensor, an output gradient, a value I kept), written in place between
the passes, raises customgrad's error on every path, as torch's version counter does for a plain
backward; untouched, the split gives plain autograd's gradients.

The repro of issue 39: ``h = torch.tanh(x); y = op(h, w)``, I, ``h.mul_(2)``, W.
"""

from __future__ import annotations

import gc
import itertools
import re
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.pipelining import ScheduleZBVZeroBubble
from torch.distributed.pipelining.schedules import _Action

import customgrad as cg
import customgrad.pipelining as cgp
from customgrad.pipelining import stage_backward_input, stage_backward_weight

DT = torch.float64
_ids = itertools.count()
CALLS = {"n": 0}


def _lin(kind: str) -> Callable[[Tensor, Tensor], Tensor]:
    """``h @ w.mT`` written as ``kind``: a customgrad op (the pair, shared work, a single
    backward split automatically, or one that runs once) or a plain ``autograd.Function``
    (split in the stage, or run once there)."""
    if kind.startswith("function"):
        once = kind == "function_once"

        class Lin(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, h: Tensor, w: Tensor) -> Tensor:
                ctx.save_for_backward(h, w)
                return h @ w.mT

            @staticmethod
            def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor]:
                h, w = ctx.saved_tensors
                if once:
                    CALLS["n"] += 1  # a side effect: not captured, runs once
                return g @ w, g.mT @ h

        return Lin.apply  # type: ignore[no-any-return]

    @cg.op(f"test_kept_versions{next(_ids)}::lin", weights=("w",))
    def lin(h: Tensor, w: Tensor) -> Tensor:
        return h @ w.mT

    lin.register_fake(lambda h, w: h.new_empty(h.shape[0], w.shape[0]))
    lin.register_save_for_backward(lambda i, o: (i.h, i.w))
    if kind == "pair":
        lin.register_backward_input(lambda ctx, s, g: {"h": g @ s[1]})
        lin.register_backward_weight(lambda ctx, s, g: {"w": g.mT @ s[0]})
    elif kind == "shared":
        lin.register_backward_shared(lambda ctx, s, g: g * 1.0)
        lin.register_backward_input(lambda ctx, s, g: {"h": ctx.shared @ s[1]})
        lin.register_backward_weight(lambda ctx, s, g: {"w": ctx.shared.mT @ s[0]})
    elif kind == "auto":
        lin.register_backward(lambda ctx, s, g: {"h": g @ s[1], "w": g.mT @ s[0]})
    else:

        def once(ctx: cg.BackwardContext, s: Any, g: Tensor) -> dict[str, Tensor]:
            CALLS["n"] += 1  # a side effect: not captured, runs once
            return {"h": g @ s[1], "w": g.mT @ s[0]}

        lin.register_backward(once)
    return lin


class Compiled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 4, dtype=DT))

    def forward(self, h: Tensor) -> Tensor:
        return torch.sin(h) @ self.w.mT


@pytest.fixture(scope="module")
def compiled() -> Compiled:
    """One compiled region for the module's tests (a compile costs seconds)."""
    torch.manual_seed(3)
    return cg.compile(Compiled())


OPS = ["pair", "shared", "auto", "run_once"]
KINDS = [*OPS, "compiled", "function_split", "function_once"]
WHAT = {
    "pair": "saved tensor 0 (argument 'h')",
    "shared": "saved tensor 0 (argument 'h')",
    "auto": "saved tensor 0 (argument 'h')",
    "run_once": "saved tensor 0 (argument 'h')",
    "compiled": "the region's input 'h'",
    "function_split": "saved tensor 0 (argument 'h')",
    "function_once": "saved tensor 0 (argument 'h')",
}


def _stage(kind: str, compiled: Compiled | None) -> tuple[Callable[[Tensor], Tensor], Tensor]:
    """The stage's function of ``h`` and its weight."""
    if kind == "compiled":
        assert compiled is not None
        compiled.w.grad = None
        return compiled, compiled.w
    torch.manual_seed(3)
    w = torch.randn(5, 4, dtype=DT, requires_grad=True)
    f = _lin(kind)
    return (lambda h: f(h, w)), w


def _passes(
    path: str, f: Callable[[Tensor], Tensor], w: Tensor, between: Callable[[], None]
) -> None:
    """I, then ``between()``, then W, through ``path``: customgrad's drop-ins or the queue."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, dtype=DT, requires_grad=True)
    h = torch.tanh(x)
    _passes.h = h  # type: ignore[attr-defined]  # for ``between``
    if path == "queue":
        queue = cgp.WeightGradQueue()
        with queue.microbatch(0, 0):
            y = f(h)
        queue.backward(y, torch.ones_like(y), inputs=[x])
        between()
        queue.run(0, 0)
        queue.finish()
        return
    y = f(h)
    _, groups = stage_backward_input([y], [torch.ones_like(y)], [x], [w])
    between()
    stage_backward_weight([w], groups)


PATHS = [*((k, "stage_backward") for k in KINDS), *((k, "queue") for k in OPS)]


@pytest.mark.parametrize(("kind", "path"), PATHS)
def test_a_saved_input_written_between_the_passes_raises(
    kind: str, path: str, request: pytest.FixtureRequest
) -> None:
    f, w = _stage(kind, request.getfixturevalue("compiled") if kind == "compiled" else None)

    def scale() -> None:
        with torch.no_grad():
            _passes.h.mul_(2)  # type: ignore[attr-defined]

    with pytest.raises(cg.ModifiedBetweenPassesError, match=re.escape(WHAT[kind])) as e:
        _passes(path, f, w, scale)
    assert isinstance(e.value, RuntimeError)  # as torch's own error is
    assert "it is at version 1; expected version 0 instead" in str(e.value)


@pytest.mark.parametrize(("kind", "path"), PATHS)
def test_untouched_the_split_gives_plain_autograd_s_gradients(
    kind: str, path: str, request: pytest.FixtureRequest
) -> None:
    f, w = _stage(kind, request.getfixturevalue("compiled") if kind == "compiled" else None)
    _passes(path, f, w, lambda: None)
    torch.manual_seed(0)
    x = torch.randn(3, 4, dtype=DT, requires_grad=True)
    h = torch.tanh(x)
    ref = w.detach().clone().requires_grad_()
    mid = torch.sin(h) if kind == "compiled" else h
    (mid @ ref.mT).sum().backward()
    torch.testing.assert_close(w.grad, ref.grad)


@pytest.mark.parametrize("kind", ["pair", "auto", "run_once"])
def test_an_output_gradient_written_between_the_passes_raises(kind: str) -> None:
    f, w = _stage(kind, None)
    torch.manual_seed(0)
    h = torch.randn(3, 4, dtype=DT, requires_grad=True)
    y = f(h)
    g = torch.ones_like(y)
    _, groups = stage_backward_input([y], [g], [h], [w])
    g.mul_(3)  # a reused receive buffer, written before W
    with pytest.raises(cg.ModifiedBetweenPassesError, match=re.escape("the gradient of output 0")):
        stage_backward_weight([w], groups)


class _Buffered(nn.Module):
    """A layer whose op reads a buffer each forward overwrites (a static buffer, a cache)."""

    def __init__(self, lin: Callable[[Tensor, Tensor], Tensor]) -> None:
        super().__init__()
        self.lin = lin
        self.w = nn.Parameter(torch.randn(4, 4, dtype=DT))
        self.register_buffer("buf", torch.zeros(2, 4, dtype=DT))

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            self.buf.copy_(x)  # the next microbatch's forward overwrites what this op saved
        return self.lin(self.buf, self.w) + x


@pytest.mark.parametrize("queue", [False, True], ids=["drop-ins", "queue"])
def test_a_later_microbatch_overwriting_a_saved_buffer_raises_in_the_pipeline_stage(
    group: None, queue: bool
) -> None:
    mods = [nn.Linear(4, 4, dtype=DT), _Buffered(_lin("pair"))]
    q = cgp.WeightGradQueue() if queue else None
    stages = [cgp.PipelineStage(m, i, 2, torch.device("cpu"), queue=q) for i, m in enumerate(mods)]
    schedule = ScheduleZBVZeroBubble(
        stages, n_microbatches=2, loss_fn=lambda a, b: ((a - b) ** 2).sum()
    )
    # microbatch 1's forward runs between microbatch 0's I and W on stage 1
    order = ["0F0", "1F0", "1I0", "0I0", "0F1", "1F1", "1I1", "0I1", "1W0", "0W0", "1W1", "0W1"]
    schedule._prepare_schedule_with_comms({0: [_Action.from_str(a) for a in order]})
    with pytest.raises(cg.ModifiedBetweenPassesError, match=re.escape("saved tensor 0, which")):
        schedule.step(torch.randn(4, 4, dtype=DT), target=torch.randn(4, 4, dtype=DT))


class _Scale(torch.autograd.Function):
    """``x * w``, with ``w`` kept on ctx, not saved."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        ctx.w = w
        return x * w

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor]:
        (x,) = ctx.saved_tensors
        return g * ctx.w, g * x


def _weight(how: str, w0: Tensor) -> Tensor:
    if how == "parameter":
        return nn.Parameter(w0.clone())
    leaf = w0.clone().requires_grad_()
    return leaf if how == "leaf" else leaf * 1.0


@pytest.mark.parametrize("how", ["parameter", "leaf", "non-leaf"])
def test_a_weight_kept_on_ctx_and_scaled_before_backward_gets_plain_autograd_s_gradients(
    how: str,
) -> None:
    op = cg.from_function(_Scale, f"test_kept_versions{next(_ids)}::scale", weights=("w",))
    torch.manual_seed(0)
    x0, w0 = torch.randn(4, dtype=DT), torch.randn(4, dtype=DT)
    grads = []
    for f in (op, _Scale.apply):
        x = x0.clone().requires_grad_()
        w = _weight(how, w0)
        y = f(x, w)
        with torch.no_grad():
            w.mul_(3)
        y.sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1])
    torch.testing.assert_close(grads[0], 3 * w0)


def _refused(how: str) -> Callable[..., Any]:
    """A backward dynamo refuses, ``how``: its traceback's frames hold the capture's tensors."""

    def backward(ctx: Any, s: Any, g: Tensor) -> dict[str, Tensor]:
        if how == "graph break":
            torch._dynamo.graph_break()
        else:
            print(end="")  # dynamo cannot trace print with keywords
        return {"x": g @ s[1], "w": g.mT @ s[0]}

    return backward


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("how", ["graph break", "print"])
def test_a_refused_backward_s_input_pass_without_w_leaves_no_cycle(
    no_cyclic_gc: None, how: str
) -> None:
    @cg.op(f"test_kept_versions{next(_ids)}::lin", weights=("w",))
    def lin(x: Tensor, w: Tensor) -> Tensor:
        return x @ w.mT

    lin.register_fake(lambda x, w: x.new_empty(x.shape[0], w.shape[0]))
    lin.register_save_for_backward(lambda i, o: (i.x, i.w))
    lin.register_backward(_refused(how))
    w = torch.randn(5, 3, dtype=DT, requires_grad=True)
    for _ in range(2):  # the first I captures (and is refused), the second runs once as known
        x = torch.randn(4, 3, dtype=DT, requires_grad=True)
        g = torch.ones(4, 5, dtype=DT)
        y = lin(x, w)
        alive = [weakref.ref(x), weakref.ref(g), weakref.ref(y.grad_fn)]  # type: ignore[arg-type]
        result = stage_backward_input([y], [g], [x], [w])  # I, never W
        del x, g, y, result
        assert [r() is None for r in alive] == [True, True, True]


def test_a_plain_function_refused_in_the_stage_leaves_no_cycle(no_cyclic_gc: None) -> None:
    refused = _refused("print")

    class Lin(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
            ctx.save_for_backward(x, w)
            return x @ w.mT

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor]:
            got = refused(ctx, ctx.saved_tensors, g)
            return got["x"], got["w"]

    w = torch.randn(5, 3, dtype=DT, requires_grad=True)
    x = torch.randn(4, 3, dtype=DT, requires_grad=True)
    g = torch.ones(4, 5, dtype=DT)
    y = torch.tanh(Lin.apply(x, w))
    alive = [weakref.ref(x), weakref.ref(g)]
    result = stage_backward_input([y], [g], [x], [w])
    del x, g, y, result
    assert [r() is None for r in alive] == [True, True]


class _WritesItsBuffer(torch.autograd.Function):
    """``x * w``; its backward writes into a buffer its forward made and saved (as fused kernels
    that reuse their own saved buffers do): a write during I, not between the passes."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        buf = x.detach().clone()
        ctx.save_for_backward(buf, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor]:
        buf, w = ctx.saved_tensors
        dw = (g * buf).sum(0)
        buf.mul_(0)  # done with it: the kernel reuses its buffer
        CALLS["n"] += 1  # a side effect: it runs once, in I
        return g * w, dw


def test_what_a_backward_writes_during_the_input_pass_does_not_trip_the_check() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4, dtype=DT, requires_grad=True)
    w = torch.randn(4, dtype=DT, requires_grad=True)
    y = _WritesItsBuffer.apply(torch.tanh(x), w)
    _, groups = stage_backward_input([y], [torch.ones_like(y)], [x], [w])
    stage_backward_weight([w], groups)
    torch.testing.assert_close(w.grad, torch.tanh(x).detach().sum(0))
