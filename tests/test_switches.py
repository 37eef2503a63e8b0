"""The debugging switches: ``cg.no_split()`` / ``CUSTOMGRAD_SPLIT=0`` make customgrad ops behave
like plain ``autograd.Function``s (whole backward in each pass, same gradients);
``CUSTOMGRAD_FASTPATH`` is retired (it warns); every call records the op's one node."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.pipelining import _backward as torch_backward
from torch.utils.flop_counter import FlopCounterMode

import customgrad as cg
from customgrad import _switches
from customgrad.pipelining import stage_backward_input, stage_backward_weight
from tests._skips import TORCH_SPLIT
from tests.conftest import function_linear, linear_op

DT = torch.float64
LINEARS = {
    "pair": linear_op("test_switches::pair"),
    "auto": linear_op("test_switches::auto", backward="single"),
    "phase": linear_op("test_switches::phase", backward="single", split="phase"),
}
N, D = 8, 16
MATMUL = 2 * N * D * D  # one (8 x 16) @ (16 x 16)


class Stack(nn.Module):
    def __init__(self, layer: Any) -> None:
        super().__init__()
        self.layer = layer
        torch.manual_seed(0)
        self.ws = nn.ParameterList(nn.Parameter(torch.randn(D, D, dtype=DT)) for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        for w in self.ws:
            x = torch.tanh(self.layer(x, w))
        return x


def reference(model: Stack, x: Tensor) -> Tensor:
    for w in model.ws:
        x = torch.tanh(x @ w.mT)
    return x


def split_passes(model: Stack, x: Tensor, g: Tensor, split: Any) -> tuple[int, int, list[Tensor]]:
    """FLOPs of the input and the weight pass of ``split`` (torch's or customgrad's), and
    ``[dx, *weight grads]``."""
    stage_input, stage_weight = split
    out = model(x)
    with FlopCounterMode(display=False) as flops_i:
        (dx,), groups = stage_input([out], [g], [x], model.parameters())
    with FlopCounterMode(display=False) as flops_w:
        stage_weight(model.parameters(), groups)
    grads = [dx, *(w.grad for w in model.ws)]
    return flops_i.get_total_flops(), flops_w.get_total_flops(), grads


SPLITS = {
    "torch": (torch_backward.stage_backward_input, torch_backward.stage_backward_weight),
    "customgrad": (stage_backward_input, stage_backward_weight),
}


@pytest.mark.parametrize("split", [pytest.param("torch", marks=TORCH_SPLIT), "customgrad"])
@pytest.mark.parametrize("kind", LINEARS)
def test_no_split_computes_the_whole_backward_in_each_pass_with_the_same_gradients(
    kind: str, split: str
) -> None:
    x = torch.randn(N, D, dtype=DT, requires_grad=True)
    g = torch.randn(N, D, dtype=DT)
    model = Stack(LINEARS[kind])
    want = torch.autograd.grad(reference(model, x), [x, *model.ws], g)
    # 2 layers, each computing dx and dw once
    flops_i, flops_w, got = split_passes(model, x, g, SPLITS[split])
    assert flops_i + flops_w == 4 * MATMUL  # split: nothing computed twice
    torch.testing.assert_close(got, list(want))

    model = Stack(LINEARS[kind])
    with cg.no_split():
        assert not cg._switches.split_enabled()
        flops_i, flops_w, got = split_passes(model, x, g, SPLITS[split])
    assert cg._switches.split_enabled()
    torch.testing.assert_close(got, list(want))
    # exactly the work of the same stack of plain autograd.Functions through the same split
    # run torch's way (the whole backward in each pass that reaches a node; customgrad's split
    # runs plain Functions once unless run_functions_once=False)
    twice = SPLITS[split]
    if split == "customgrad":
        twice = (functools.partial(stage_backward_input, run_functions_once=False), twice[1])
    function_flops = split_passes(Stack(function_linear()), x, g, twice)[:2]
    assert (flops_i, flops_w) == function_flops
    assert flops_i + flops_w > 4 * MATMUL


def test_no_split_nests_and_restores() -> None:
    with cg.no_split():
        with cg.no_split():
            assert not _switches.split_enabled()
        assert not _switches.split_enabled()
    assert _switches.split_enabled()


SCRIPT = """
import torch
from torch.distributed.pipelining import _backward as tb
from torch.utils.flop_counter import FlopCounterMode
import customgrad as cg
from customgrad._autograd import _node_apply
from tests.conftest import function_linear, linear_op

op = linear_op("subprocess_switches::auto", backward="single")
x = torch.randn(8, 16, requires_grad=True)
w = torch.randn(16, 16, requires_grad=True)
out = op(x, w)
one_node = type(out.grad_fn).apply is _node_apply
with FlopCounterMode(display=False) as fi:
    _, groups = tb.stage_backward_input([out], [torch.ones_like(out)], [x], [w])
with FlopCounterMode(display=False) as fw:
    tb.stage_backward_weight([w], groups)
print(fi.get_total_flops(), fw.get_total_flops(), one_node)
"""


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, "4096 4096 True"),  # one matmul per pass
        ({"CUSTOMGRAD_SPLIT": "0"}, "8192 8192 True"),  # the whole backward in each pass
        ({"CUSTOMGRAD_FASTPATH": "0"}, "4096 4096 True"),  # retired: no effect (it warns)
    ],
    ids=["default", "split-off", "fastpath-retired"],
)
@TORCH_SPLIT  # its subprocess runs torch's split
def test_environment_variables(env: dict[str, str], want: str) -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CUSTOMGRAD_")}
    environ.update(env, PYTHONPATH=os.pathsep.join([root, environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT)],
        capture_output=True,
        text=True,
        env=environ,
        cwd=root,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == want
