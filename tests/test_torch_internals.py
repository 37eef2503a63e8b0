"""The private torch internals customgrad reads (customgrad/_torch_internals.py) are there, in
the form read: when a torch upgrade changes one, this fails instead of customgrad silently
taking its slower fallback."""

from __future__ import annotations

import torch

import customgrad as cg
from customgrad import _torch_internals as ti
from customgrad._op import autograd_impl


def test_engine_query_graph_task_and_accumulate_grad_exist() -> None:
    assert ti.will_execute is not None
    assert ti.graph_task_id() == -1  # outside a backward
    assert hasattr(torch._C._autograd, "_get_current_graph_task_keep_graph")
    assert ti.graph_kept() is True  # outside a backward: True (keep, the safe answer)
    kept: list[bool] = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: kept.append(ti.graph_kept()))
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    assert kept == [True, False]
    assert ti.ACCUMULATE_GRAD is not type(None)
    x = torch.ones(2, requires_grad=True)
    assert type((x * 2).grad_fn.next_functions[0][0]) is ti.ACCUMULATE_GRAD  # type: ignore[union-attr]


def test_library_impls_records_each_torch_library_registration() -> None:
    impls = ti.library_impls()
    assert isinstance(impls, set)
    lib = torch.library.Library("test_torch_internals", "FRAGMENT")
    try:
        lib.define("f(Tensor x) -> Tensor")
        lib.impl("f", lambda x: x.clone(), "CPU")
        assert "test_torch_internals/f/CPU" in impls
    finally:
        lib._destroy()
    assert "test_torch_internals/f/CPU" not in impls


def test_the_engine_run_backward_frame_names_what_autograd_grad_captures() -> None:
    assert ti.FRAME_READABLE

    def scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w

    op = cg.op("test_torch_internals::scale", scale, weights=("w",))
    op.register_save_for_backward(lambda inputs, out: (inputs.x, inputs.w))
    op.register_backward_input(lambda ctx, s, g: {"x": g * s[1]})
    op.register_backward_weight(lambda ctx, s, g: {"w": g * s[0]})
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    torch.autograd.grad(op(x, w).sum(), (x, w))
    # read at the depth the node's backward reads it: both leaves named, none asked of the engine
    task, captured = autograd_impl(op).captures._last
    assert task != -2 and captured == {id(x), id(w)}
