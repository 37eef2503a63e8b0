"""Redefining an op name in the same process replaces the definition (a notebook cell run
again), as torch's ``custom_op`` does; the registry keeps no replaced op alive."""

from __future__ import annotations

import gc
import itertools
import weakref
from typing import Any

import torch

import customgrad as cg
from customgrad._op import registered_ops

_ids = itertools.count()


def define(name: str, factor: float) -> cg.CustomOp[..., torch.Tensor]:
    """The cell a user runs again: ``x * factor`` with its backward."""

    @cg.op(name)
    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * factor

    scale.register_fake(lambda x: torch.empty_like(x))
    scale.register_save_for_backward(lambda inputs, out: None)

    @scale.register_backward
    def _(ctx: cg.BackwardContext, saved: Any, g: torch.Tensor) -> dict[str, Any]:
        return {"x": g * factor}

    return scale


def test_a_redefinition_replaces_the_op_on_every_call_path() -> None:
    name = f"test_redefinition{next(_ids)}::scale"
    ns, opname = name.split("::")
    old = define(name, 2.0)
    x = torch.ones(3, requires_grad=True)
    pending = old(x)  # a graph recorded before the redefinition
    new = define(name, 3.0)
    packet = getattr(getattr(torch.ops, ns), opname)
    torch.testing.assert_close(new(x), torch.full((3,), 3.0))
    torch.testing.assert_close(packet.default(x), torch.full((3,), 3.0))
    (gx,) = torch.autograd.grad(new(x).sum(), x)
    torch.testing.assert_close(gx, torch.full((3,), 3.0))
    (gx,) = torch.autograd.grad(pending.sum(), x)  # the old node keeps its backward
    torch.testing.assert_close(gx, torch.full((3,), 2.0))
    compiled = torch.compile(lambda t: new(t) + 1, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x.detach()), torch.full((3,), 4.0))
    live = registered_ops()
    assert any(op is new for op in live) and not any(op is old for op in live)


def test_the_registry_keeps_a_live_op_and_drops_a_replaced_one() -> None:
    name = f"test_redefinition{next(_ids)}::scale"
    ns, opname = name.split("::")
    ref = weakref.ref(define(name, 2.0))  # no reference kept by the caller
    gc.collect()
    op = ref()
    assert op is not None and op in registered_ops()  # alive while it is defined
    torch.testing.assert_close(
        getattr(getattr(torch.ops, ns), opname).default(torch.ones(2)), torch.full((2,), 2.0)
    )
    del op
    define(name, 3.0)
    gc.collect()
    assert ref() is None  # replaced and unreferenced: freed
