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

from customgrad import _autograd
from customgrad._flops import FlopCounter
from customgrad.pipelining import stage_backward_input, stage_backward_weight
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
@pytest.mark.parametrize("split", [_torch_split, _customgrad_split], ids=["torch", "customgrad"])
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


@pytest.mark.parametrize("kind", ["pair", "single"])
def test_shared_weight_torch_split_repeats_the_outer_input_half(kind: str) -> None:
    flops, full_halves, split_halves = _measure(kind, True, _torch_split)
    # torch's W re-runs the second use's input half (the first use is still reachable).
    repeated = 2 * 8 * 16 * 16
    assert flops["I"] + flops["W"] == flops["full"] + repeated
    assert sum(split_halves.values()) == sum(full_halves.values()) + 1


@pytest.mark.parametrize("split", [_torch_split, _customgrad_split], ids=["torch", "customgrad"])
def test_plain_function_repeats_its_whole_backward(split: Callable[..., Any]) -> None:
    flops, full_halves, split_halves = _measure("fn", False, split)
    # Its needs_input_grad is fixed at forward time: each pass computes both gradients.
    assert flops["I"] + flops["W"] == 2 * flops["full"]
    assert split_halves["fn", "both"] == 2 * full_halves["fn", "both"]


@pytest.mark.parametrize("shared", [False, True])
def test_customgrad_split_needs_no_engine_query(
    monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    # Without torch._C._will_engine_execute_node every customgrad backward computes all it can;
    # customgrad's split still hands weight halves from I to W, so nothing is repeated.
    monkeypatch.setattr(_autograd, "_will_execute", None)
    monkeypatch.setattr(_autograd, "_warned_no_engine_query", True)
    flops, full_halves, split_halves = _measure("pair", shared, _customgrad_split)
    assert flops["I"] + flops["W"] == flops["full"]
    assert sum(split_halves.values()) == sum(full_halves.values())
