"""customgrad ops on a CUDA GPU: kernels, fake tensors and opcheck (``check_op``), inductor, the
split (I then W) against the full backward, and deferred weight work on its stream when W runs
from another. Run by ``python3 -m benchmarks.gpu_check`` (the tests marked ``cuda``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

import customgrad as cg
from customgrad.pipelining import WeightGradQueue, stage_backward_input, stage_backward_weight
from customgrad.testing import check_op
from tests._skips import NO_CUDA
from tests.conftest import linear_op

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA),
]

linear = linear_op("cuda_tests::linear", bias=True)


def _leaves(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g, dtype=dtype).cuda().requires_grad_() for s in shapes]


class Block(nn.Module):
    """A customgrad linear, then a native one."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.w = nn.Parameter(torch.randn(64, 32, generator=g) / 32**0.5)
        self.b = nn.Parameter(torch.zeros(64))
        self.out = nn.Linear(64, 32)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.out(torch.relu(linear(x, self.w, self.b)))


def test_op_on_cuda_passes_check_op() -> None:
    x, w, b = _leaves((4, 8), (6, 8), (6,), dtype=torch.float64)
    report = check_op(linear, x, w, b)
    assert report.ok, str(report)


def test_split_on_cuda_equals_the_full_backward() -> None:
    block = Block().cuda()
    ref = copy.deepcopy(block)
    (x,) = _leaves((16, 32))
    rx = x.detach().clone().requires_grad_()
    g = torch.randn(16, 32, device="cuda")
    ref(rx).backward(g)
    (dx,), groups = stage_backward_input([block(x)], [g], [x], block.parameters())
    assert block.w.grad is None  # the customgrad op's weight waits for W
    stage_backward_weight(block.parameters(), groups)
    torch.testing.assert_close(dx, rx.grad)
    for p, q in zip(block.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_compiled_block_with_inductor_on_cuda_splits_with_eager_gradients() -> None:
    ref = Block().cuda()
    block = cg.compile(copy.deepcopy(ref), backend="inductor")
    (x,) = _leaves((16, 32))
    rx = x.detach().clone().requires_grad_()
    g = torch.randn(16, 32, device="cuda")
    ref(rx).backward(g)
    (dx,), groups = stage_backward_input([block(x)], [g], [x], block.parameters())
    stage_backward_weight(block.parameters(), groups)
    torch.testing.assert_close(dx, rx.grad, rtol=1e-4, atol=1e-5)
    for p, q in zip(block.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


# torch 2.11 on an H100 warns that a gradient made on another stream reaches a weight's
# AccumulateGrad: the test runs W from a side stream on purpose, and checks the gradients.
@pytest.mark.filterwarnings("ignore:The AccumulateGrad node's stream does not match:UserWarning")
def test_queued_weight_work_runs_on_its_stream_when_w_runs_from_another() -> None:
    queue = WeightGradQueue()
    x, w, b = _leaves((64, 32), (16, 32), (16,))
    ref = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    linear(*ref).square().sum().backward()
    with queue.microbatch(0, 0):
        y = linear(x, w, b)
    queue.backward(y.square().sum(), inputs=[x])
    assert w.grad is None and b.grad is None
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        queue.run(0, 0)
    torch.cuda.synchronize()
    queue.finish()
    for got, want in zip((x, w, b), ref, strict=True):
        torch.testing.assert_close(got.grad, want.grad)
