"""Forward-mode AD through a registered jvp; without one, a clear error (never zeros)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as fwad
from torch import Tensor

import customgrad as cg
from tests.conftest import linear_op


def _scale_op(name: str, *, jvp: bool) -> cg.CustomOp[..., Tensor]:
    @cg.op(name, weights=("w",))
    def scale(x: Tensor, w: Tensor) -> Tensor:
        return x * w

    scale.register_fake(lambda x, w: torch.empty_like(x))
    scale.register_save_for_backward(lambda inputs, out: (inputs.x, inputs.w))
    scale.register_backward_input(lambda ctx, s, g: {"x": g * s[1]})
    scale.register_backward_weight(lambda ctx, s, g: {"w": g * s[0]})
    if jvp:

        @scale.register_jvp
        def _(inputs: Any, output: Tensor, tangents: Any) -> Tensor:
            out = torch.zeros_like(output)
            if tangents.x is not None:
                out = out + tangents.x * inputs.w
            if tangents.w is not None:
                out = out + inputs.x * tangents.w
            return out

    return scale


with_jvp = _scale_op("fwd_ad::scale", jvp=True)
without_jvp = _scale_op("fwd_ad::scale_no_jvp", jvp=False)


def _data() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(4))  # type: ignore[return-value]


def test_func_jvp_uses_the_registered_rule() -> None:
    x, w, tx, tw = _data()
    out, tangent = torch.func.jvp(with_jvp, (x, w), (tx, tw))
    torch.testing.assert_close(out, x * w)
    torch.testing.assert_close(tangent, tx * w + x * tw)


def test_jacfwd_matches_jacrev() -> None:
    x, w, _, _ = _data()
    fwd = torch.func.jacfwd(with_jvp, argnums=(0, 1))(x, w)
    rev = torch.func.jacrev(with_jvp, argnums=(0, 1))(x, w)
    for a, b in zip(fwd, rev):
        torch.testing.assert_close(a, b)


def test_dual_tensors_use_the_registered_rule() -> None:
    x, w, tx, _ = _data()
    with fwad.dual_level():
        out = with_jvp(fwad.make_dual(x, tx), w)
        tangent = fwad.unpack_dual(out).tangent
    torch.testing.assert_close(tangent, tx * w)


def test_dual_tensors_through_torch_ops_use_the_registered_rule() -> None:
    x, w, tx, tw = _data()
    with fwad.dual_level():
        out = torch.ops.fwd_ad.scale.default(fwad.make_dual(x, tx), fwad.make_dual(w, tw))
        tangent = fwad.unpack_dual(out).tangent
    torch.testing.assert_close(tangent, tx * w + x * tw)


def test_dual_tensors_with_grad_use_the_registered_rule_and_backward() -> None:
    x, w, tx, _ = _data()
    w.requires_grad_(True)
    with fwad.dual_level():
        out = with_jvp(fwad.make_dual(x, tx), w)
        tangent = fwad.unpack_dual(out).tangent
        out.sum().backward()
    torch.testing.assert_close(tangent, tx * w.detach())
    torch.testing.assert_close(w.grad, x)


MSG_NO_JVP = (
    "fwd_ad::scale_no_jvp: forward-mode AD (torch.func.jvp, jacfwd, dual tensors) reached this "
    "op, which has no jvp rule. Register one"
)


@pytest.mark.parametrize("path", ["func.jvp", "jacfwd", "dual", "dual+grad", "torch.ops"])
def test_without_a_jvp_forward_ad_raises_naming_the_op(path: str) -> None:
    x, w, tx, tw = _data()
    with pytest.raises(cg.MissingRegistrationError, match=re.escape(MSG_NO_JVP)):
        if path == "func.jvp":
            torch.func.jvp(without_jvp, (x, w), (tx, tw))
        elif path == "jacfwd":
            torch.func.jacfwd(without_jvp)(x, w)
        else:
            with fwad.dual_level():
                if path == "torch.ops":
                    torch.ops.fwd_ad.scale_no_jvp.default(fwad.make_dual(x, tx), w)
                else:
                    without_jvp(fwad.make_dual(x, tx), w.requires_grad_(path == "dual+grad"))


def test_func_grad_and_jacrev_use_the_registered_backward() -> None:
    x, _, _, _ = _data()
    w = torch.randn(5, 4, dtype=torch.float64)
    op = linear_op("fwd_ad::linear")
    gw = torch.func.grad(lambda w: op(x, w).square().sum())(w)
    torch.testing.assert_close(gw, torch.func.grad(lambda w: (x @ w.mT).square().sum())(w))
    jac = torch.func.jacrev(lambda x: op(x, w))(x)
    torch.testing.assert_close(jac, torch.func.jacrev(lambda x: x @ w.mT)(x))


def test_vmap_raises_naming_the_op() -> None:
    x, w, _, _ = _data()
    with pytest.raises(
        cg.UnsupportedError,
        match=re.escape(
            "fwd_ad::scale: torch.vmap over a customgrad op that takes part in autograd is not "
            "supported"
        ),
    ):
        torch.func.vmap(torch.func.grad(lambda x, w: with_jvp(x, w).sum()), in_dims=(0, None))(
            x, w[0]
        )
