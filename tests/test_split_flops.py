"""Exact FLOPs of a split backward: I + W == full for customgrad ops, more for plain Functions.

FLOPs are counted with torch's own formulas (``torch.utils.flop_counter.flop_registry``) in a
dispatch mode (``customgrad._flops.FlopCounter``); FlopCounterMode's module hooks get in the way
of ``autograd.grad`` on leaves when entered before the forward. Counters on each backward half
check the same thing for kernels a FLOP counter cannot see.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.pipelining import _backward as torch_backward

from customgrad import _runtime
from customgrad._flops import FlopCounter
from customgrad.pipelining import _weight_pass, stage_backward_input, stage_backward_weight
from tests._skips import TORCH_SPLIT, TORCH_SPLIT_RUNS_FUNCTIONS
from tests.conftest import function_linear, linear_op

HALVES: Counter[tuple[str, str]] = Counter()


def _count(half: str, phase: str) -> None:
    HALVES[half, phase] += 1


pair_linear = linear_op("split_flops::pair_linear", spy=_count)
# A single backward called per pass (split="phase"), honouring ctx.needs_input_grad; spied.
single_linear = linear_op(
    "split_flops::single_linear", backward="single", spy=_count, split="phase"
)
# The same backward split automatically: traced once, so a spy would count the trace only.
auto_linear = linear_op("split_flops::auto_linear", backward="single")


LAYERS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "pair": pair_linear,
    "single": single_linear,
    "auto": auto_linear,
    "fn": function_linear(spy=_count),
}


class Stack(nn.Module):
    def __init__(self, kind: str, depth: int = 3, width: int = 16, shared: bool = False) -> None:
        super().__init__()
        self.layer = LAYERS[kind]
        self.shared = shared
        self.ws = nn.ParameterList(
            nn.Parameter(torch.randn(width, width) / width**0.5) for _ in range(depth)
        )

    def forward(self, x: Tensor) -> Tensor:
        for i, w in enumerate(self.ws):
            x = torch.relu(self.layer(x, w))
            if self.shared and i == 0:
                x = torch.relu(self.layer(x, w))  # the first weight, used twice
        return x


Split = Callable[[nn.Module, Tensor, Tensor], Any]


def _torch_split(model: nn.Module, x: Tensor, g: Tensor, counter: FlopCounter) -> Tensor | None:
    out = model(x)
    counter.key = "I"
    (dx,), groups = torch_backward.stage_backward_input([out], [g], [x], model.parameters())
    counter.key = "W"
    torch_backward.stage_backward_weight(model.parameters(), groups)
    return dx


def _customgrad_split(
    model: nn.Module, x: Tensor, g: Tensor, counter: FlopCounter
) -> Tensor | None:
    out = model(x)
    counter.key = "I"
    (dx,), groups = stage_backward_input([out], [g], [x], model.parameters())
    counter.key = "W"
    stage_backward_weight(model.parameters(), groups)
    return dx


def _measure(
    kind: str, shared: bool, split: Callable[..., Tensor | None]
) -> tuple[dict[str, int], Counter[tuple[str, str]], Counter[tuple[str, str]]]:
    torch.manual_seed(0)
    model = Stack(kind, shared=shared)
    ref = copy.deepcopy(model)
    x = torch.randn(8, 16, requires_grad=True)
    g = torch.randn(8, 16)
    rx = x.detach().clone().requires_grad_()

    HALVES.clear()
    with FlopCounter() as full:
        out = ref(rx)
        full.key = "full"
        out.backward(g)
    full_halves = Counter(HALVES)

    HALVES.clear()
    with FlopCounter() as counter:
        dx = split(model, x, g, counter)
    split_halves = Counter(HALVES)

    torch.testing.assert_close(dx, rx.grad)
    for p, rp in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad)
    flops = {"full": full.by_key["full"], "I": counter.by_key["I"], "W": counter.by_key["W"]}
    return flops, full_halves, split_halves


@pytest.mark.parametrize("kind", ["pair", "single", "auto"])
@pytest.mark.parametrize(
    "split",
    [pytest.param(_torch_split, marks=TORCH_SPLIT), _customgrad_split],
    ids=["torch", "customgrad"],
)
def test_customgrad_ops_split_with_no_repeated_flops(kind: str, split: Callable[..., Any]) -> None:
    flops, full_halves, split_halves = _measure(kind, False, split)
    assert flops["I"] + flops["W"] == flops["full"]
    assert flops["I"] > 0 and flops["W"] > 0
    # Each half runs exactly as often as in the full backward; input halves only in I.
    assert sum(split_halves.values()) == sum(full_halves.values())
    assert split_halves["input", "weight"] == 0


@pytest.mark.parametrize("kind", ["pair", "single", "auto"])
def test_shared_weight_customgrad_split_does_no_repeated_work(kind: str) -> None:
    flops, full_halves, split_halves = _measure(kind, True, _customgrad_split)
    assert flops["I"] + flops["W"] == flops["full"]
    assert sum(split_halves.values()) == sum(full_halves.values())


@TORCH_SPLIT
@pytest.mark.parametrize("kind", ["pair", "single"])
def test_shared_weight_torch_split_repeats_the_outer_input_half(kind: str) -> None:
    flops, full_halves, split_halves = _measure(kind, True, _torch_split)
    # torch's W re-runs the second use's input half (the first use is still reachable).
    repeated = 2 * 8 * 16 * 16
    assert flops["I"] + flops["W"] == flops["full"] + repeated
    assert sum(split_halves.values()) == sum(full_halves.values()) + 1


@pytest.mark.parametrize("split", [pytest.param(_torch_split, marks=TORCH_SPLIT)], ids=["torch"])
def test_plain_function_repeats_its_whole_backward_under_torch(split: Callable[..., Any]) -> None:
    flops, full_halves, split_halves = _measure("fn", False, split)
    # Its needs_input_grad is fixed at forward time: each pass computes both gradients.
    assert flops["I"] + flops["W"] == 2 * flops["full"]
    assert split_halves["fn", "both"] == 2 * full_halves["fn", "both"]


def test_plain_function_runs_its_backward_once_under_customgrad() -> None:
    flops, full_halves, split_halves = _measure("fn", False, _customgrad_split)
    # Once, in I; W sends on the weight gradient it returned there.
    assert flops["I"] == flops["full"] and flops["W"] == 0
    assert split_halves["fn", "both"] == full_halves["fn", "both"] > 0


@pytest.mark.parametrize("shared", [False, True])
def test_customgrad_split_needs_no_engine_query(
    monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    # Without torch._C._will_engine_execute_node every customgrad backward computes all it can;
    # customgrad's split still hands weight halves from I to W, so nothing is repeated.
    from customgrad._torch import engine

    monkeypatch.setattr(engine, "_warned_no_query", True)
    monkeypatch.setattr(_runtime, "_edge_query", engine._every_edge)
    flops, full_halves, split_halves = _measure("pair", shared, _customgrad_split)
    assert flops["I"] + flops["W"] == flops["full"]
    assert sum(split_halves.values()) == sum(full_halves.values())


# ---------------------------------------------------------------- native weights used twice

pair_linear64 = linear_op("split_flops::pair_linear64")


class NativeTwice(nn.Module):
    """A native weight used twice in one stage (issue 24, item 4), in several forms.

    "linear": one ``nn.Linear`` (with bias) applied twice; "linear-nobias": without bias;
    "functional": ``F.linear`` with the same weight and bias twice; "between": ``F.linear``
    with a weight used below and above another native layer; "over-op": a native layer above a
    customgrad op with the same weight.
    """

    def __init__(self, form: str, width: int = 8) -> None:
        super().__init__()
        self.form = form
        self.lin = nn.Linear(width, width, bias=form != "linear-nobias", dtype=torch.float64)
        if form == "between":
            self.v = nn.Parameter(torch.randn(width, width, dtype=torch.float64) / width**0.5)

    def forward(self, x: Tensor) -> Tensor:
        w, b = self.lin.weight, self.lin.bias
        if self.form in ("linear", "linear-nobias"):
            return self.lin(torch.relu(self.lin(x)))
        if self.form == "functional":
            return nn.functional.linear(torch.relu(nn.functional.linear(x, w, b)), w, b)
        if self.form == "between":
            h = torch.relu(nn.functional.linear(x, w, b))
            h = torch.tanh(nn.functional.linear(h, self.v))
            return nn.functional.linear(h, w, b)
        assert self.form == "over-op"
        return nn.functional.linear(torch.relu(pair_linear64(x, w)), w, b)


NATIVE_FORMS = ["linear", "linear-nobias", "functional", "between", "over-op"]


def _flops_of(fn: Callable[[], Any]) -> int:
    with FlopCounter() as counter:
        fn()
    return counter.total


def _torch_split_flops(model: nn.Module, g: Tensor) -> tuple[int, int] | None:
    """FLOPs of torch's I and W for ``model``, or None where torch's split fails."""
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    out = model(x)
    groups: list[Any] = []
    try:
        flops_i = _flops_of(
            lambda: groups.append(
                torch_backward.stage_backward_input([out], [g], [x], model.parameters())
            )
        )
        flops_w = _flops_of(
            lambda: torch_backward.stage_backward_weight(model.parameters(), groups[0][1])
        )
    except RuntimeError:
        return None
    return flops_i, flops_w


@pytest.mark.parametrize("first", [False, True], ids=["stage", "first-stage"])
@pytest.mark.parametrize("form", NATIVE_FORMS)
def test_native_weight_used_twice_splits_with_no_repeated_flops(form: str, first: bool) -> None:
    # Before: W ran the outer layer's input gradient again (I 1024 + W 1536 against 2048 for
    # "linear-nobias"), as torch's W does; W now asks the outer layer for its weight side only.
    torch.manual_seed(0)
    model = NativeTwice(form)
    ref = copy.deepcopy(model)
    theirs = copy.deepcopy(model)
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=not first)
    g = torch.randn(4, 8, dtype=torch.float64)
    rx = x.detach().clone().requires_grad_(not first)
    out = ref(rx)
    full = _flops_of(lambda: out.backward(g))

    out = model(x)
    groups: list[Any] = []
    flops_i = _flops_of(
        lambda: groups.append(stage_backward_input([out], [g], [x], model.parameters()))
    )
    flops_w = _flops_of(lambda: stage_backward_weight(model.parameters(), groups[0][1]))
    assert flops_i + flops_w == full
    if not first:
        torch.testing.assert_close(groups[0][0][0], rx.grad)
        # Never more than torch's split, which repeats the outer layer's input gradient.
        torch_figures = _torch_split_flops(theirs, g)
        if torch_figures is None:  # torch's W frees a node it runs again
            # (before torch 2.13 its split refuses customgrad ops: "over-op")
            assert form == "between" or (form == "over-op" and not TORCH_SPLIT_RUNS_FUNCTIONS)
        else:
            assert flops_i == torch_figures[0]
            assert flops_w < torch_figures[1]
    for p, rp in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, rp.grad)


@pytest.mark.parametrize("form", ["linear", "functional", "over-op"])
def test_native_weight_used_twice_accumulates_and_fires_hooks_once(form: str) -> None:
    # Into an existing .grad (a later microbatch), with hooks that scale: each weight
    # accumulates once in W and each of its hooks fires once, as in a full backward; a hook on
    # the outer layer's output (the node W asks for its weight side) scales once too.
    torch.manual_seed(0)
    model = NativeTwice(form)
    ref = copy.deepcopy(model)
    fired: Counter[tuple[str, str]] = Counter()
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        p.grad = torch.ones_like(p)
        r.grad = torch.ones_like(r)
        p.register_hook(lambda g, n=name: fired.update([("tensor", n)]) or g * 2)  # type: ignore[misc]
        r.register_hook(lambda g: g * 2)
        p.register_post_accumulate_grad_hook(lambda _, n=name: fired.update([("post", n)]))
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, 8, dtype=torch.float64)

    def scaled(m: nn.Module, x: Tensor) -> Tensor:
        out = m(x)
        out.register_hook(lambda grad: grad * 3)
        return out

    scaled(ref, x.detach().requires_grad_()).backward(g)
    out = scaled(model, x)
    _, groups = stage_backward_input([out], [g], [x], model.parameters())
    assert not fired
    flops_w = _flops_of(lambda: stage_backward_weight(model.parameters(), groups))
    names = [n for n, _ in model.named_parameters()]
    assert fired == Counter({(h, n): 1 for h in ("tensor", "post") for n in names})
    for p, rp in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, rp.grad)
    assert flops_w == 2 * 2 * 4 * 8 * 8  # the two uses' weight gradients, nothing else


def _shared_through(form: str) -> tuple[Callable[[Tensor], Tensor], list[Tensor], Tensor]:
    """A weight used twice, reaching the layers through other nodes: (stage, weights, input)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(8, generator=gen, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    linear = nn.functional.linear

    def matmul(x: Tensor) -> Tensor:  # the weight's accumulator is the layers' own edge
        return torch.relu(x @ w) @ w

    def derived(x: Tensor) -> Tensor:  # one node made from the weight feeds both; a hook on it
        wd = w * 0.5
        wd.register_hook(lambda g: g * 2)
        return torch.relu(x @ wd) @ wd

    def batched(x: Tensor) -> Tensor:  # a 3-d input: the layers' input edges go through views
        return linear(torch.relu(linear(x, w, b)), w, b)

    def layer_norm(x: Tensor) -> Tensor:  # a native node other than a matmul, a layer between
        h = linear(nn.functional.layer_norm(x, (8,), bias=b), w)
        return nn.functional.layer_norm(torch.relu(h), (8,), bias=b)

    w32, b32 = w.detach().float().requires_grad_(), b.detach().float().requires_grad_()

    def autocast(x: Tensor) -> Tensor:  # bfloat16 casts of the weight and bias, made once each
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return linear(torch.relu(linear(x, w32, b32)), w32, b32).float()

    if form == "batched":
        return batched, [w, b], torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    if form == "layer-norm":
        return layer_norm, [w, b], x
    if form == "autocast":
        return autocast, [w32, b32], x.detach().float().requires_grad_()
    return {"matmul": matmul, "derived": derived}[form], [w], x


@pytest.mark.parametrize("form", ["matmul", "derived", "batched", "layer-norm", "autocast"])
def test_weight_used_twice_through_other_nodes_splits_with_no_repeated_flops(form: str) -> None:
    # W asks the top layer for its weight-side outputs only; they join W's one engine call as
    # its edges would have carried them (a bias summed to its shape, cast as the engine casts).
    stage, weights, x = _shared_through(form)
    out = stage(x)
    g = torch.randn_like(out)
    full = _flops_of(lambda: out.backward(g))
    ref = [x.grad, *(w.grad for w in weights)]
    x.grad = None
    for w in weights:
        w.grad = None
    out = stage(x)
    groups: list[Any] = []
    flops_i = _flops_of(lambda: groups.append(stage_backward_input([out], [g], [x], weights)))
    flops_w = _flops_of(lambda: stage_backward_weight(weights, groups[0][1]))
    assert flops_i + flops_w == full
    for got, want in zip([groups[0][0][0], *(w.grad for w in weights)], ref, strict=True):
        torch.testing.assert_close(got, want)


def test_weight_pass_runs_an_unaskable_node_clamped(monkeypatch: pytest.MonkeyPatch) -> None:
    # Where a node cannot be asked (torch does not say its edges' shapes), the engine runs it
    # again with its input-side outputs dropped: right gradients, its input gradient computed
    # again (as before, and as torch's W does).
    monkeypatch.setattr(_weight_pass, "ask_weight_sides", lambda *args: False)
    torch.manual_seed(0)
    model = NativeTwice("linear")
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, 8, dtype=torch.float64)
    ref(x.detach().requires_grad_()).backward(g)
    out = model(x)
    _, groups = stage_backward_input([out], [g], [x], model.parameters())
    flops_w = _flops_of(lambda: stage_backward_weight(model.parameters(), groups))
    assert flops_w == 3 * 2 * 4 * 8 * 8  # both weight gradients, and the top input gradient
    for p, rp in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, rp.grad)
