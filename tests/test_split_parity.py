"""customgrad's split never does more work than torch's (issue 17, item 6).

For each stage, the FLOPs of customgrad's ``stage_backward_input`` + ``stage_backward_weight``
are counted exactly (``torch.utils.flop_counter.FlopCounterMode``, entered after the forward)
and compared with torch's split of the same stage and with a full backward; gradients are
compared with a full backward in float64.
"""

from __future__ import annotations

import copy
import gc
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.distributed.pipelining import _backward as torch_split
from torch.utils.flop_counter import FlopCounterMode

from customgrad import pipelining as cg_split
from tests._skips import GRAPH_FREED_AFTER_I, TORCH_SPLIT, TORCH_SPLIT_RUNS_FUNCTIONS
from tests.conftest import function_linear, linear_op

DT = torch.float64
WIDTH = 8

pair_linear = linear_op("split_parity::pair")
phase_linear = linear_op("split_parity::phase", backward="single", split="phase")
auto_linear = linear_op("split_parity::auto", backward="single")
fn_linear = function_linear()


def _needed(fn: Any) -> bool:
    if fn is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(fn))
    except RuntimeError:  # a leaf captured by autograd.grad: the engine cannot tell
        return True


class AskingLinear(torch.autograd.Function):
    """``x @ w.mT`` as an opaque node that computes only the gradients the running backward
    needs (it asks the engine, as a compiled region's backward does)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.mT

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x, w = ctx.saved_tensors
        node = torch._C._current_autograd_node()
        need = [_needed(fn) for fn, _ in node.next_functions]
        gx = grad @ w if need[0] else None
        gw = grad.reshape(-1, grad.shape[-1]).mT @ x.reshape(-1, x.shape[-1]) if need[1] else None
        return gx, gw


def asking_linear(x: Tensor, w: Tensor) -> Tensor:
    out: Tensor = AskingLinear.apply(x, w)  # type: ignore[no-untyped-call]
    return out


def swapped_linear(x: Tensor, w: Tensor) -> Tensor:
    """A customgrad op whose weight argument is the activation and whose other argument the
    weight: it cannot hand its weight half over, and W runs it again for ``w``'s gradient."""
    return pair_linear(w, x).mT


LINEARS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "native": nn.functional.linear,
    "fn": fn_linear,
    "asking": asking_linear,
    "pair": pair_linear,
    "phase": phase_linear,
    "auto": auto_linear,
    "swapped": swapped_linear,
}


class Layers(nn.Module):
    """A stage from a recipe: ``(kind, weight index)`` applies a linear of that kind with that
    weight (shared when an index repeats); "relu", "gelu", "norm" (a LayerNorm with its own
    affine weights) apply those."""

    def __init__(self, recipe: list[tuple[str, int]], seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        n = 1 + max((i for _, i in recipe), default=0)
        self.recipe = recipe
        self.ws = nn.ParameterList(
            nn.Parameter(torch.randn(WIDTH, WIDTH, generator=gen, dtype=DT) / WIDTH**0.5)
            for _ in range(n)
        )
        norms = sum(kind == "norm" for kind, _ in recipe)
        self.norms = nn.ModuleList(nn.LayerNorm(WIDTH, dtype=DT) for _ in range(norms))
        for norm in self.norms:
            with torch.no_grad():
                norm.weight.normal_(generator=gen)
                norm.bias.normal_(generator=gen)

    def forward(self, x: Tensor) -> Tensor:
        norms = iter(self.norms)
        for kind, i in self.recipe:
            if kind == "relu":
                x = torch.relu(x)
            elif kind == "gelu":
                x = nn.functional.gelu(x)
            elif kind == "norm":
                x = next(norms)(x)
            else:
                x = LINEARS[kind](x, self.ws[i])
        return x


def _native_lrl() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH)).to(DT)


def _native_ln_linear() -> nn.Module:
    return nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)).to(DT)


def _native_gelu_mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*layers).to(DT)


class LinearTwice(nn.Module):
    """A native Linear used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH, dtype=DT)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(torch.relu(self.lin(x)))


def _recipe(*steps: str) -> Callable[[], nn.Module]:
    """``"native:0"`` is a linear of that kind with weight 0; other steps are activations."""

    def make() -> nn.Module:
        recipe = []
        for step in steps:
            kind, _, index = step.partition(":")
            recipe.append((kind, int(index or 0)))
        return Layers(recipe)

    return make


MODELS: dict[str, Callable[[], nn.Module]] = {
    "linear-relu-linear": _native_lrl,
    "layernorm-linear": _native_ln_linear,
    "gelu-mlp": _native_gelu_mlp,
    "linear-twice": LinearTwice,
    "fn-stack": _recipe("fn:0", "relu", "fn:1", "relu", "fn:2"),
    "asking-stack": _recipe("asking:0", "relu", "asking:1", "gelu", "asking:2"),
    "pair-stack": _recipe("pair:0", "relu", "pair:1", "relu", "pair:2"),
    "phase-stack": _recipe("phase:0", "relu", "phase:1", "relu", "phase:2"),
    "auto-stack": _recipe("auto:0", "relu", "auto:1", "relu", "auto:2"),
    "mixed": _recipe("native:0", "relu", "pair:1", "norm", "fn:2", "gelu", "asking:3", "auto:4"),
    "cg-shared": _recipe("pair:0", "relu", "pair:0"),
    "native-shared": _recipe("native:0", "relu", "native:0"),
    "mixed-shared": _recipe("native:0", "relu", "pair:1", "relu", "pair:0", "gelu", "native:1"),
    "norm-sandwich": _recipe("norm", "native:0", "gelu", "norm", "pair:1", "norm"),
    "fn-between-shared": _recipe(
        "asking:0", "relu", "fn:1", "relu", "fn:2", "relu", "asking:0", "relu"
    ),
    "swapped": _recipe("native:0", "relu", "swapped:1", "gelu", "pair:2", "swapped:3", "relu"),
}


def _flops(fn: Callable[[], Any]) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


class Run:
    """One backward of a fresh copy of a stage: FLOPs per pass, and the gradients."""

    def __init__(self, model: nn.Module, first: bool, split: Any | None) -> None:
        torch.manual_seed(1)
        self.model = model = copy.deepcopy(model)
        x = torch.randn(6, WIDTH, dtype=DT, requires_grad=not first)
        out = model(x)
        g = torch.randn_like(out)
        self.flops: dict[str, int] = {}
        if split is None:
            self.flops["full"] = _flops(lambda: out.backward(g))
            self.dx = x.grad
        else:
            groups: list[Any] = []

            def input_pass() -> None:
                dx, param_groups = split.stage_backward_input([out], [g], [x], model.parameters())
                self.dx = dx[0]
                groups.append(param_groups)

            self.flops["I"] = _flops(input_pass)
            self.flops["W"] = _flops(
                lambda: split.stage_backward_weight(model.parameters(), groups[0])
            )
        self.grads = [p.grad for p in model.parameters()]

    @property
    def total(self) -> int:
        return sum(self.flops.values())

    def assert_same_gradients(self, ref: Run) -> None:
        if ref.dx is None:
            assert self.dx is None
        else:
            torch.testing.assert_close(self.dx, ref.dx)
        for got, want in zip(self.grads, ref.grads, strict=True):
            torch.testing.assert_close(got, want)


def _compare(model: nn.Module, first: bool) -> tuple[Run, Run, Run | None]:
    full = Run(model, first, None)
    ours = Run(model, first, cg_split)
    ours.assert_same_gradients(full)
    try:
        theirs: Run | None = Run(model, first, torch_split)
    # torch's split fails on some stages (e.g. a weight used twice); before torch 2.13 on any
    # autograd.Function (customgrad refuses it there) and on a first stage (ValueError)
    except (RuntimeError, ValueError):
        theirs = None
    return full, ours, theirs


MM = 2 * 6 * WIDTH * WIDTH  # the FLOPs of one of the stages' matmuls

# Stages torch's split fails on (its W frees a node it runs again): what customgrad's split
# does more than the full backward. Where the top layer shares its weight with a layer below
# it, torch's W computes its input gradient again; customgrad's asks a native top layer for its
# weight gradient only, but a Function whose backward asks the engine what the pass needs
# (asking) runs again in W, where its input edge leads to that weight too: it computes its
# input gradient again (one matmul). The plain Functions in between compute nothing in W.
TORCH_FAILS = {"mixed-shared": 0, "fn-between-shared": MM}


def asking_again_flops(recipe: list[tuple[str, int]], first: bool) -> int:
    """What customgrad's split does beyond the full backward on a :class:`Layers` stage: an
    asking layer (:class:`AskingLinear`) returns no weight gradient in I (the engine does not
    want it there), so W runs it again; where a layer below it uses the same weight, W's engine
    call wants its input edge too (it leads to that weight), and it computes its input gradient
    again: one matmul. Nothing else repeats (plain Functions, customgrad ops, native layers).
    In a first stage I runs only what leads to a customgrad op that hands its weight half to W
    (pair, phase, auto): an asking layer above none runs once, in W (a bound there: such an op
    may keep its weight half where its weight is shared)."""
    linears = [(kind, i) for kind, i in recipe if kind in LINEARS]
    return MM * sum(
        kind == "asking"
        and any(j == i for _, j in linears[:k])
        and (not first or any(below in ("pair", "phase", "auto") for below, _ in linears[:k]))
        for k, (kind, i) in enumerate(linears)
    )


@TORCH_SPLIT
@pytest.mark.parametrize("name", sorted(MODELS))
def test_no_more_flops_than_torch_and_full_where_torch_is(name: str) -> None:
    model = MODELS[name]()
    full, ours, theirs = _compare(model, first=False)
    if name in TORCH_FAILS:
        assert theirs is None
        assert ours.total == full.total + TORCH_FAILS[name]
        return
    assert theirs is not None
    assert ours.total <= theirs.total
    if theirs.total == full.total:
        assert ours.total == full.total
    # I computes the same input gradients; the plain Functions (fn_linear) split
    # (split_functions, the default): their dW runs in W, where torch's I runs them whole
    split = MM * sum(kind == "fn" for kind, _ in getattr(model, "recipe", ()))
    assert ours.flops["I"] == theirs.flops["I"] - split
    assert ours.flops["W"] > 0
    if name == "fn-stack":  # plain Functions only: torch's W runs each again
        assert ours.total == full.total < theirs.total


@pytest.mark.parametrize(
    "name",
    ["linear-relu-linear", "layernorm-linear", "gelu-mlp", "asking-stack", "pair-stack",
     "phase-stack", "auto-stack", "cg-shared", "norm-sandwich"],
)  # fmt: skip
def test_split_does_the_full_backward_s_work_once(name: str) -> None:
    full, ours, _ = _compare(MODELS[name](), first=False)
    assert ours.total == full.total


def test_native_layers_under_customgrad_split_read_one() -> None:
    # The figures: 1.25x, 1.50x and 1.38x the full backward before.
    for name in ("linear-relu-linear", "layernorm-linear", "gelu-mlp"):
        full, ours, theirs = _compare(MODELS[name](), first=False)
        assert theirs is not None
        assert (ours.flops["I"], ours.flops["W"]) == (theirs.flops["I"], theirs.flops["W"])
        assert ours.total == full.total


@TORCH_SPLIT
def test_shared_customgrad_weight_keeps_customgrad_ahead_of_torch() -> None:
    # op(relu(op(x, w)), w): torch's W runs the outer op's input half again; customgrad's not.
    full, ours, theirs = _compare(MODELS["cg-shared"](), first=False)
    assert theirs is not None
    assert ours.total == full.total < theirs.total


@pytest.mark.parametrize("name", sorted(MODELS))
def test_first_stage(name: str) -> None:
    # The stage input needs no gradient: I+W does the full backward's work once (torch's split
    # computes no weight gradient there at all).
    full, ours, _ = _compare(MODELS[name](), first=True)
    assert ours.total == full.total


@pytest.mark.parametrize("view", [False, True], ids=["chunks", "view-output"])
def test_multi_output_nodes_and_view_outputs(view: bool) -> None:
    class Chunks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(WIDTH, 2 * WIDTH, dtype=DT)
            self.w = nn.Parameter(torch.randn(WIDTH, WIDTH, dtype=DT))

        def forward(self, x: Tensor) -> Tensor:
            a, b = self.lin(x).chunk(2, dim=-1)  # a node with two outputs (views)
            out = pair_linear(torch.relu(a), self.w) * b
            return out.transpose(0, 1) if view else out

    full, ours, theirs = _compare(Chunks(), first=False)
    assert ours.total == full.total
    if view:
        assert theirs is None  # torch's split cannot detach a view output
    elif TORCH_SPLIT_RUNS_FUNCTIONS:  # before torch 2.13, refused (customgrad's pair_linear)
        assert theirs is not None and ours.total == theirs.total


def test_non_tensor_inputs() -> None:
    model = _native_lrl()
    ref = copy.deepcopy(model)
    x = torch.randn(4, WIDTH, dtype=DT, requires_grad=True)
    rx = x.detach().clone().requires_grad_()
    g = torch.randn(4, WIDTH, dtype=DT)
    ref(rx).backward(g)
    out = model(x)
    groups: list[Any] = []

    def input_pass() -> None:
        dinputs, param_groups = cg_split.stage_backward_input(
            [out], [g], [3, x, None], model.parameters()
        )
        assert dinputs[0] is None and dinputs[2] is None
        torch.testing.assert_close(dinputs[1], rx.grad)
        groups.append(param_groups)

    flops = _flops(input_pass)
    flops += _flops(lambda: cg_split.stage_backward_weight(model.parameters(), groups[0]))
    assert flops == 4 * 2 * 4 * WIDTH * WIDTH  # dx and dW of both layers, once each
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad)


def test_accumulation_and_hooks_once_per_weight_across_weight_calls() -> None:
    # Linear-ReLU-Linear runs W in two engine calls: each weight still accumulates once into
    # its existing .grad, and its hooks fire once each.
    model = _native_lrl()
    ref = copy.deepcopy(model)
    fired: Counter[tuple[str, int]] = Counter()
    for i, (p, r) in enumerate(zip(model.parameters(), ref.parameters())):
        p.grad = torch.ones_like(p)
        r.grad = torch.ones_like(r)
        p.register_hook(lambda g, i=i: fired.update([("tensor", i)]) or g * 2)  # type: ignore[misc]
        r.register_hook(lambda g: g * 2)
        p.register_post_accumulate_grad_hook(lambda _, i=i: fired.update([("post", i)]))
    x = torch.randn(4, WIDTH, dtype=DT, requires_grad=True)
    g = torch.randn(4, WIDTH, dtype=DT)
    ref(x.detach().requires_grad_()).backward(g)
    _, groups = cg_split.stage_backward_input([model(x)], [g], [x], model.parameters())
    assert not fired
    cg_split.stage_backward_weight(model.parameters(), groups)
    assert fired == Counter({(h, i): 1 for h in ("tensor", "post") for i in range(4)})
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad)


STEPS = st.sampled_from(sorted(LINEARS))


@st.composite
def recipes(draw: st.DrawFn) -> list[tuple[str, int]]:
    recipe: list[tuple[str, int]] = []
    n_weights = 0
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(STEPS)
        if n_weights and draw(st.booleans()):
            index = draw(st.integers(0, n_weights - 1))  # share an earlier weight
        else:
            index, n_weights = n_weights, n_weights + 1
        recipe.append((kind, index))
        recipe.append((draw(st.sampled_from(["relu", "gelu", "norm"])), 0))
    return recipe


# The stack a random search found on torch 2.11, where W ran the Functions between two asking
# layers sharing a weight again, on zeros (2.1x the full backward's FLOPs): now the full
# backward's FLOPs plus the top asking layer's input gradient.
FOUND = [("asking", 0), ("relu", 0), ("fn", 1), ("relu", 0), ("fn", 2), ("relu", 0),
         ("swapped", 0), ("relu", 0), ("asking", 0), ("relu", 0)]  # fmt: skip


@pytest.mark.parametrize("first", [False, True], ids=["middle", "first"])
def test_found_stack_repeats_only_the_asking_layer_s_input_gradient(first: bool) -> None:
    full, ours, _ = _compare(Layers(FOUND), first)
    assert full.total == (9 if first else 10) * MM
    assert ours.total == full.total + (0 if first else MM)
    assert asking_again_flops(FOUND, first) == ours.total - full.total


@pytest.mark.parametrize("first", [False, True], ids=["middle", "first"])
def test_found_stack_with_plain_layers_does_the_full_backward_s_work(first: bool) -> None:
    # The same stack with the asking layers made plain Functions: every Function runs once.
    plain = [("fn" if kind == "asking" else kind, i) for kind, i in FOUND]
    full, ours, _ = _compare(Layers(plain), first)
    assert ours.total == full.total


# Random stacks, drawn afresh each run (hypothesis' database replays any failure first): exact
# FLOPs against the full backward, gradients equal to it (in _compare).
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=recipes(), first=st.booleans())
def test_random_stacks_against_torch_split(recipe: list[tuple[str, int]], first: bool) -> None:
    full, ours, theirs = _compare(Layers(recipe), first)
    if first:
        assert full.total <= ours.total <= full.total + asking_again_flops(recipe, first)
        if ours.flops["I"] == 0:  # all of it in W, one engine call
            assert ours.total == full.total
    else:
        assert ours.total == full.total + asking_again_flops(recipe, first)
    if theirs is not None and not first:
        # torch's split is a bound only where it is right (it loses gradients of a first stage).
        assert ours.total <= theirs.total
        if theirs.total == full.total:
            assert ours.total == full.total
    linears = [(kind, i) for kind, i in recipe if kind in LINEARS]
    shared = len({i for _, i in linears}) < len(linears)
    if all(kind != "fn" for kind, _ in linears) and not shared:
        assert ours.total == full.total
    if all(kind in ("native", "pair", "phase", "auto") for kind, _ in linears):
        assert ours.total == full.total  # weights shared or not (issue 24, item 4)


@pytest.mark.parametrize(
    "split",
    [
        pytest.param(cg_split, marks=GRAPH_FREED_AFTER_I),
        pytest.param(torch_split, marks=TORCH_SPLIT),
    ],
    ids=["customgrad", "torch"],
)
def test_input_pass_frees_what_only_the_output_side_saved(split: Any) -> None:
    # sin saves its input, which W does not need: after I (and the caller dropping the
    # output), nothing of the split keeps it, as under torch's split.
    lin = nn.Linear(WIDTH, WIDTH, dtype=DT)
    x = torch.randn(4, WIDTH, dtype=DT, requires_grad=True)
    h = lin(x)
    saved_by_sin = weakref.ref(h.untyped_storage())
    out = torch.sin(h)
    del h
    _, groups = split.stage_backward_input([out], [torch.ones_like(out)], [x], lin.parameters())
    del out
    gc.collect()
    assert saved_by_sin() is None
    split.stage_backward_weight(lin.parameters(), groups)


class CountingLinear(torch.autograd.Function):
    """``x @ w.mT`` as a plain Function that counts its backward calls."""

    calls = 0

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.mT

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        CountingLinear.calls += 1
        x, w = ctx.saved_tensors
        return grad @ w, grad.mT @ x


def _counting(x: Tensor, w: Tensor) -> Tensor:
    out: Tensor = CountingLinear.apply(x, w)  # type: ignore[no-untyped-call]
    return out


@pytest.mark.parametrize("once", [True, False], ids=["run-once", "torch-way"])
def test_functions_between_asking_layers_run_once_in_i(
    monkeypatch: pytest.MonkeyPatch, once: bool
) -> None:
    # The found stack's plain Functions: each backward runs once, in I; W reaches them (the
    # asking layers above share a weight with one below) and calls none of them. With
    # run_functions_once=False each runs again in W, as torch's split would, still right.
    monkeypatch.setitem(LINEARS, "fn", _counting)
    model = Layers(FOUND)
    ref = copy.deepcopy(model)
    x = torch.randn(6, WIDTH, dtype=DT, requires_grad=True)
    xr = x.detach().requires_grad_()
    out = model(x)
    g = torch.randn_like(out)
    ref(xr).backward(g)
    CountingLinear.calls = 0
    _, groups = cg_split.stage_backward_input(
        [out], [g], [x], model.parameters(), run_functions_once=once
    )
    assert CountingLinear.calls == 2
    cg_split.stage_backward_weight(model.parameters(), groups)
    assert CountingLinear.calls == (2 if once else 4)
    torch.testing.assert_close(x.grad, xr.grad)
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad)
