"""customgrad.pipelining's stage_backward / _input / _weight against a full backward."""

from __future__ import annotations

import copy
import gc
import re
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.distributed.pipelining import _backward as torch_backward

import customgrad as cg
from customgrad._record import record_of
from customgrad._split_plan import postorder
from customgrad.pipelining import (
    SplitStateError,
    stage_backward,
    stage_backward_input,
    stage_backward_weight,
)
from tests._skips import TORCH_SPLIT
from tests.conftest import function_linear, linear_op

# ---------------------------------------------------------------- ops and models


linear = linear_op("split_bw::linear")
linear1 = linear_op("split_bw::linear1", backward="single")
fn_linear = function_linear()


@cg.op("split_bw::scale_two", weights=("w",))
def scale_two(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    return x * w, x * 2


@scale_two.register_fake
def _(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


@scale_two.register_save_for_backward
def _(inputs: Any, output: Any) -> Any:
    return inputs.x, inputs.w


@scale_two.register_backward_input
def _(ctx: cg.BackwardContext, saved: Any, g1: Tensor | None, g2: Tensor | None) -> Any:
    x, w = saved
    gx = torch.zeros_like(x)
    if g1 is not None:
        gx = gx + g1 * w
    if g2 is not None:
        gx = gx + g2 * 2
    return {"x": gx}


@scale_two.register_backward_weight
def _(ctx: cg.BackwardContext, saved: Any, g1: Tensor | None, g2: Tensor | None) -> Any:
    x, _ = saved
    return {"w": None if g1 is None else (g1 * x).sum(0)}


def _apply(kind: str, x: Tensor, w: Tensor) -> Tensor:
    if kind == "cg":
        return linear(x, w)
    if kind == "cg1":
        return linear1(x, w)
    if kind == "fn":
        return fn_linear(x, w)
    return nn.functional.linear(x, w)


KINDS = ["cg", "cg1", "fn", "native"]


class MLP(nn.Module):
    def __init__(self, kind: str, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.kind = kind
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(width, width) / width**0.5) for _ in range(depth)
        )
        self.bias = nn.Parameter(torch.randn(width))

    def forward(self, x: Tensor) -> Tensor:
        for i, w in enumerate(self.weights):
            x = _apply(self.kind, x, w)
            if i == 0:
                x = x + self.bias
            if i < len(self.weights) - 1:
                x = torch.relu(x)
        return x


class Shared(nn.Module):
    """``op(relu(op(x, w)), w)``: one weight used twice."""

    def __init__(self, kind: str, width: int = 8) -> None:
        super().__init__()
        self.kind = kind
        self.w = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x: Tensor) -> Tensor:
        return _apply(self.kind, torch.relu(_apply(self.kind, x, self.w)), self.w)


class Mixed(nn.Module):
    """customgrad, native and Function layers in one stage, with a weight shared across kinds."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.lin = nn.Linear(width, width)
        self.v = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(linear(x, self.w))
        h = torch.tanh(self.lin(h))
        h = fn_linear(h, self.v)
        h = nn.functional.linear(torch.relu(h), self.w)
        return linear1(torch.sin(h), self.w.t().contiguous())


def _pair(model: nn.Module, width: int = 8, batch: int = 4) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    x = torch.randn(batch, width, requires_grad=True)
    with torch.no_grad():
        g = torch.randn_like(model(x))
    return copy.deepcopy(model), x, g


def _reference(model: nn.Module, x: Tensor, g: Tensor) -> tuple[Tensor | None, dict[str, Any]]:
    x = x.detach().clone().requires_grad_(x.requires_grad)
    model(x).backward(g)
    return x.grad, {n: p.grad for n, p in model.named_parameters()}


def _check(model: nn.Module, dx: Tensor | None, ref: tuple[Tensor | None, dict[str, Any]]) -> None:
    torch.testing.assert_close(dx, ref[0])
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[1][name], msg=name)


def _split(model: nn.Module, x: Tensor, g: Tensor) -> Tensor | None:
    out = model(x)
    (dx,), groups = stage_backward_input([out], [g], [x], model.parameters())
    stage_backward_weight(model.parameters(), groups)
    return dx


# ---------------------------------------------------------------- correctness


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("model_fn", [MLP, Shared], ids=["mlp", "shared"])
def test_split_matches_full_backward(kind: str, model_fn: Callable[[str], nn.Module]) -> None:
    model = model_fn(kind)
    ref_model, x, g = _pair(model)
    ref = _reference(ref_model, x, g)
    _check(model, _split(model, x, g), ref)


def test_split_mixed_kinds_with_weight_shared_across_kinds() -> None:
    model = Mixed()
    ref_model, x, g = _pair(model)
    ref = _reference(ref_model, x, g)
    _check(model, _split(model, x, g), ref)


@pytest.mark.parametrize("kind", KINDS)
def test_input_pass_leaves_weights_alone(kind: str) -> None:
    model = MLP(kind)
    ref_model, x, g = _pair(model)
    ref = _reference(ref_model, x, g)
    (dx,), groups = stage_backward_input([model(x)], [g], [x], model.parameters())
    torch.testing.assert_close(dx, ref[0])
    torch.testing.assert_close(x.grad, ref[0])
    assert all(p.grad is None for p in model.parameters())
    stage_backward_weight(model.parameters(), groups)
    _check(model, dx, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_loss_output_and_returned_weight_grads(kind: str) -> None:
    model = MLP(kind)
    ref_model, x, _ = _pair(model)
    rx = x.detach().clone().requires_grad_()
    ref_model(rx).square().sum().backward()
    (dx,), groups = stage_backward_input((model(x).square().sum(),), None, [x], model.parameters())
    grads = stage_backward_weight(model.parameters(), groups)
    torch.testing.assert_close(dx, rx.grad)
    # As torch 2.13's: each weight's .grad as W found it (None: no gradient yet).
    assert grads == tuple(None for _ in model.parameters())
    for p, ref in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, ref.grad)
    (dx,), groups = stage_backward_input((model(x).square().sum(),), None, [x], model.parameters())
    before = [p.grad for p in model.parameters()]
    grads = stage_backward_weight(model.parameters(), groups)
    assert all(g is b for g, b in zip(grads, before, strict=True))


@pytest.mark.parametrize("kind", KINDS)
def test_microbatches_all_inputs_before_all_weights(kind: str) -> None:
    model = MLP(kind)
    ref_model = copy.deepcopy(model)
    xs = [torch.randn(4, 8, requires_grad=True) for _ in range(4)]
    gs = [torch.randn(4, 8) for _ in range(4)]
    pending = []
    for x, g in zip(xs, gs):
        out = model(x)
        pending.append(stage_backward_input([out], [g], [x], model.parameters())[1])
    for groups in pending:
        stage_backward_weight(model.parameters(), groups)
    for x, g in zip(xs, gs):
        rx = x.detach().clone().requires_grad_()
        ref_model(rx).backward(g)
        torch.testing.assert_close(x.grad, rx.grad)
    for p, rp in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, rp.grad)


@pytest.mark.parametrize("kind", KINDS)
def test_first_stage_inputs_without_grad(kind: str) -> None:
    model = MLP(kind)
    ref_model, x, g = _pair(model)
    x = x.detach()
    ref_model(x).backward(g)
    out = model(x)
    dinputs, groups = stage_backward_input([out], [g], [x], model.parameters())
    assert dinputs == (None,)
    assert all(p.grad is None for p in model.parameters())
    stage_backward_weight(model.parameters(), groups)
    for p, rp in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, rp.grad)


@pytest.mark.parametrize("kind", KINDS)
def test_weights_without_grad(kind: str) -> None:
    model = MLP(kind)
    model.weights[1].requires_grad_(False)
    ref_model, x, g = _pair(model)
    ref = _reference(ref_model, x, g)
    dx = _split(model, x, g)
    _check(model, dx, ref)
    assert model.weights[1].grad is None


@pytest.mark.parametrize("kind", KINDS)
def test_non_tensor_inputs(kind: str) -> None:
    model = MLP(kind)
    ref_model, x, g = _pair(model)
    ref = _reference(ref_model, x, g)
    out = model(x)
    dinputs, groups = stage_backward_input([out], [g], [object(), x, 3], model.parameters())
    assert dinputs[0] is None and dinputs[2] is None
    stage_backward_weight(model.parameters(), groups)
    _check(model, dinputs[1], ref)


class _ViewIdentity(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


@pytest.mark.parametrize("kind", KINDS)
def test_view_outputs(kind: str) -> None:
    model = MLP(kind)
    ref_model, x, g = _pair(model)
    ref = _reference(ref_model, x, g)
    out = _ViewIdentity.apply(model(x))
    out2 = model(x).view(2, 16)[0]
    assert out._is_view() and out2._is_view()
    dinputs, groups = stage_backward_input(
        [out, out2], [g, torch.zeros(16)], [x], model.parameters()
    )
    stage_backward_weight(model.parameters(), groups)
    _check(model, dinputs[0], ref)


class _TwoInputOutputOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        return a, w

    @staticmethod
    def backward(ctx: Any, ga: Tensor, gw: Tensor) -> tuple[Tensor, Tensor]:
        return ga, gw


class MultiIntermediate(nn.Module):
    """torch's own multi-output intermediate test model."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: Tensor) -> Tensor:
        a, b = torch.split(x, [4, 4], dim=1)
        a, w = _TwoInputOutputOp.apply(a, self.w)
        return torch.matmul(a, w) * b


class MultiOutputCG(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))
        self.v = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x: Tensor) -> Tensor:
        a, b = scale_two(x, self.w)
        return linear(torch.relu(a), self.v) * b


@pytest.mark.parametrize("model_fn", [MultiIntermediate, MultiOutputCG])
def test_multi_output_intermediates(model_fn: Callable[[], nn.Module]) -> None:
    model = model_fn()
    ref_model, x, g = _pair(model)
    ref = _reference(ref_model, x, g)
    _check(model, _split(model, x, g), ref)


def test_multi_output_cg_with_one_output_unused() -> None:
    w = nn.Parameter(torch.randn(8))
    x = torch.randn(4, 8, requires_grad=True)
    a, _ = scale_two(x, w)
    (dx,), groups = stage_backward_input([a.sum()], None, [x], [w])
    stage_backward_weight([w], groups)
    torch.testing.assert_close(dx, w.detach().expand(4, 8))
    torch.testing.assert_close(w.grad, x.detach().sum(0))


def test_gradient_edge_outputs() -> None:
    model = MLP("cg")
    ref_model, x, g = _pair(model)
    ref = _reference(ref_model, x, g)
    edge = get_gradient_edge(model(x))
    dinputs, groups = stage_backward_input([edge], [g], [x], model.parameters())
    stage_backward_weight(model.parameters(), groups)
    _check(model, dinputs[0], ref)
    with pytest.raises(ValueError, match=re.escape("which requires output gradients")):
        stage_backward_input([get_gradient_edge(model(x))], None, [x], model.parameters())


@TORCH_SPLIT
@pytest.mark.parametrize("kind", KINDS)
def test_matches_torch_split(kind: str) -> None:
    model = Shared(kind)
    theirs, x, g = _pair(model)
    x2 = x.detach().clone().requires_grad_()
    (dx,), groups = torch_backward.stage_backward_input(
        [theirs(x2)], [g], [x2], theirs.parameters()
    )
    torch_backward.stage_backward_weight(theirs.parameters(), groups)
    _check(model, _split(model, x, g), (dx, {n: p.grad for n, p in theirs.named_parameters()}))


# ---------------------------------------------------------------- full stage_backward


@pytest.mark.parametrize("kind", KINDS)
def test_stage_backward_full(kind: str) -> None:
    model = MLP(kind)
    ref_model, x, g = _pair(model)
    ref = _reference(ref_model, x, g)
    out = model(x)
    (dx,) = stage_backward(out, g, (x,))
    assert x.grad is None
    _check(model, dx, ref)


def test_stage_backward_nested_outputs_and_edges() -> None:
    lin1, lin2 = nn.Linear(8, 8), nn.Linear(8, 8)
    r1, r2 = copy.deepcopy(lin1), copy.deepcopy(lin2)
    x = torch.randn(4, 8, requires_grad=True)
    g1, g2 = torch.randn(4, 8), torch.randn(4, 8)
    outs = {"a": get_gradient_edge(lin1(x)), "b": (lin2(x), torch.ones(1)), "c": None}
    (dx, none) = stage_backward(outs, {"a": g1, "b": (g2, None), "c": None}, (x, "label"))
    rx = x.detach().clone().requires_grad_()
    torch.autograd.backward([r1(rx), r2(rx)], [g1, g2])
    assert none is None
    torch.testing.assert_close(dx, rx.grad)
    torch.testing.assert_close(lin1.weight.grad, r1.weight.grad)
    torch.testing.assert_close(lin2.bias.grad, r2.bias.grad)


def test_stage_backward_mismatched_gradients() -> None:
    x = torch.randn(2, requires_grad=True)
    with pytest.raises(ValueError, match=re.escape("must be a tuple or list of the same length")):
        stage_backward((x * 2, x * 3), (torch.ones(2),), [x])
    with pytest.raises(ValueError, match=re.escape("must be a dict with keys ['a']")):
        stage_backward({"a": x * 2}, {"b": torch.ones(2)}, [x])
    with pytest.raises(TypeError, match=re.escape("expected a Tensor or None gradient, got int")):
        stage_backward(x * 2, 3, [x])


# ---------------------------------------------------------------- errors


def test_weight_pass_twice_raises() -> None:
    model = MLP("cg")
    _, x, g = _pair(model)
    _, groups = stage_backward_input([model(x)], [g], [x], model.parameters())
    stage_backward_weight(model.parameters(), groups)
    with pytest.raises(SplitStateError, match=re.escape("were already used by an earlier")):
        stage_backward_weight(model.parameters(), groups)


def test_foreign_param_groups_raise() -> None:
    model = MLP("native")
    _, x, g = _pair(model)
    _, groups = torch_backward.stage_backward_input([model(x)], [g], [x], model.parameters())
    with pytest.raises(SplitStateError, match=re.escape("did not come from customgrad.pipelining")):
        stage_backward_weight(model.parameters(), groups)


def test_routes_removed_after_an_error_in_backward() -> None:
    w = nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, t: Tensor) -> Tensor:
            return t.clone()

        @staticmethod
        def backward(ctx: Any, grad: Tensor) -> Tensor:
            raise ZeroDivisionError("boom")

    out = Boom.apply(linear(x, w))
    records = [r for n in postorder([out.grad_fn]) if (r := record_of(n)) is not None]
    assert records
    with pytest.raises(ZeroDivisionError, match="boom") as raised:
        stage_backward_input([out.sum()], None, [x], [w])
    assert isinstance(raised.value, RuntimeError)  # as torch's drop-in wraps it
    assert all(r.route is None for r in records)


# ---------------------------------------------------------------- hooks and memory


@pytest.mark.parametrize("kind", KINDS)
def test_post_accumulate_grad_hooks_fire_once_per_weight(kind: str) -> None:
    model = Shared(kind)
    _, x, g = _pair(model)
    seen: list[Tensor] = []
    model.w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    _split(model, x, g)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], model.w.grad)


def _activation_refs(kind: str) -> tuple[Iterator[Any], Callable[[], None]]:
    model = MLP(kind)
    x = torch.randn(4, 8, requires_grad=True)
    a = _apply(kind, x, model.weights[0])
    h = torch.sin(a)
    out = _apply(kind, h, model.weights[1])
    refs = [weakref.ref(a), weakref.ref(h), weakref.ref(out)]
    (_,), groups = stage_backward_input([out], [torch.ones_like(out)], [x], model.parameters())
    del a, h, out

    def finish() -> None:
        stage_backward_weight(model.parameters(), groups)
        groups.clear()

    return iter(refs), finish


@pytest.mark.parametrize("kind", KINDS)
def test_graph_and_activations_released_after_weight_pass(kind: str) -> None:
    gc.collect()
    gc.disable()  # anything kept alive by a reference cycle stays alive
    try:
        refs, finish = _activation_refs(kind)
        finish()
        del finish
        assert [r() for r in refs] == [None, None, None]
    finally:
        gc.enable()


def test_customgrad_split_frees_what_weight_pass_does_not_need() -> None:
    # With only customgrad ops on the weight side, I does not retain the graph: sin's saved
    # input ``a`` (the first op's output) is gone before W; torch's split keeps it until W.
    gc.disable()
    try:
        refs, finish = _activation_refs("cg")
        h_ref = next(refs)
        assert h_ref() is None
        finish()
    finally:
        gc.enable()


class OddRoles(nn.Module):
    """Arguments in unexpected roles: a weight as ``x``, a "weight" computed from the input."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.v = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x: Tensor) -> Tensor:
        a = linear(self.v, self.w)  # its non-weight argument only leads to weights
        h = linear(x, a)  # its weight is computed from weights
        k = linear1(h, self.w)
        y = linear(torch.relu(k), h.T @ h)  # its "weight" depends on the stage input: I needs it
        return y + linear(x, self.v.double().float())


def test_split_with_arguments_in_unexpected_roles() -> None:
    model = OddRoles()
    ref_model, x, g = _pair(model)
    ref = _reference(ref_model, x, g)
    _check(model, _split(model, x, g), ref)


# ---------------------------------------------------------------- hardening


@pytest.mark.parametrize("kind", KINDS)
def test_tensor_hooks_run_once_in_the_weight_pass(kind: str) -> None:
    # A hook that scales the gradient: run twice, the weight gradient would be 1/16, not 1/4.
    model = MLP(kind)
    ref_model, x, g = _pair(model)
    for m in (model, ref_model):
        for p in m.parameters():
            p.register_hook(lambda grad: grad / 4)
    ref = _reference(ref_model, x, g)
    _check(model, _split(model, x, g), ref)


def test_input_gradients_returned_are_not_the_inputs_grad() -> None:
    model = MLP("cg")
    _, x, g = _pair(model)
    (dx1,), groups1 = stage_backward_input([model(x)], [g], [x], model.parameters())
    first = dx1.clone()
    (dx2,), groups2 = stage_backward_input([model(x)], [g], [x], model.parameters())
    torch.testing.assert_close(dx1, first)  # the second call accumulated into x.grad only
    torch.testing.assert_close(x.grad, first + dx2)
    assert x.grad is not dx1 and x.grad is not dx2
    stage_backward_weight(model.parameters(), groups1)
    stage_backward_weight(model.parameters(), groups2)


CALLS: list[tuple[str, str]] = []
spied = linear_op("split_bw::spied", spy=lambda half, phase: CALLS.append((half, phase)))


def test_first_stage_runs_its_input_halves_in_the_input_pass() -> None:
    # A stage whose input needs no gradient (the first): its activation gradients are still
    # the input pass's work; the weight pass does only weight work, as the schedules assume.
    ws = [nn.Parameter(torch.randn(8, 8) / 3) for _ in range(3)]
    x = torch.randn(4, 8)
    out = spied(torch.relu(spied(torch.relu(spied(x, ws[0])), ws[1])), ws[2])
    ref = [torch.autograd.grad(out.sum(), w, retain_graph=True)[0] for w in ws]
    CALLS.clear()
    dinputs, groups = stage_backward_input([out.sum()], None, [x], ws)
    assert dinputs == (None,)
    assert CALLS == [("input", "input"), ("input", "input")]  # layers 3 and 2; layer 1 has none
    assert all(w.grad is None for w in ws)
    CALLS.clear()
    stage_backward_weight(ws, groups)
    # Layer 1's only argument with a gradient is its weight: its pass is "full".
    assert CALLS == [("weight", "weight"), ("weight", "weight"), ("weight", "full")]
    for w, r in zip(ws, ref):
        torch.testing.assert_close(w.grad, r)


def test_drop_in_errors_are_runtime_errors_too() -> None:
    model = MLP("cg")
    _, x, g = _pair(model)
    out = model(x)
    with pytest.raises(cg.ArgumentValueError) as raised:
        stage_backward_input([out, out * 2], [g], [x], model.parameters())
    assert isinstance(raised.value, RuntimeError)
    with pytest.raises(cg.ArgumentTypeError) as raised_type:
        stage_backward_input(out.sum(), None, [x], model.parameters())  # type: ignore[arg-type]
    assert isinstance(raised_type.value, RuntimeError)


@cg.op("split_bw::gap", weights=("u", "v"))
def gap(x: Tensor, b: Tensor | None, u: Tensor, v: Tensor) -> Tensor:
    return x * u + x * x * v + (0 if b is None else b)


gap.register_fake(lambda x, b, u, v: torch.empty_like(x))
gap.register_save_for_backward(lambda i, o: (i.x, i.u, i.v))
gap.register_backward_input(lambda ctx, s, g: {"x": g * (s[1] + 2 * s[0] * s[2])})
gap.register_backward_weight(lambda ctx, s, g: {"u": g * s[0], "v": g * s[0] * s[0]})


def test_a_deferred_weight_half_sends_each_gradient_along_its_own_edge() -> None:
    # A None argument before the weights has no edge: the node's edges are x, u, v, and W sends
    # each weight's gradient along the edge of its argument, not of its position among them.
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    u, v = (torch.randn(5, dtype=torch.float64, requires_grad=True) for _ in range(2))
    h = torch.tanh(x)
    out = gap(h, None, u, v)
    _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], [u, v])
    stage_backward_weight([u, v], groups)
    torch.testing.assert_close(u.grad, h.detach())
    torch.testing.assert_close(v.grad, h.detach() ** 2)
