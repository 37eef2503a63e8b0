"""Backwards on several threads at once: no routing state is shared, no gradient is lost."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import torch
from torch import Tensor, nn

from customgrad.pipelining import WeightGradQueue, stage_backward_input, stage_backward_weight
from tests.conftest import linear_op

linear = linear_op("threads::linear")
THREADS = 8
MICROBATCHES = 25


class Net(nn.Module):
    """customgrad layers sharing a weight, with a native layer between them."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16) / 4)
        self.lin = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        return linear(torch.tanh(self.lin(torch.relu(linear(x, self.w)))), self.w)


def _run_threads(work: Callable[[int], None]) -> None:
    errors: list[BaseException] = []

    def target(i: int) -> None:
        try:
            work(i)
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]


def _data(i: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(i)
    return [
        (torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g))
        for _ in range(MICROBATCHES)
    ]


def _reference(net: Net, data: list[tuple[Tensor, Tensor]]) -> Net:
    ref = copy.deepcopy(net)
    for x, g in data:
        ref(x.requires_grad_()).backward(g)
        x.requires_grad_(False).grad = None
    return ref


def test_split_on_many_threads_matches_autograd() -> None:
    torch.manual_seed(0)
    nets = [Net() for _ in range(THREADS)]
    refs = [_reference(net, _data(i)) for i, net in enumerate(nets)]

    def work(i: int) -> None:
        net = nets[i]
        for x, g in _data(i):
            x.requires_grad_()
            _, groups = stage_backward_input([net(x)], [g], [x], net.parameters())
            stage_backward_weight(net.parameters(), groups)

    _run_threads(work)
    for net, ref in zip(nets, refs):
        for p, rp in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, rp.grad)


def test_one_queue_on_many_threads_loses_no_weight_gradient() -> None:
    torch.manual_seed(0)
    nets = [Net() for _ in range(THREADS)]
    refs = [_reference(net, _data(i)) for i, net in enumerate(nets)]
    queue = WeightGradQueue()

    def work(i: int) -> None:
        net = nets[i]
        for mb, (x, g) in enumerate(_data(i)):
            x.requires_grad_()
            with queue.microbatch(stage=i, microbatch=mb):
                out = net(x)
            queue.backward(out, g, inputs=[x])
            queue.run(i, mb)

    _run_threads(work)
    queue.finish()
    for net, ref in zip(nets, refs):
        for p, rp in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, rp.grad)
