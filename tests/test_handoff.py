"""What the input pass hands to the weight pass belongs to that pass: a pass with other output
gradients never reads it, and it is freed as soon as no later pass can come (no reference
cycle keeps it, or the node, alive until the cyclic GC)."""

from __future__ import annotations

import gc
import itertools
import weakref
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import customgrad as cg
from customgrad._record import record_of

_ids = itertools.count()
DT = torch.float64
STYLES = ["auto", "shared", "from_function"]


def mlp_op(style: str) -> cg.CustomOp[..., torch.Tensor]:
    """``relu(x @ up.mT) @ down.mT``; the hidden gradient is work both halves need."""
    name = f"test_handoff{next(_ids)}::mlp"
    if style == "from_function":

        class Mlp(torch.autograd.Function):
            @staticmethod
            def forward(
                ctx: Any, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor
            ) -> torch.Tensor:
                h = torch.relu(x @ up.mT)
                ctx.save_for_backward(x, up, down, h)
                return h @ down.mT

            @staticmethod
            def backward(ctx: Any, g: torch.Tensor) -> Any:
                x, up, down, h = ctx.saved_tensors
                dh = (g @ down) * (h > 0)
                return dh @ up, dh.mT @ x, g.mT @ h

        return cg.from_function(Mlp, name, weights=("up", "down"))

    @cg.op(name, weights=("up", "down"))
    def mlp(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ up.mT) @ down.mT

    mlp.register_fake(lambda x, up, down: x.new_empty(x.shape[0], down.shape[0]))
    mlp.register_save_for_backward(lambda i, o: (i.x, i.up, i.down, torch.relu(i.x @ i.up.mT)))
    if style == "auto":

        @mlp.register_backward
        def _(ctx: cg.BackwardContext, s: Any, g: torch.Tensor) -> dict[str, Any]:
            x, up, down, h = s
            dh = (g @ down) * (h > 0)
            return {"x": dh @ up, "up": dh.mT @ x, "down": g.mT @ h}

    else:

        @mlp.register_backward_shared
        def _(ctx: cg.BackwardContext, s: Any, g: torch.Tensor) -> torch.Tensor:
            return (g @ s[2]) * (s[3] > 0)

        mlp.register_backward_input(lambda ctx, s, g: {"x": ctx.shared @ s[1]})
        mlp.register_backward_weight(
            lambda ctx, s, g: {"up": ctx.shared.mT @ s[0], "down": g.mT @ s[3]}
        )
    return mlp


def reference(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ up.mT) @ down.mT


def leaves() -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    return tuple(torch.randn(*s, dtype=DT, requires_grad=True) for s in ((6, 4), (5, 4), (3, 5)))


@pytest.mark.parametrize("style", STYLES)
def test_a_weight_pass_of_another_loss_does_not_read_the_input_pass_hand_off(style: str) -> None:
    op = mlp_op(style)
    x, up, down = leaves()
    out = op(x, up, down)
    ref = reference(x, up, down)
    g1 = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, g1, retain_graph=True)  # I of loss 1: keeps a hand-off
    torch.testing.assert_close(gx, torch.autograd.grad(ref, x, g1, retain_graph=True)[0])
    g2 = torch.randn_like(out)
    got = torch.autograd.grad(out, (up, down), g2, retain_graph=True)  # W of loss 2
    torch.testing.assert_close(got, torch.autograd.grad(ref, (up, down), g2, retain_graph=True))
    # loss 1's own weight pass still gets loss 1's gradients
    got = torch.autograd.grad(out, (up, down), g1)
    torch.testing.assert_close(got, torch.autograd.grad(ref, (up, down), g1))


@pytest.mark.parametrize("style", STYLES)
def test_the_weight_pass_of_the_same_gradients_reads_the_hand_off(style: str) -> None:
    op = mlp_op(style)
    x, up, down = leaves()
    out = op(x, up, down)
    g = torch.randn_like(out)
    record = record_of(out.grad_fn)
    assert record is not None
    torch.autograd.grad(out, x, g, retain_graph=True)
    assert record.handoff is not None
    got = torch.autograd.grad(out, (up, down), g)
    assert record.handoff is None  # freed after the weight pass
    torch.testing.assert_close(got, torch.autograd.grad(reference(x, up, down), (up, down), g))


@pytest.mark.parametrize("style", STYLES)
def test_a_non_retaining_input_pass_frees_the_hand_off_at_once(style: str) -> None:
    op = mlp_op(style)
    x, up, down = leaves()
    out = op(x, up, down)  # kept alive: its node (and record) too
    record = record_of(out.grad_fn)
    assert record is not None
    torch.autograd.grad(out, x, torch.randn_like(out))  # no retain_graph: no weight pass can come
    assert record.handoff is None


@pytest.mark.parametrize("style", STYLES)
def test_an_input_pass_without_its_weight_pass_leaves_no_reference_cycle(style: str) -> None:
    op = mlp_op(style)
    x, up, down = leaves()
    # the first backward traces (split="auto") and imports what tracing needs: warm up
    torch.autograd.grad(op(x, up, down).sum(), x)
    gc.collect()
    gc.disable()
    try:
        out = op(x, up, down)
        record = record_of(out.grad_fn)
        assert record is not None
        node = weakref.ref(out.grad_fn)  # type: ignore[arg-type]
        rec = weakref.ref(record)
        del record
        torch.autograd.grad(out.sum(), x, retain_graph=True)
        del out
        assert node() is None and rec() is None  # freed by reference counting alone
    finally:
        gc.enable()


def test_a_non_differentiable_output_does_not_stop_the_hand_off() -> None:
    """Autograd gives a non-differentiable output a new tensor of zeros in each pass: the
    hand-off is still read by the weight pass of the same gradients (shared work done once)."""
    calls: list[str] = []

    @cg.op(
        f"test_handoff{next(_ids)}::scale_and_max",
        weights=("w",),
        output_differentiability=(True, False),
    )
    def scale_and_max(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * w
        return y, y.amax()

    scale_and_max.register_fake(lambda x, w: (torch.empty_like(x), x.new_empty(())))
    scale_and_max.register_save_for_backward(lambda i, o: (i.x, i.w))

    @scale_and_max.register_backward_shared
    def _(ctx: cg.BackwardContext, s: Any, g: torch.Tensor, g_max: torch.Tensor) -> torch.Tensor:
        calls.append("shared")
        return g * 2

    scale_and_max.register_backward_input(lambda ctx, s, g, gm: {"x": ctx.shared * s[1] / 2})
    scale_and_max.register_backward_weight(lambda ctx, s, g, gm: {"w": ctx.shared * s[0] / 2})
    x, w = (torch.randn(4, dtype=DT, requires_grad=True) for _ in range(2))
    y, _ = scale_and_max(x, w)
    g = torch.randn(4, dtype=DT)
    (gx,) = torch.autograd.grad(y, x, g, retain_graph=True)
    (gw,) = torch.autograd.grad(y, w, g)
    assert calls == ["shared"]
    torch.testing.assert_close((gx, gw), (g * w, g * x))


FIRST_TRACE = """
import gc, weakref, torch
import customgrad as cg

gc.disable()
@cg.op("first_trace::lin", weights=("w",))
def lin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.mT
lin.register_fake(lambda x, w: x.new_empty(x.shape[0], w.shape[0]))
lin.register_save_for_backward(lambda i, o: (i.x, i.w))
lin.register_backward(lambda ctx, s, g: {"x": g @ s[1], "w": g.mT @ s[0]})
x = torch.randn(3, 4, requires_grad=True)
w = torch.randn(5, 4, requires_grad=True)
out = lin(x, w)
node = weakref.ref(out.grad_fn)
torch.autograd.grad(out.sum(), x, retain_graph=True)  # the first backward traces
del out
print(node() is None)
"""


def test_the_node_of_the_first_traced_backward_is_freed() -> None:
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-c", FIRST_TRACE], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "True"


def _two_outputs(calls: list[str]) -> Any:
    """``(x * w, x * w * 2)``, both differentiable, with work shared by its two halves."""

    @cg.op(f"test_handoff{next(_ids)}::two", weights=("w",))
    def two(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * w, x * w * 2

    two.register_fake(lambda x, w: (torch.empty_like(x), torch.empty_like(x)))
    two.register_save_for_backward(lambda i, o: (i.x, i.w))

    @two.register_backward_shared
    def _(ctx: cg.BackwardContext, s: Any, g: torch.Tensor, g2: torch.Tensor) -> torch.Tensor:
        calls.append("shared")
        return g + 2 * g2

    two.register_backward_input(lambda ctx, s, g, g2: {"x": ctx.shared * s[1]})
    two.register_backward_weight(lambda ctx, s, g, g2: {"w": ctx.shared * s[0]})
    return two


def test_an_output_no_loss_uses_gets_zeros_each_pass_and_still_matches() -> None:
    # Autograd makes fresh zeros for the unused output in I and again in W: matched as zeros,
    # not by identity, so W reads I's shared work instead of computing it again.
    calls: list[str] = []
    two = _two_outputs(calls)
    x, w = (torch.randn(4, dtype=DT, requires_grad=True) for _ in range(2))
    y, _ = two(x, w)
    g = torch.randn(4, dtype=DT)
    (gx,) = torch.autograd.grad(y, x, g, retain_graph=True)  # I
    (gw,) = torch.autograd.grad(y, w, g)  # W
    assert calls == ["shared"]
    torch.testing.assert_close((gx, gw), (g * w, g * x))


def test_zeros_do_not_match_a_gradient_that_is_not_zero() -> None:
    calls: list[str] = []
    two = _two_outputs(calls)
    x, w = (torch.randn(4, dtype=DT, requires_grad=True) for _ in range(2))
    y, y2 = two(x, w)
    g = torch.randn(4, dtype=DT)
    torch.autograd.grad(y, x, g, retain_graph=True)  # I of a loss on y alone (y2 gets zeros)
    g2 = torch.randn(4, dtype=DT)
    (gw,) = torch.autograd.grad([y, y2], w, [g, g2])  # W of a loss on both
    assert calls == ["shared", "shared"]
    torch.testing.assert_close(gw, (g + 2 * g2) * x)


@pytest.mark.parametrize(  # auto and from_function capture their backward
    "style",
    ["auto", "shared", "from_function"],
)
def test_two_losses_in_torch_s_order_each_find_their_hand_off(style: str) -> None:
    # I(loss 1), I(loss 2), W(loss 1), W(loss 2): one hand-off per pending pass, not one slot
    # (with one, W(loss 1) found loss 2's and computed its shared work again).
    op = mlp_op(style)
    x, up, down = leaves()
    out = op(x, up, down)
    ref = reference(x, up, down)
    record = record_of(out.grad_fn)
    assert record is not None
    g1, g2 = torch.randn_like(out), torch.randn_like(out)
    torch.autograd.grad(out, x, g1, retain_graph=True)
    torch.autograd.grad(out, x, g2, retain_graph=True)
    assert record.handoff is not None and record.handoff.next is not None  # both pending
    left = [1, 0]
    for g, n in zip((g1, g2), left):
        with FlopCounterMode(display=False) as flops:
            got = torch.autograd.grad(out, (up, down), g, retain_graph=True)
        # W's own matmuls only (dUp, dDown): the hidden gradient came from its I
        assert flops.get_total_flops() == 2 * 6 * 5 * 4 + 2 * 6 * 3 * 5
        torch.testing.assert_close(got, torch.autograd.grad(ref, (up, down), g, retain_graph=True))
        pending, h = 0, record.handoff
        while h is not None:
            pending, h = pending + 1, h.next
        assert pending == n  # each W took its own


def _two_weights() -> cg.CustomOp[..., torch.Tensor]:
    """``(x @ u.mT + 3x @ v.mT) * 2``, one backward, its ``2 * g`` shared by every gradient
    (kept by I for W)."""

    @cg.op(f"test_handoff{next(_ids)}::two", weights=("u", "v"))
    def two(x: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return (x @ u.mT + (x * 3) @ v.mT) * 2

    two.register_fake(lambda x, u, v: x.new_empty(x.shape[0], u.shape[0]))
    two.register_save_for_backward(lambda i, o: (i.x, i.u, i.v))

    @two.register_backward
    def _(ctx: cg.BackwardContext, s: Any, g: torch.Tensor) -> dict[str, Any]:
        x, u, v = s
        h = g * 2
        return {"x": h @ u + (h @ v) * 3, "u": h.mT @ x, "v": h.mT @ (x * 3)}

    return two


def test_a_pass_needing_what_its_input_pass_computed_again_leaves_the_hand_off_for_w() -> None:
    # Only a pass that needs what the cut's weight pass computes reads the kept values: a
    # second input pass (the same gradients) computes for itself, and W still finds them.
    op = _two_weights()
    x, u, v = (torch.randn(6, 4, dtype=DT, requires_grad=True) for _ in range(3))
    out = op(x, u, v)
    g = torch.randn(6, 6, dtype=DT)
    torch.autograd.grad(out, [x], g, retain_graph=True)  # I: keeps 2g
    (gx,) = torch.autograd.grad(out, [x], g, retain_graph=True)  # I again
    record = record_of(out.grad_fn)
    assert record is not None and record.handoff is not None  # still there for W
    with FlopCounterMode(display=False) as flops:
        gu, gv = torch.autograd.grad(out, [u, v], g)  # W
    assert flops.get_total_flops() == 2 * (2 * 6 * 6 * 4)  # dU and dV only: 2g was kept
    torch.testing.assert_close(gx, (2 * g) @ (u + 3 * v).detach())
    torch.testing.assert_close(gu, (2 * g).mT @ x.detach())
    torch.testing.assert_close(gv, (2 * g).mT @ (3 * x).detach())


def test_a_weight_pass_computes_only_the_weights_it_needs() -> None:
    op = _two_weights()
    x, u, v = (torch.randn(6, 4, dtype=DT, requires_grad=True) for _ in range(3))
    out = op(x, u, v)
    g = torch.randn(6, 6, dtype=DT)
    torch.autograd.grad(out, [x], g, retain_graph=True)  # I: keeps 2g for dU and dV
    with FlopCounterMode(display=False) as flops:
        (gu,) = torch.autograd.grad(out, [u], g)  # W for u alone
    assert flops.get_total_flops() == 2 * 6 * 6 * 4  # dU's matmul, not dV's
    torch.testing.assert_close(gu, (2 * g).mT @ x.detach())
