"""What differs between the supported torch releases (2.11 to 2.15), each checked on the
release it is for: the adapters' probes against the behaviour they stand for, what customgrad
keeps alive where a Function node's handle does not, and the named error for what a release
cannot do (torch's own split with customgrad ops on 2.11 and 2.12)."""

from __future__ import annotations

import gc
import re
import weakref

import pytest
import torch
from torch.distributed.pipelining import _backward as torch_split

import customgrad as cg
from customgrad._releases import MSG_TORCH_SPLIT
from customgrad._torch import dynamo, functions
from customgrad.pipelining import WeightGradQueue, stage_backward_input, stage_backward_weight
from tests._skips import release_lacks
from tests.conftest import linear_op

linear = linear_op("releases::linear")

WEAK_HANDLES = not functions.handles_keep_nodes()
ONLY_WEAK = pytest.mark.skipif(
    not WEAK_HANDLES,
    reason=release_lacks("the weak Function node handles of torch 2.11 and 2.12 tested here"),
)


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


def _handle_after_detach(keep: bool) -> tuple[object, list[object]]:
    y = _Twice.apply(torch.ones(2, requires_grad=True))
    node = y.grad_fn
    kept = functions.keep_graphs([y]) if keep else []
    y.detach_()
    del y
    return node, kept


def test_probe_matches_what_a_kept_handle_does() -> None:
    node, _ = _handle_after_detach(keep=False)
    try:
        node.next_functions  # type: ignore[attr-defined] # noqa: B018
        readable = True
    except RuntimeError:
        readable = False
    assert readable is functions.handles_keep_nodes()


def test_keep_graphs_keeps_handles_readable_until_dropped() -> None:
    node, kept = _handle_after_detach(keep=True)
    assert len(node.next_functions) == 1  # type: ignore[attr-defined]
    assert len(kept) == (1 if WEAK_HANDLES else 0)  # nothing kept where handles keep nodes


def test_keep_graphs_keeps_no_output_memory() -> None:
    """The kept view's node saves nothing: the output itself is freed with its last reference."""
    y = _Twice.apply(torch.ones(1000, requires_grad=True))
    ref = weakref.ref(y)
    kept = functions.keep_graphs([y])
    del y
    gc.collect()
    assert ref() is None
    del kept


def test_split_backward_runs_after_outputs_are_gone() -> None:
    """customgrad's I detaches the stage outputs; W still reads the nodes it deferred, on every
    release (on 2.11 and 2.12 through what I keeps until W)."""
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3, requires_grad=True)
    ref_w = w.detach().clone().requires_grad_()
    linear(x.detach(), ref_w).sum().backward()
    y = linear(x, w)
    _, groups = stage_backward_input([y.sum()], None, [x], [w])
    del y
    gc.collect()
    stage_backward_weight([w], groups)
    torch.testing.assert_close(w.grad, ref_w.grad)


def test_queue_runs_w_after_outputs_are_gone() -> None:
    queue = WeightGradQueue()
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3, requires_grad=True)
    with queue.microbatch(0, 0):
        y = linear(x, w)
    queue.backward(y.sum(), inputs=[x])
    del y
    gc.collect()
    assert w.grad is None
    queue.run(0, 0)
    torch.testing.assert_close(w.grad, x.detach().sum(0).expand(3, 3))
    queue.finish()


@ONLY_WEAK
def test_torch_split_with_customgrad_ops_is_refused_with_a_named_error() -> None:
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3, requires_grad=True)
    y = linear(x, w)
    message = MSG_TORCH_SPLIT.format(op="releases::linear", version=torch.__version__)
    assert message.startswith(f"releases::linear: torch {torch.__version__}'s own split backward")
    with pytest.raises(cg.UnsupportedTorchError, match=re.escape(message)):
        torch_split.stage_backward_input([y], [torch.ones_like(y)], [x], [w])


def test_a_partial_backward_outside_a_split_is_not_refused() -> None:
    """``autograd.grad`` for the input alone (a gradient penalty) is not torch's split."""
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3, requires_grad=True)
    (dx,) = torch.autograd.grad(linear(x, w).sum(), [x])
    torch.testing.assert_close(dx, w.detach().sum(0).expand(2, 3))


class _TwoLinears(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16, dtype=torch.float64)
        self.fc2 = torch.nn.Linear(16, 8, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def test_freeze_probe_matches_what_a_compiled_module_computes_after_freezing() -> None:
    """A weight frozen after the first compile: right gradients on every release; the backward
    computes what eager computes where dynamo recompiles, one (4 x 8 x 16) matmul more (the
    frozen weight's gradient, dropped) where it does not (torch 2.11)."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    ref = _TwoLinears()
    m = cg.compile(_TwoLinears(), backend="aot_eager")
    m.load_state_dict(ref.state_dict())
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    m(x).sum().backward()
    m.zero_grad(set_to_none=True)
    counts, dxs = [], []
    for module in (ref, m):
        module.fc1.weight.requires_grad_(False)
        xi = x.detach().clone().requires_grad_()
        out = module(xi)
        with FlopCounterMode(display=False) as counter:
            out.sum().backward()
        counts.append(counter.get_total_flops())
        dxs.append(xi.grad)
        assert module.fc1.weight.grad is None
    torch.testing.assert_close([p.grad for p in m.parameters()], [p.grad for p in ref.parameters()])
    torch.testing.assert_close(dxs[1], dxs[0])
    extra = 0 if dynamo.guards_parameter_requires_grad() else 2 * 4 * 8 * 16
    assert counts[1] == counts[0] + extra
