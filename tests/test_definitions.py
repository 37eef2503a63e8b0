"""What real op definitions need (issue 11's escape hatches), as behaviour: an argument named
``_input``; tuple defaults and optional outputs through ``schema=``; a Python object argument
(opaque types); weightless ops; ``differentiable=False``; in-place writes in a backward;
residuals on every call path; work handed from the input half to the weight half. The error
messages are pinned in ``test_errors.py``."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import re
import weakref
from collections import Counter
from typing import Any

import pytest
import torch
from torch import Tensor
from torch._library.opaque_object import MemberType, register_opaque_type
from torch._opaque_base import OpaqueBase
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.pipelining import _backward as torch_split

import customgrad as cg
from customgrad._op import autograd_impl
from customgrad.pipelining import stage_backward_input, stage_backward_weight
from customgrad.testing import CHECKS, check_op
from tests._skips import TORCH_SPLIT

_ids = itertools.count()
ONCE_DIFFERENTIABLE = [c for c in CHECKS if c != "gradgradcheck"]


def unique(name: str) -> str:
    return f"test_def{next(_ids)}::{name}"


def leaf(*shape: int) -> Tensor:
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


def compiled(fn: Any) -> Any:
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


# -- an argument named _input -------------------------------------------------------------------


def test_argument_named_input() -> None:
    """Liger names its argument ``_input``; a namedtuple would refuse the name."""

    @cg.op(unique("scale"), weights=("weight",))
    def scale(_input: Tensor, weight: Tensor, count: int = 2) -> Tensor:
        return _input * weight * count

    scale.register_fake(lambda _input, weight, count=2: torch.empty_like(_input))

    @scale.register_save_for_backward
    def _(inputs: Any, output: Tensor) -> Any:
        return inputs._input, inputs.weight, inputs.count

    scale.register_backward_input(lambda ctx, s, g: {"_input": g * s[1] * s[2]})
    scale.register_backward_weight(lambda ctx, s, g: {"weight": (g * s[0] * s[2]).sum(0)})

    x, w = leaf(3, 4), leaf(4)
    torch.testing.assert_close(scale(x, w), x * w * 2)
    torch.testing.assert_close(scale(_input=x, weight=w, count=3), x * w * 3)
    ns, name = scale.name.split("::")
    torch.testing.assert_close(getattr(getattr(torch.ops, ns), name).default(x, w), x * w * 2)
    assert check_op(scale, x, w).ok


# -- schema=: tuple defaults and optional outputs ----------------------------------------------------


def window_op() -> cg.CustomOp[..., Tensor]:
    """flash-attention's ``window_size=(-1, -1)``: a default annotations can't give torch."""

    @cg.op(unique("window"), schema="(Tensor q, int[2] window_size=[-1, -1]) -> Tensor")
    def window(q: Tensor, window_size: tuple[int, int] | list[int] = (-1, -1)) -> Tensor:
        left, right = window_size
        return q * (left + 2 * right + 10)

    window.register_fake(lambda q, window_size=(-1, -1): torch.empty_like(q))

    @window.register_save_for_backward
    def _(inputs: Any, output: Tensor) -> Any:
        return tuple(inputs.window_size)

    @window.register_backward_input
    def _(ctx: cg.BackwardContext, window_size: Any, grad: Tensor) -> dict[str, Tensor]:
        left, right = window_size
        return {"q": grad * (left + 2 * right + 10)}

    return window


def test_tuple_default_through_schema() -> None:
    window = window_op()
    assert window.schema == "(Tensor q, int[2] window_size=[-1, -1]) -> Tensor"
    q = leaf(3)
    ns, name = window.name.split("::")
    default = getattr(getattr(torch.ops, ns), name).default
    torch.testing.assert_close(window(q), q * 7)
    torch.testing.assert_close(default(q), q * 7)
    torch.testing.assert_close(window(q, (2, 1)), q * 14)
    torch.testing.assert_close(window(q, window_size=[2, 1]), q * 14)
    torch.testing.assert_close(default(q, [2, 1]), q * 14)
    (g,) = torch.autograd.grad(window(q, (2, 1)).sum(), q)
    torch.testing.assert_close(g, torch.full_like(q, 14.0))
    (g,) = torch.autograd.grad(compiled(lambda q: window(q).sum())(q), q)
    torch.testing.assert_close(g, torch.full_like(q, 7.0))
    assert check_op(window, q, (3, 0)).ok


def optional_output_op() -> cg.CustomOp[..., tuple[Tensor, Tensor | None]]:
    """``(out, lse or None)``: the second output only when asked for."""

    @cg.op(unique("maybe_lse"), schema="(Tensor x, bool with_lse=False) -> (Tensor, Tensor?)")
    def maybe_lse(x: Tensor, with_lse: bool = False) -> tuple[Tensor, Tensor | None]:
        return x * 2, (x.logsumexp(-1) if with_lse else None)

    @maybe_lse.register_fake
    def _(x: Tensor, with_lse: bool = False) -> tuple[Tensor, Tensor | None]:
        return torch.empty_like(x), (x.new_empty(x.shape[:-1]) if with_lse else None)

    maybe_lse.register_save_for_backward(lambda inputs, output: inputs.x)

    @maybe_lse.register_backward_input
    def _(ctx: cg.BackwardContext, x: Tensor, grad: Tensor, grad_lse: Tensor | None) -> Any:
        dx = grad * 2
        if grad_lse is not None:  # None when the op returned no lse
            dx = dx + grad_lse[..., None] * torch.softmax(x, -1)
        return {"x": dx}

    return maybe_lse


def test_optional_output() -> None:
    op = optional_output_op()
    x = leaf(2, 5)
    out, lse = op(x)
    assert lse is None
    out, lse = op(x, True)
    assert lse is not None
    torch.testing.assert_close(lse, x.logsumexp(-1))
    (g,) = torch.autograd.grad(out.sum() + (lse * 3).sum(), x)
    xr = x.detach().requires_grad_()
    (want,) = torch.autograd.grad((xr * 2).sum() + (xr.logsumexp(-1) * 3).sum(), xr)
    torch.testing.assert_close(g, want)
    (g,) = torch.autograd.grad(op(x)[0].sum(), x)
    torch.testing.assert_close(g, torch.full_like(x, 2.0))
    plain = x.detach()
    with FakeTensorMode() as mode:
        fake_out, fake_lse = op(mode.from_tensor(plain), True)
        assert fake_out.shape == (2, 5) and fake_lse is not None and fake_lse.shape == (2,)
    (g,) = torch.autograd.grad(compiled(lambda x: op(x, True)[1].sum())(x), x)
    torch.testing.assert_close(g, torch.softmax(x, -1))
    assert check_op(op, x, True).ok
    assert check_op(op, x, False).ok


# -- a Python object argument (opaque types) -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class QuantConfig(OpaqueBase):  # torch 2.11 requires the base (later releases allow it)
    """A value-type opaque object: compared and hashed, baked into compiled graphs."""

    scale: float

    def __fx_repr__(self) -> tuple[str, dict[str, type]]:
        return f"QuantConfig({self.scale!r})", {"QuantConfig": QuantConfig}


class QuantState(OpaqueBase):
    """A reference-type opaque object (mutable state); the members the backward reads are
    declared with ``members=`` so that torch.compile can read them."""

    def __init__(self, scale: float) -> None:
        self.scale = scale


register_opaque_type(QuantConfig, typ="value")
register_opaque_type(QuantState, typ="reference", members={"scale": MemberType.USE_REAL})


def scaled_linear_op(state_type: type) -> cg.CustomOp[..., Tensor]:
    def kernel(x: Tensor, weight: Tensor, state: Any) -> Tensor:
        return x @ (weight * state.scale).mT

    kernel.__annotations__["state"] = state_type
    op = cg.op(unique("scaled_linear"), kernel, weights=("weight",))
    op.register_fake(lambda x, weight, state: x.new_empty(x.shape[0], weight.shape[0]))

    @op.register_save_for_backward
    def _(inputs: Any, output: Tensor) -> Any:
        return inputs.x, inputs.weight, inputs.state  # the object is kept as it is

    op.register_backward_input(lambda ctx, s, g: {"x": g @ (s[1] * s[2].scale)})
    op.register_backward_weight(lambda ctx, s, g: {"weight": g.mT @ s[0] * s[2].scale})
    return op


@pytest.mark.parametrize("state", [QuantConfig(0.5), QuantState(0.5)], ids=["value", "reference"])
def test_opaque_object_argument(state: Any) -> None:
    op = scaled_linear_op(type(state))
    assert op.schema.startswith("(Tensor x, Tensor weight, ")
    x, w = leaf(4, 3), leaf(5, 3)
    want = x @ (w * 0.5).mT
    torch.testing.assert_close(op(x, w, state), want)
    ns, name = op.name.split("::")
    torch.testing.assert_close(getattr(getattr(torch.ops, ns), name).default(x, w, state), want)
    eager = torch.autograd.grad(op(x, w, state).sum(), (x, w))
    torch.testing.assert_close(eager, torch.autograd.grad(want.sum(), (x, w)))
    got = torch.autograd.grad(compiled(lambda x, w, s: op(x, w, s).sum())(x, w, state), (x, w))
    torch.testing.assert_close(got, eager)
    assert check_op(op, x, w, state).ok


# -- weightless ops --------------------------------------------------------------------------------


def test_weightless_op_registers_only_its_input_half() -> None:
    @cg.op(unique("square"))
    def square(x: Tensor) -> Tensor:
        return x * x

    square.register_fake(lambda x: torch.empty_like(x))
    square.register_save_for_backward(lambda inputs, output: inputs.x)
    square.register_backward_input(lambda ctx, x, g: {"x": 2 * x * g})

    x = leaf(3, 4)
    y = square(x)
    (dx,), groups = stage_backward_input([y], [torch.ones_like(y)], [x], iter([]))
    torch.testing.assert_close(dx, 2 * x)
    stage_backward_weight(iter([]), groups)  # nothing left for W
    report = check_op(square, x)
    assert report.ok and report["split"].status == "skipped"


# -- differentiable=False ----------------------------------------------------------------------------


def once_differentiable_op(how: str) -> cg.CustomOp[..., Tensor]:
    @cg.op(unique("mul"), weights=("w",))
    def mul(x: Tensor, w: Tensor) -> Tensor:
        return x * w

    mul.register_fake(lambda x, w: torch.empty_like(x))
    mul.register_save_for_backward(lambda inputs, output: (inputs.x, inputs.w))
    if how == "pair":
        mul.register_backward_input(lambda ctx, s, g: {"x": g * s[1]}, differentiable=False)
        mul.register_backward_weight(lambda ctx, s, g: {"w": g * s[0]}, differentiable=False)
    else:
        mul.register_backward(
            lambda ctx, s, g: {"x": g * s[1], "w": g * s[0]}, split=how, differentiable=False
        )
    return mul


@pytest.mark.parametrize("how", ["pair", "phase", "auto"])
def test_differentiable_false_makes_double_backward_raise(how: str) -> None:
    op = once_differentiable_op(how)
    x, w = leaf(3), leaf(3)
    gx, gw = torch.autograd.grad(op(x, w).sum(), (x, w))  # first order: fine
    torch.testing.assert_close((gx, gw), (w.detach(), x.detach()))
    gx, _ = torch.autograd.grad(op(x, w).sum(), (x, w), create_graph=True)
    torch.testing.assert_close(gx, w.detach())  # the values are right with create_graph too
    with pytest.raises(cg.UnsupportedError, match="registered with differentiable=False"):
        gx.sum().backward()
    # autograd.grad with respect to an input reaches the error too (torch's
    # once_differentiable would prune it and report the input as unused)
    gx, _ = torch.autograd.grad(op(x, w).sum(), (x, w), create_graph=True)
    with pytest.raises(cg.UnsupportedError, match="registered with differentiable=False"):
        torch.autograd.grad(gx.sum(), w)


# -- in-place writes in a backward -------------------------------------------------------------------


def in_place_op(target: str) -> cg.CustomOp[..., Tensor]:
    @cg.op(unique("scale_shift"), weights=("w",))
    def scale_shift(x: Tensor, w: Tensor) -> Tensor:
        return x * w + 1

    scale_shift.register_fake(lambda x, w: torch.empty_like(x))
    scale_shift.register_save_for_backward(lambda inputs, output: (inputs.x.clone(), inputs.w))

    @scale_shift.register_backward_input
    def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor]:
        x, w = saved
        if target == "grad":  # Liger's in_place=True: dX written into dY's storage
            return {"x": grad.mul_(w)}
        return {"x": grad * w + 0 * x.mul_(1)}

    scale_shift.register_backward_weight(lambda ctx, s, g: {"w": (g * s[0]).sum(0)})
    return scale_shift


@pytest.mark.parametrize("target", ["grad", "saved"])
def test_in_place_write_in_a_backward_is_named(target: str) -> None:
    op = in_place_op(target)
    what = "the gradient of output 0" if target == "grad" else "saved tensor 0"
    x, w = leaf(2, 3), leaf(3)
    with pytest.raises(cg.MutationError, match=f"backward_input modified {what} in place"):
        op(x, w).backward(torch.ones(2, 3, dtype=torch.float64))
    # in the input pass of a split, before the weight half would have read it
    y = op(x, w)
    with pytest.raises(cg.MutationError, match=f"backward_input modified {what} in place"):
        stage_backward_input([y], [torch.ones_like(y)], [x], iter([w]))


# -- residuals ---------------------------------------------------------------------------------------


def rms_op(differentiable: bool = True) -> cg.CustomOp[..., Tensor]:
    """RMSNorm whose kernel returns ``rstd`` as a residual."""

    @cg.op(unique("rms"), weights=("weight",), residuals=("rstd",))
    def rms(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x * rstd * weight, rstd

    @rms.register_fake
    def _(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1))

    @rms.register_save_for_backward
    def _(inputs: Any, output: Tensor, residuals: Any) -> Any:
        return inputs.x, inputs.weight, residuals.rstd

    @rms.register_backward_input(differentiable=differentiable)
    def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor]:
        x, weight, rstd = saved
        x_hat, m = x * rstd, grad * weight
        return {"x": rstd * (m - x_hat * (m * x_hat).mean(-1, keepdim=True))}

    @rms.register_backward_weight(differentiable=differentiable)
    def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor]:
        x, weight, rstd = saved
        return {"weight": (grad * x * rstd).reshape(-1, weight.shape[-1]).sum(0)}

    return rms


def rms_ref(x: Tensor, weight: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def test_residuals_on_every_call_path() -> None:
    op = rms_op()
    assert op.residuals == ("rstd",)
    assert op.schema == "(Tensor x, Tensor weight) -> Tensor"  # residuals are not outputs
    x, w = leaf(2, 3, 8), leaf(8)
    want = rms_ref(x, w)
    want_grads = torch.autograd.grad(want.sum(), (x, w))
    ns, name = op.name.split("::")
    default = getattr(getattr(torch.ops, ns), name).default
    for path in (op, default):
        out = path(x, w)
        assert isinstance(out, Tensor)  # the output alone
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(torch.autograd.grad(out.sum(), (x, w)), want_grads)
    with torch.no_grad():
        torch.testing.assert_close(op(x, w), want)
    got = torch.autograd.grad(compiled(lambda x, w: op(x, w).sum())(x, w), (x, w))
    torch.testing.assert_close(got, want_grads)
    with FakeTensorMode() as mode:
        fake = op(mode.from_tensor(x), mode.from_tensor(w))
        assert isinstance(fake, Tensor) and fake.shape == x.shape
    assert op(x.detach().to("meta"), w.detach().to("meta")).shape == x.shape
    assert check_op(op, x, w, checks=ONCE_DIFFERENTIABLE).ok


def test_save_for_backward_sees_the_residuals() -> None:
    op = rms_op()
    seen: list[Tensor] = []
    save = op.rules.save
    assert save is not None

    def spy(inputs: Any, output: Tensor, residuals: Any) -> Any:
        seen.append(residuals.rstd)
        return save(inputs, output, residuals)

    op.register_save_for_backward(spy)
    x = leaf(2, 8)
    op(x, leaf(8))
    torch.testing.assert_close(seen[0], torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_double_backward_through_a_residual_raises() -> None:
    op = rms_op(differentiable=True)
    x, w = leaf(2, 8), leaf(8)
    gx, _ = torch.autograd.grad(op(x, w).sum(), (x, w), create_graph=True)
    want, _ = torch.autograd.grad(rms_ref(x, w).sum(), (x, w))
    torch.testing.assert_close(gx, want)  # first order is right
    with pytest.raises(cg.UnsupportedError, match="reached residual 'rstd'"):
        torch.autograd.grad(gx.sum(), x)
    gx, _ = torch.autograd.grad(op(x, w).sum(), (x, w), create_graph=True)
    with pytest.raises(cg.UnsupportedError, match="reached residual 'rstd'"):
        gx.sum().backward()


def test_double_backward_with_respect_to_the_gradient_only_works() -> None:
    """The residual is a constant with respect to the output gradient: differentiating the input
    gradient with respect to the output gradient alone is exact."""
    op = rms_op(differentiable=True)
    x, w = leaf(2, 8), leaf(8)
    grad = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(op(x, w), x, grad, create_graph=True)
    (ggrad,) = torch.autograd.grad(gx.sum(), grad)
    (rx,) = torch.autograd.grad(rms_ref(x, w), x, grad, create_graph=True)
    (want,) = torch.autograd.grad(rx.sum(), grad)
    torch.testing.assert_close(ggrad, want)


# -- work handed from the input half to the weight half ---------------------------------------------


def handoff_op(calls: Counter[str], kept: list[weakref.ref[Tensor]]) -> cg.CustomOp[..., Tensor]:
    """``(x @ a.T) @ b.T``: both halves need ``grad @ b``."""

    @cg.op(unique("low_rank"), weights=("a", "b"))
    def low_rank(x: Tensor, a: Tensor, b: Tensor) -> Tensor:
        return (x @ a.mT) @ b.mT

    low_rank.register_fake(lambda x, a, b: x.new_empty(x.shape[0], b.shape[0]))
    low_rank.register_save_for_backward(lambda inputs, output: (inputs.x, inputs.a, inputs.b))

    @low_rank.register_backward_shared
    def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> Tensor:
        calls[ctx.phase] += 1
        grad_b = grad @ saved[2]
        kept.append(weakref.ref(grad_b))
        return grad_b

    low_rank.register_backward_input(lambda ctx, s, g: {"x": ctx.shared @ s[1]})

    @low_rank.register_backward_weight
    def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor]:
        x, a, _ = saved
        return {"a": ctx.shared.mT @ x, "b": grad.mT @ (x @ a.mT)}

    return low_rank


@pytest.mark.parametrize("split", ["customgrad", pytest.param("torch", marks=TORCH_SPLIT)])
def test_shared_work_is_computed_once_and_freed_after_w(split: str) -> None:
    calls: Counter[str] = Counter()
    kept: list[weakref.ref[Tensor]] = []
    op = handoff_op(calls, kept)
    backward_input, backward_weight = (
        (stage_backward_input, stage_backward_weight)
        if split == "customgrad"
        else (torch_split.stage_backward_input, torch_split.stage_backward_weight)
    )
    x, a, b = leaf(4, 6), leaf(2, 6), leaf(5, 2)
    y = op(x, a, b)
    g = torch.randn(4, 5, dtype=torch.float64)
    (dx,), groups = backward_input([y], [g], [x], iter([a, b]))
    assert calls == Counter({"input": 1}) and kept[0]() is not None  # kept for W
    backward_weight(iter([a, b]), groups)
    assert calls == Counter({"input": 1})  # W read the hand-off
    del groups
    gc.collect()
    assert kept[0]() is None  # freed after W
    want = torch.autograd.grad(((x @ a.mT) @ b.mT * g).sum(), (x, a, b))
    torch.testing.assert_close((dx, a.grad, b.grad), want)


def test_shared_work_once_in_a_full_backward_and_without_the_input_half() -> None:
    calls: Counter[str] = Counter()
    kept: list[weakref.ref[Tensor]] = []
    op = handoff_op(calls, kept)
    x, a, b = leaf(4, 6), leaf(2, 6), leaf(5, 2)
    op(x, a, b).sum().backward()
    assert calls == Counter({"full": 1})
    calls.clear()
    x.requires_grad_(False)  # only the weight half runs: it computes the shared work itself
    op(x, a, b).sum().backward()
    assert calls == Counter({"full": 1})
    gc.collect()
    assert all(ref() is None for ref in kept)  # nothing kept after a full backward


def test_shared_work_is_watched_for_in_place_writes() -> None:
    @cg.op(unique("shared_in_place"), weights=("w",))
    def op(x: Tensor, w: Tensor) -> Tensor:
        return x * w

    op.register_fake(lambda x, w: torch.empty_like(x))
    op.register_save_for_backward(lambda inputs, output: (inputs.x, inputs.w))
    op.register_backward_shared(lambda ctx, s, g: g.mul_(2))
    op.register_backward_input(lambda ctx, s, g: {"x": ctx.shared * s[1]})
    op.register_backward_weight(lambda ctx, s, g: {"w": (ctx.shared * s[0]).sum(0)})
    with pytest.raises(cg.MutationError, match="backward_shared modified the gradient of output 0"):
        op(leaf(2, 3), leaf(3)).backward(torch.ones(2, 3, dtype=torch.float64))


def test_check_op_counts_shared_work_in_the_pass_that_computes_it() -> None:
    calls: Counter[str] = Counter()
    op = handoff_op(calls, [])
    report = check_op(op, leaf(4, 6), leaf(2, 6), leaf(5, 2))
    assert report.calls["input"] == {"backward_input": 1, "backward_shared": 1}
    assert report.calls["weight"] == {"backward_weight": 1}
    assert report.flops["input"] + report.flops["weight"] == report.flops["full"]
    assert autograd_impl(op).observers == ()


def test_a_schema_default_differing_from_the_kernel_default_is_refused() -> None:
    # op(x) binds the kernel's default; torch.ops and compiled calls the schema's.
    with pytest.raises(cg.DefinitionError, match=re.escape("argument 'scale' defaults to 2.0")):

        @cg.op(unique("scaled"), schema="(Tensor x, float scale=1.0) -> Tensor")
        def scaled(x: Tensor, scale: float = 2.0) -> Tensor:
            return x * scale

    for default, schema_default in [("(-1, -1)", "[-1, -1]"), ("(3, 3)", "3"), ("None", "None")]:
        ns: dict[str, Any] = {"torch": torch, "Tensor": Tensor}
        exec(f"def window(x: Tensor, size: Any = {default}) -> Tensor:\n    return x * 2", ns)
        optional = "?" if default == "None" else ""
        schema = f"(Tensor x, int[2]{optional} size={schema_default}) -> Tensor"
        window = cg.op(unique("window"), ns["window"], schema=schema)
        x = torch.ones(2)
        torch.testing.assert_close(
            window(x), getattr(torch.ops, window.name.split("::")[0]).window(x)
        )
    with pytest.raises(cg.DefinitionError, match=re.escape("argument 'flag' defaults to 1")):

        @cg.op(unique("flagged"), schema="(Tensor x, bool flag=True) -> Tensor")
        def flagged(x: Tensor, flag: Any = 1) -> Tensor:
            return x * 2
