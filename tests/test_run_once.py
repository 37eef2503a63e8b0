"""The run-once rule: a backward that is not split runs once, in the first pass that needs any
of its gradients, and hands the later pass what it needs (issue 24).

Kernels that write into their inputs (Liger-Kernel's default ``in_place=True``: Triton stores,
which no version counter sees) and backwards that scale a gradient precomputed in forward are
exact under torch's and customgrad's split, the weight-gradient queue and a full backward; each
backward runs once per backward call. Also: retained graphs backwarded again with gradients of
other strides, torch's legacy vmap (``is_grads_batched``), and aborted steps.
"""

from __future__ import annotations

import gc
import itertools
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.distributed.pipelining import _backward as torch_backward
from torch.utils.flop_counter import FlopCounterMode

import customgrad as cg
from customgrad._autosplit import AutoSplitter, Fallback
from customgrad._record import record_of
from customgrad.pipelining import stage_backward_input, stage_backward_weight
from tests._skips import GRAPH_FREED_AFTER_I, TORCH_SPLIT

DT = torch.float64
_ids = itertools.count()
CALLS: Counter[str] = Counter()


def unique(name: str) -> str:
    return f"test_run_once{next(_ids)}::{name}"


class InPlaceNorm(torch.autograd.Function):
    """``x * w`` whose backward writes dX into the output gradient's memory, as Liger's RMSNorm
    does with ``in_place=True``: through ``.data`` (like a Triton store, invisible to version
    counters)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        CALLS["norm"] += 1
        x, w = ctx.saved_tensors
        dw = (grad * x).sum(0)
        dx = grad.data  # the kernel writes dX over dY
        dx.mul_(w)
        return dx, dw


class PrecomputedLoss(torch.autograd.Function):
    """A loss whose gradients are computed in forward and scaled by the loss gradient in
    backward, in place (Liger's fused linear + cross-entropy)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        y = x @ w.mT
        ctx.save_for_backward(torch.ones_like(y) @ w, torch.ones_like(y).mT @ x)
        return y.sum()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        CALLS["loss"] += 1
        dx, dw = ctx.saved_tensors
        dx.data.mul_(grad)
        dw.data.mul_(grad)
        return dx, dw


def inputs(seed: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 3, dtype=DT, generator=gen).requires_grad_()
    w = torch.randn(3, dtype=DT, generator=gen).requires_grad_()
    return x, w


def run(how: str, f: Callable[[Tensor, Tensor], Tensor], x: Tensor, w: Tensor, g: Tensor) -> Any:
    out = f(x, w)
    if how == "full":
        return torch.autograd.grad(out, [x, w], g)
    split = {
        "customgrad": (stage_backward_input, stage_backward_weight),
        "torch": (torch_backward.stage_backward_input, torch_backward.stage_backward_weight),
    }
    first, second = split[how]  # fmt: skip
    (gx,), groups = first([out], [g], [x], [w])
    w.grad = None
    second([w], groups)
    return gx, w.grad


@pytest.mark.parametrize("how", ["customgrad", pytest.param("torch", marks=TORCH_SPLIT)])
def test_a_kernel_writing_into_the_output_gradient_runs_once_and_is_exact(how: str) -> None:
    op = cg.from_function(InPlaceNorm, unique("norm"), weights=("w",))
    x, w = inputs()
    want = run("full", lambda a, b: a * b, x, w, torch.full((4, 3), 0.5, dtype=DT))
    CALLS.clear()
    got = run(how, op, x, w, torch.full((4, 3), 0.5, dtype=DT))
    assert CALLS["norm"] == 1  # called once across I and W (called per pass, it ran twice)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert isinstance(op.rules.auto, AutoSplitter)
    assert isinstance(op.rules.auto.last, Fallback)  # reads .data: not traced


@pytest.mark.parametrize("how", ["customgrad", pytest.param("torch", marks=TORCH_SPLIT), "full"])
def test_a_precomputed_gradient_is_scaled_once(how: str) -> None:
    op = cg.from_function(PrecomputedLoss, unique("loss"), weights=("w",))
    x, _ = inputs()
    w = torch.randn(2, 3, dtype=DT, requires_grad=True)
    g = torch.tensor(0.5, dtype=DT)
    want = run("full", lambda a, b: (a @ b.mT).sum(), x, w, g)
    CALLS.clear()
    got = run(how, op, x, w, g)
    assert CALLS["loss"] == 1
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_the_weight_gradient_queue_runs_it_once() -> None:
    from customgrad.pipelining import WeightGradQueue

    op = cg.from_function(InPlaceNorm, unique("norm"), weights=("w",))
    x, w = inputs()
    want = run("full", lambda a, b: a * b, x, w, torch.ones(4, 3, dtype=DT))
    queue = WeightGradQueue()
    CALLS.clear()
    with queue.microbatch(stage=0, microbatch=0):
        out = op(x, w)
    queue.backward(out, torch.ones(4, 3, dtype=DT), inputs=[x])  # I
    assert w.grad is None
    queue.run(0, 0)  # W
    queue.finish()
    assert CALLS["norm"] == 1
    torch.testing.assert_close(x.grad, want[0])
    torch.testing.assert_close(w.grad, want[1])


@TORCH_SPLIT
def test_what_runs_once_hands_its_weight_gradients_to_w_and_frees_them() -> None:
    op = cg.from_function(InPlaceNorm, unique("norm"), weights=("w",))
    x, w = inputs()
    out = op(x, w)
    record = record_of(out.grad_fn)
    assert record is not None
    g = torch.ones(4, 3, dtype=DT)
    _, groups = torch_backward.stage_backward_input([out], [g], [x], [w])
    assert record.handoff is not None and record.handoff.kind == "gradients"
    assert set(record.handoff.value) == {"w"}
    torch_backward.stage_backward_weight([w], groups)
    assert record.handoff is None


def test_another_loss_through_the_same_node_never_reads_the_hand_off() -> None:
    op = cg.from_function(InPlaceNorm, unique("norm"), weights=("w",))
    x, w = inputs()
    out = op(x, w)
    g1, g2 = torch.ones(4, 3, dtype=DT), torch.full((4, 3), 2.0, dtype=DT)
    torch.autograd.grad(out, [x], g1.clone(), retain_graph=True)  # I of the first loss
    CALLS.clear()
    (gw,) = torch.autograd.grad(out, [w], g2.clone(), retain_graph=True)  # another loss's W
    assert CALLS["norm"] == 1  # computed for its own gradients
    torch.testing.assert_close(gw, (g2 * x).sum(0))


def test_split_phase_still_calls_once_per_pass() -> None:
    calls: list[str] = []

    @cg.op(unique("mul"), weights=("w",))
    def mul(x: Tensor, w: Tensor) -> Tensor:
        return x * w

    mul.register_fake(lambda x, w: torch.empty_like(x))
    mul.register_save_for_backward(lambda i, o: (i.x, i.w))

    @mul.register_backward(split="phase")
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        calls.append(ctx.phase)
        x, w = saved
        return {"x": g * w if ctx.needs_input_grad("x") else None,
                "w": (g * x).sum(0) if ctx.needs_input_grad("w") else None}  # fmt: skip

    x, w = inputs()
    run("customgrad", mul, x, w, torch.ones(4, 3, dtype=DT))
    assert calls == ["input", "weight"]  # asked for: documented repeated work


def test_a_retained_graph_backwarded_with_gradients_of_other_strides() -> None:
    @cg.op(unique("lin"), weights=("weight",))
    def lin(x: Tensor, weight: Tensor) -> Tensor:
        return x @ weight.mT

    lin.register_fake(lambda x, weight: x.new_empty((*x.shape[:-1], weight.shape[0])))
    lin.register_save_for_backward(lambda i, o: (i.x, i.weight))

    @lin.register_backward
    def _(ctx: cg.BackwardContext, saved: Any, g: Tensor) -> dict[str, Any]:
        x, w = saved
        gs = g.view(-1, g.shape[-1]) if g.is_contiguous() else g.reshape(-1, g.shape[-1])
        return {"x": g @ w, "weight": gs.mT @ x.reshape(-1, x.shape[-1])}

    x = torch.randn(2, 4, 3, dtype=DT, requires_grad=True)
    w = torch.randn(5, 3, dtype=DT, requires_grad=True)
    y = lin(x, w)
    y.sum().backward(retain_graph=True)  # stride-0 gradient
    first = (x.grad.clone(), w.grad.clone())  # type: ignore[union-attr]
    g = torch.randn(5, 4, 2, dtype=DT).permute(2, 1, 0)  # then a permuted one
    x.grad = w.grad = None
    y.backward(g)
    torch.testing.assert_close(x.grad, g @ w.detach())
    torch.testing.assert_close(w.grad, g.reshape(-1, 5).mT @ x.detach().reshape(-1, 3))
    assert first[0].shape == x.shape


def test_legacy_vmap_of_a_traced_backward() -> None:
    @cg.op(unique("lin"), weights=("weight",))
    def lin(x: Tensor, weight: Tensor) -> Tensor:
        return x @ weight.mT

    lin.register_fake(lambda x, weight: x.new_empty((*x.shape[:-1], weight.shape[0])))
    lin.register_save_for_backward(lambda i, o: (i.x, i.weight))
    lin.register_backward(lambda ctx, saved, g: {"x": g @ saved[1], "weight": g.mT @ saved[0]})
    x = torch.randn(4, 3, dtype=DT, requires_grad=True)
    w = torch.randn(5, 3, dtype=DT, requires_grad=True)
    v = torch.randn(3, 4, 5, dtype=DT)
    gx, gw = torch.autograd.grad(lin(x, w), [x, w], v, is_grads_batched=True)
    torch.testing.assert_close(gx, v @ w.detach())
    torch.testing.assert_close(gw, v.mT @ x.detach())
    jx, jw = torch.autograd.functional.jacobian(lin, (x, w), vectorize=True)
    want = torch.autograd.functional.jacobian(lambda a, b: a @ b.mT, (x, w))
    torch.testing.assert_close(jx, want[0])
    torch.testing.assert_close(jw, want[1])


def _counted_backward(ctx: cg.BackwardContext, s: Any, g: Tensor) -> dict[str, Tensor]:
    """A single backward the tracer refuses (it writes a global): the run-once rule's."""
    CALLS["counted"] += 1
    return {"x": g @ s[1], "weight": g.mT @ s[0]}


@pytest.mark.parametrize(
    "first",
    [
        pytest.param(stage_backward_input, id="customgrad"),
        pytest.param(torch_backward.stage_backward_input, id="torch", marks=TORCH_SPLIT),
    ],
)
@pytest.mark.parametrize("kind", ["traced", "shared", "run_once"])
def test_an_aborted_step_frees_its_nodes_without_the_cyclic_gc(
    kind: str, first: Callable[..., Any]
) -> None:
    @cg.op(unique("lin"), weights=("weight",))
    def lin(x: Tensor, weight: Tensor) -> Tensor:
        return x @ weight.mT

    lin.register_fake(lambda x, weight: x.new_empty((*x.shape[:-1], weight.shape[0])))
    lin.register_save_for_backward(lambda i, o: (i.x, i.weight))
    if kind == "traced":
        lin.register_backward(lambda ctx, s, g: {"x": g @ s[1], "weight": g.mT @ s[0]})
    elif kind == "run_once":
        lin.register_backward(_counted_backward)  # reads a global: not traced, runs once
    else:
        lin.register_backward_shared(lambda ctx, s, g: g * 1.0)
        lin.register_backward_input(lambda ctx, s, g: {"x": ctx.shared @ s[1]})
        lin.register_backward_weight(lambda ctx, s, g: {"weight": ctx.shared.mT @ s[0]})
    gc.collect()
    gc.disable()
    try:
        x = torch.randn(4, 3, dtype=DT, requires_grad=True)
        w = torch.randn(5, 3, dtype=DT, requires_grad=True)
        y = lin(x, w)
        node = weakref.ref(y.grad_fn)  # type: ignore[arg-type]
        saved = weakref.ref(x)
        result = first([y], [torch.ones(4, 5, dtype=DT)], [x], [w])  # I, never W
        del y, result, x
        assert node() is None
        assert saved() is None
    finally:
        gc.enable()


def test_summary_and_explain_split_say_it_runs_once_and_what_it_held() -> None:
    name = unique("norm")
    op = cg.from_function(InPlaceNorm, name, weights=("w",))
    x, w = inputs()
    run("customgrad", op, x, w, torch.ones(4, 3, dtype=DT))
    (row,) = [r for r in cg.summary(name.split("::")[0]).ops if r.op == name]
    assert row.split == "run once"
    assert "runs once, whole, in the first pass that needs a gradient, 24 bytes held" in row.detail
    out = op(x, w)
    from customgrad.graph import explain_split

    info = explain_split([out], [x], [w])
    (node,) = [n for n in info.nodes if n.auto_split is not None]
    assert node.auto_split.endswith("(24 bytes held between the passes at the latest split)")


@pytest.mark.parametrize("kind", ["traced", "run_once"])
def test_a_gradient_written_to_between_the_passes_is_another_pass(kind: str) -> None:
    @cg.op(unique("lin"), weights=("weight",))
    def lin(x: Tensor, weight: Tensor) -> Tensor:
        return x @ weight.mT

    lin.register_fake(lambda x, weight: x.new_empty((*x.shape[:-1], weight.shape[0])))
    lin.register_save_for_backward(lambda i, o: (i.x, i.weight))
    if kind == "traced":  # g * 1.0 is shared by both gradients: computed in I, handed to W
        lin.register_backward(
            lambda ctx, s, g: {"x": (g * 1.0) @ s[1], "weight": (g * 1.0).mT @ s[0]}
        )
    else:
        lin.register_backward(_counted_backward)  # reads a global: not traced, runs once
    x = torch.randn(4, 3, dtype=DT, requires_grad=True)
    w = torch.randn(5, 3, dtype=DT, requires_grad=True)
    out = lin(x, w)
    g = torch.randn(4, 5, dtype=DT)
    torch.autograd.grad(out, [x], g, retain_graph=True)  # I
    record = record_of(out.grad_fn)
    assert record is not None and record.handoff is not None
    assert record.handoff.kind == ("kept" if kind == "traced" else "gradients")
    g.mul_(2)  # the same tensor, written to: another pass's gradients
    (gw,) = torch.autograd.grad(out, [w], g)
    torch.testing.assert_close(gw, g.mT @ x.detach())


# --------------------------------------------------- each hand-off kind, really taken (item 5)


def _lin_op(kind: str) -> Any:
    """``x @ w.mT`` whose backward takes the hand-off ``kind``: "shared" (a pair with shared
    work), "traced" (one backward, traced and split), "gradients" (one backward the tracer
    refuses: it writes through ``.data``, so it runs once and hands its weight gradient on)."""
    if kind == "gradients":

        class InPlaceLinear(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
                ctx.save_for_backward(x, w)
                return x @ w.mT

            @staticmethod
            def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
                CALLS["lin"] += 1
                x, w = ctx.saved_tensors
                dw = grad.mT @ x
                grad.data.mul_(1.0)  # a write the tracer refuses (as a Triton store would be)
                return grad @ w, dw

        return cg.from_function(InPlaceLinear, unique("lin"), weights=("w",))

    @cg.op(unique("lin"), weights=("w",))
    def lin(x: Tensor, w: Tensor) -> Tensor:
        return x @ w.mT

    lin.register_fake(lambda x, w: x.new_empty((*x.shape[:-1], w.shape[0])))
    lin.register_save_for_backward(lambda i, o: (i.x, i.w, torch.eye(5, dtype=DT)))
    if kind == "traced":  # g @ eye is shared by both gradients: computed in I, handed to W
        # (no call counter here: reading one would stop the trace; W's FLOPs tell instead)
        lin.register_backward(lambda ctx, s, g: {"x": (g @ s[2]) @ s[1], "w": (g @ s[2]).mT @ s[0]})
    else:

        def shared(ctx: cg.BackwardContext, s: Any, g: Tensor) -> Tensor:
            CALLS["lin"] += 1
            return g * 1.0

        lin.register_backward_shared(shared)
        lin.register_backward_input(lambda ctx, s, g: {"x": ctx.shared @ s[1]})
        lin.register_backward_weight(lambda ctx, s, g: {"w": ctx.shared.mT @ s[0]})
    return lin


KINDS = ["shared", "traced", "gradients"]  # traced: a capture
KIND = {"shared": "shared", "traced": "kept", "gradients": "gradients"}  # the HandOff's kind


@pytest.mark.parametrize("kind", KINDS)
def test_each_hand_off_kind_is_taken_once_and_freed(kind: str) -> None:
    op = _lin_op(kind)
    x = torch.randn(4, 3, dtype=DT, requires_grad=True)
    w = torch.randn(5, 3, dtype=DT, requires_grad=True)
    out = op(x, w)
    record = record_of(out.grad_fn)
    assert record is not None
    g = torch.randn(4, 5, dtype=DT)
    CALLS.clear()
    (gx,) = torch.autograd.grad(out, [x], g, retain_graph=True)  # I
    handoff = record.handoff
    assert handoff is not None and handoff.kind == KIND[kind]  # this path, and no other
    held = [weakref.ref(t) for t in _tensors(handoff.value)]
    assert held
    del handoff
    with FlopCounterMode(display=False) as flops:
        (gw,) = torch.autograd.grad(out, [w], g)  # W reads it
    # the shared work, the traced part it keeps, the backward: once
    if kind == "traced":
        assert flops.get_total_flops() == 2 * 4 * 5 * 3  # dW's matmul only: g @ eye was kept
    else:
        assert CALLS["lin"] == 1
    torch.testing.assert_close(gx, g @ w.detach())
    torch.testing.assert_close(gw, g.mT @ x.detach())
    assert record.handoff is None
    del gx, gw  # W's result may be what was handed over (run once: the weight gradient)
    assert all(r() is None for r in held)  # what it held is freed with it


@pytest.mark.parametrize("kind", KINDS)
def test_each_hand_off_kind_refuses_gradients_changed_between_the_passes(kind: str) -> None:
    op = _lin_op(kind)
    x = torch.randn(4, 3, dtype=DT, requires_grad=True)
    w = torch.randn(5, 3, dtype=DT, requires_grad=True)
    out = op(x, w)
    record = record_of(out.grad_fn)
    assert record is not None
    g = torch.randn(4, 5, dtype=DT)
    torch.autograd.grad(out, [x], g, retain_graph=True)  # I
    assert record.handoff is not None and record.handoff.kind == KIND[kind]
    g.mul_(2)  # the same tensor, written to: another pass's gradients
    CALLS.clear()
    with FlopCounterMode(display=False) as flops:
        (gw,) = torch.autograd.grad(out, [w], g)
    # computed again for the new gradients, not read from I
    if kind == "traced":
        assert flops.get_total_flops() == 2 * 4 * 5 * 3 + 2 * 4 * 5 * 5  # g @ eye again
    else:
        assert CALLS["lin"] == 1
    torch.testing.assert_close(gw, g.mT @ x.detach())


@pytest.mark.parametrize("kind", KINDS)
def test_a_hand_off_holds_no_output_gradient_alive(kind: str) -> None:
    op = _lin_op(kind)
    x = torch.randn(4, 3, dtype=DT, requires_grad=True)
    w = torch.randn(5, 3, dtype=DT, requires_grad=True)
    out = op(x, w)
    record = record_of(out.grad_fn)
    assert record is not None
    g = torch.randn(4, 5, dtype=DT)
    torch.autograd.grad(out, [x], g, retain_graph=True)  # I
    assert record.handoff is not None and record.handoff.kind == KIND[kind]
    gone = weakref.ref(g)
    del g
    assert gone() is None  # the record keeps a weak reference and a version, not the tensor


def _tensors(value: Any) -> list[Tensor]:
    import optree

    return [t for t in optree.tree_leaves(value) if isinstance(t, Tensor)]


@GRAPH_FREED_AFTER_I
def test_a_plain_function_s_hand_off_is_taken_in_w_and_freed() -> None:
    # customgrad's split: a plain Function's weight-side gradients go from I to W (with the
    # edges they go along); W takes them, and nothing of the node outlives I.
    from customgrad._split_plan import STATE_KEY
    from customgrad.pipelining._function_split import FunctionOnce

    x = torch.randn(4, 3, dtype=DT, requires_grad=True)
    w = torch.randn(3, dtype=DT, requires_grad=True)
    out = InPlaceNorm.apply(x * 1.0, w)
    node = weakref.ref(out.grad_fn)
    g = torch.randn(4, 3, dtype=DT)
    want = (g * x.detach()).sum(0)
    CALLS.clear()
    _, groups = stage_backward_input([out], [g.clone()], [x], [w])
    state = groups[0][STATE_KEY]
    (handed,) = [h for hs in state.work.values() for h in hs if isinstance(h, FunctionOnce)]
    assert isinstance(handed, FunctionOnce)  # the weight-side gradients it returned, with edges
    dw = weakref.ref(handed.kept[0][1])
    del handed, out
    assert node() is None  # W needs only the gradients, not the node
    stage_backward_weight([w], groups)
    assert CALLS["norm"] == 1
    torch.testing.assert_close(w.grad, want)
    del groups, state
    assert dw() is w.grad or dw() is None  # handed over as .grad, or freed


def test_a_refused_backward_keeps_no_step_alive() -> None:
    # The tracer's refusal is remembered as its message, not as the exception: raised again,
    # an exception's traceback grows by each call's frames, which held every step's tensors.
    @cg.op(unique("lin"), weights=("weight",))
    def lin(x: Tensor, weight: Tensor) -> Tensor:
        return x @ weight.mT

    lin.register_fake(lambda x, weight: x.new_empty((*x.shape[:-1], weight.shape[0])))
    lin.register_save_for_backward(lambda i, o: (i.x, i.weight))
    lin.register_backward(_counted_backward)
    w = torch.randn(5, 3, dtype=DT, requires_grad=True)
    alive = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(50):
            x = torch.randn(4, 3, dtype=DT, requires_grad=True)
            g = torch.randn(4, 5, dtype=DT)
            lin(x, w).backward(g)
            alive += [weakref.ref(x), weakref.ref(g)]
        del x, g
        assert sum(r() is not None for r in alive) == 0  # flat: nothing of any step is kept
    finally:
        gc.enable()


@pytest.mark.parametrize("kind", ["traced", "shared"])
def test_a_list_output_s_gradient_written_to_between_the_passes_is_another_pass(
    kind: str,
) -> None:
    # Each output gradient of a list output is matched by identity and version: written in
    # place between the passes, it makes W another pass (which computes from its own), never
    # one that reads what I kept from the old values (a stale dW).
    @cg.op(unique("two"), weights=("weight",))
    def two(x: Tensor, weight: Tensor) -> list[Tensor]:
        y = x @ weight.mT
        return [y, y * 2]

    two.register_fake(lambda x, weight: [x.new_empty(x.shape[0], weight.shape[0])] * 2)
    two.register_save_for_backward(lambda i, o: (i.x, i.weight))
    if kind == "traced":  # h is shared by both gradients: computed in I, kept for W
        two.register_backward(
            lambda ctx, s, g: {"x": (g[0] + 2 * g[1]) @ s[1], "weight": (g[0] + 2 * g[1]).mT @ s[0]}
        )
    else:
        two.register_backward_shared(lambda ctx, s, g: g[0] + 2 * g[1])
        two.register_backward_input(lambda ctx, s, g: {"x": ctx.shared @ s[1]})
        two.register_backward_weight(lambda ctx, s, g: {"weight": ctx.shared.mT @ s[0]})
    x = torch.randn(4, 3, dtype=DT, requires_grad=True)
    w = torch.randn(5, 3, dtype=DT, requires_grad=True)
    ys = two(x, w)
    gs = [torch.randn(4, 5, dtype=DT), torch.randn(4, 5, dtype=DT)]
    torch.autograd.grad(ys, [x], gs, retain_graph=True)  # I: keeps h
    gs[1].mul_(3)  # one output's gradient, written to: another pass's gradients
    (gw,) = torch.autograd.grad(ys, [w], gs)
    torch.testing.assert_close(gw, (gs[0] + 2 * gs[1]).mT @ x.detach())
