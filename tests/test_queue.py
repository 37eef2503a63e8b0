"""WeightGradQueue: per (stage, microbatch) weight-gradient work, run later like autograd would."""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import customgrad as cg
from customgrad.pipelining import (
    MissingInputPassError,
    PendingWeightWorkError,
    StrayWeightWorkError,
    StreamSyncError,
    WeightGradQueue,
    WeightPassTwiceError,
)
from tests.conftest import linear_op

WEIGHT_CALLS: list[str] = []


def _spy(half: str, phase: str) -> None:
    if half == "weight":
        WEIGHT_CALLS.append(phase)


# Called per pass (split="phase"), so that the spy sees which pass runs each weight half.
linear = linear_op("queue_t::linear", backward="single", spy=_spy, split="phase")


class Net(nn.Module):
    """customgrad layers (one weight shared) and a native layer."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return linear(torch.tanh(self.lin(torch.relu(linear(x, self.w)))), self.w)


def _data(n: int) -> list[tuple[Tensor, Tensor]]:
    torch.manual_seed(1)
    return [(torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)) for _ in range(n)]


def _reference(net: Net, data: list[tuple[Tensor, Tensor]]) -> tuple[Net, list[Tensor]]:
    ref = copy.deepcopy(net)
    grads = []
    for x, g in data:
        rx = x.detach().clone().requires_grad_()
        ref(rx).backward(g)
        assert rx.grad is not None
        grads.append(rx.grad)
    return ref, grads


def test_hand_written_loop_matches_autograd() -> None:
    net = Net()
    data = _data(3)
    ref, ref_dx = _reference(net, data)
    queue = WeightGradQueue()
    for mb, (x, g) in enumerate(data):
        with queue.microbatch(stage=0, microbatch=mb):
            out = net(x)
        queue.backward(out, g, inputs=[x])  # I: customgrad weight halves are queued
        torch.testing.assert_close(x.grad, ref_dx[mb])
    assert net.w.grad is None
    assert net.lin.weight.grad is not None  # native weights: computed in the backward itself
    assert queue.pending() == [(0, 0), (0, 1), (0, 2)]
    for mb in (2, 0, 1):  # any order
        queue.run(0, mb)
    queue.finish()
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad)


def test_other_backwards_of_a_queued_forward_compute_what_they_ask_for() -> None:
    # Only the queue's own input pass defers: a plain backward, or autograd.grad for a gradient
    # penalty or a grad-norm log, computes its gradients now and queues nothing.
    net = Net()
    ((x, g),) = _data(1)
    ref, _ = _reference(net, [(x, g)])
    queue = WeightGradQueue()
    with queue.microbatch(0, 0):
        out = net(x)
    (gw,) = torch.autograd.grad(out, [net.w], g, retain_graph=True)
    torch.testing.assert_close(gw, ref.w.grad)
    out.backward(g)
    assert queue.pending() == []
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad)


def test_weight_halves_run_once_each_in_weight_phase() -> None:
    net = Net()
    queue = WeightGradQueue()
    ((x, g),) = _data(1)
    with queue.microbatch(0, 0):
        out = net(x)
    WEIGHT_CALLS.clear()
    queue.backward(out, g, inputs=[x])
    assert WEIGHT_CALLS == []
    queue.run(0, 0)
    assert WEIGHT_CALLS == ["weight", "weight"]


def _record_hooks(net: nn.Module) -> list[tuple[str, Tensor | None]]:
    seen: list[tuple[str, Tensor | None]] = []
    for name, p in net.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: seen.append((name, None if p.grad is None else p.grad.clone()))
        )
    return seen


def test_post_accumulate_grad_hooks_fire_once_per_microbatch_in_weight_pass() -> None:
    net = Net()
    data = _data(2)
    ref = copy.deepcopy(net)
    ref_seen = _record_hooks(ref)
    for x, g in data:
        ref(x.detach().requires_grad_()).backward(g)
    seen = _record_hooks(net)
    queue = WeightGradQueue()
    for mb, (x, g) in enumerate(data):
        with queue.microbatch(0, mb):
            out = net(x)
        queue.backward(out, g, inputs=[x])
        # I: the native layer's weights accumulate now; the queued weight is not touched.
        assert sorted(name for name, _ in seen) == ["lin.bias", "lin.weight"]
        assert all(grad is not None for _, grad in seen)
        assert net.w.grad is None
        seen.clear()
    queue.run(0, 0)
    assert [name for name, _ in seen] == ["w"]
    queue.run(0, 1)
    assert [name for name, _ in seen] == ["w", "w"]
    queue.finish()
    ref_w = [grad for name, grad in ref_seen if name == "w"]
    for (_, got), want in zip(seen, ref_w):
        torch.testing.assert_close(got, want)


def test_attached_plain_backward_defers_and_fires_deferred_hooks_early() -> None:
    # The documented limit of torch's own PipelineStage with the queue as dw_builder: its input
    # pass is a plain backward, so the engine runs the queued weight's accumulator in I with no
    # gradient (hooks see None). customgrad's PipelineStage(queue=...) does not.
    net = Net()
    ((x, g),) = _data(1)
    seen = _record_hooks(net)
    queue = WeightGradQueue()
    queue.attach(net, stage=0)
    net(x).backward(g)
    assert ("w", None) in seen and net.w.grad is None
    seen.clear()
    queue.dw_builder(0)()
    assert [name for name, _ in seen] == ["w"]
    queue.finish()


def test_attached_autograd_grad_is_computed_not_queued() -> None:
    net = Net()
    ((x, g),) = _data(1)
    ref, _ = _reference(net, [(x, g)])
    queue = WeightGradQueue()
    queue.attach(net, stage=0)
    (gw,) = torch.autograd.grad(net(x), [net.w], g)
    torch.testing.assert_close(gw, ref.w.grad)
    assert queue.pending() == []


def test_keys_are_per_stage() -> None:
    a, b = Net(), Net()
    queue = WeightGradQueue()
    ((x, g),) = _data(1)
    with queue.microbatch(0, 0):
        h = a(x)
    with queue.microbatch(1, 0):
        out = b(h)
    queue.backward(out, g, inputs=[x])
    assert queue.pending() == [(1, 0), (0, 0)]
    queue.run(1, 0)
    assert b.w.grad is not None and a.w.grad is None
    with pytest.raises(PendingWeightWorkError, match=re.escape("(0, 0): their W never ran")):
        queue.finish()
    queue.finish(stage=1)
    queue.run(0, 0)
    queue.finish()


def test_input_only_backward_queues_nothing() -> None:
    net = Net()
    queue = WeightGradQueue()
    ((x, g),) = _data(1)
    with queue.microbatch(0, 0):
        out = net(x)
    torch.autograd.grad(out, x, g)
    assert queue.pending() == []


def test_attach_numbers_forwards() -> None:
    net = Net()
    queue = WeightGradQueue()
    handle = queue.attach(net, stage=3)
    data = _data(2)
    for x, g in data:
        net(x).backward(g)
        queue.dw_builder(3)()  # as torch's stage does, right after each backward
    assert queue.pending() == []
    queue.finish()
    handle.remove()
    net(data[0][0]).backward(data[0][1])
    assert queue.pending() == []


def test_attached_module_run_outside_the_schedule_is_an_error() -> None:
    net = Net()
    queue = WeightGradQueue()
    queue.attach(net, stage=3)
    data = _data(2)
    net(data[0][0]).backward(data[0][1])  # outside the schedule: queued as (3, 0)
    net(data[1][0]).backward(data[1][1])  # the schedule's microbatch
    with pytest.raises(
        StrayWeightWorkError,
        match=re.escape(
            "WeightGradQueue.dw_builder(stage=3): expected the weight work of the one "
            "microbatch whose backward just ran, but work of 2 microbatches was queued since "
            "the last dw_builder call: (stage, microbatch) (3, 0), (3, 1). A forward and "
            "backward of a module attached with queue.attach() ran outside the pipeline "
            "schedule"
        ),
    ):
        queue.dw_builder(3)
    assert issubclass(StrayWeightWorkError, RuntimeError)
    assert issubclass(StrayWeightWorkError, cg.CustomGradError)
    queue.run(3, 0)
    queue.run(3, 1)
    queue.finish()


def test_dw_builder_takes_the_microbatch_just_backwarded() -> None:
    net = Net()
    data = _data(2)
    ref, _ = _reference(net, data)
    queue = WeightGradQueue()
    runners = []
    for mb, (x, g) in enumerate(data):
        with queue.microbatch(0, mb):
            out = net(x)
        queue.backward(out, g, inputs=[x])
        runners.append(queue.dw_builder())
    assert queue.pending() == [(0, 0), (0, 1)]
    runners[1]()
    assert queue.pending() == [(0, 0)]
    runners[0]()
    queue.finish()
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad)


# ---------------------------------------------------------------- errors


def test_weight_pass_without_input_pass() -> None:
    net = Net()
    queue = WeightGradQueue()
    with queue.microbatch(0, 0):
        net(torch.randn(4, 8))
    with pytest.raises(
        MissingInputPassError,
        match=re.escape(
            "WeightGradQueue.run(stage=0, microbatch=0): nothing was queued for this "
            "microbatch: its input pass (I) never ran"
        ),
    ):
        queue.run(0, 0)
    assert issubclass(MissingInputPassError, RuntimeError)
    assert issubclass(MissingInputPassError, cg.CustomGradError)


def test_weight_pass_twice() -> None:
    net = Net()
    queue = WeightGradQueue()
    ((x, g),) = _data(1)
    with queue.microbatch(0, 5):
        out = net(x)
    queue.backward(out, g, inputs=[x])
    queue.run(0, 5)
    with pytest.raises(
        WeightPassTwiceError,
        match=re.escape(
            "WeightGradQueue.run(stage=0, microbatch=5): W already ran for this microbatch"
        ),
    ):
        queue.run(0, 5)
    queue.finish()
    with pytest.raises(MissingInputPassError):
        queue.run(0, 5)  # a new step: the key is fresh again


def test_work_left_at_step_end() -> None:
    net = Net()
    queue = WeightGradQueue()
    ((x, g),) = _data(1)
    with queue.microbatch(2, 1):
        out = net(x)
    queue.backward(out, g, inputs=[x])
    with pytest.raises(
        PendingWeightWorkError,
        match=re.escape(
            "WeightGradQueue.finish(): weight-gradient work is still queued for "
            "(stage, microbatch) (2, 1): their W never ran"
        ),
    ):
        queue.finish()


# ---------------------------------------------------------------- streams (fakes on CPU)


class FakeEvent:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


class FakeStream:
    device = torch.device("cpu")

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log
        self.events: list[FakeEvent] = []

    def record_event(self) -> FakeEvent:
        self.events.append(FakeEvent())
        return self.events[-1]

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(f"{self.name} waits {other.name}")

    def __repr__(self) -> str:
        return self.name


class FakeStreams:
    """A stream policy over fake streams (the queue's ``streams=``), current one settable."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.s1, self.s2 = FakeStream("s1", self.log), FakeStream("s2", self.log)
        self.now = self.s1

    def current(self, device: torch.device) -> FakeStream:
        return self.now

    @contextlib.contextmanager
    def use(self, stream: FakeStream) -> Iterator[None]:
        self.log.append(f"run on {stream.name}")
        prev, self.now = self.now, stream
        try:
            yield
        finally:
            self.now = prev


def _queued_on_s1(queue: WeightGradQueue) -> None:
    net = Net()
    ((x, g),) = _data(1)
    with queue.microbatch(0, 0):
        out = net(x)
    queue.backward(out, g, inputs=[x])


def test_stream_work_runs_on_its_stream_and_current_waits() -> None:
    streams = FakeStreams()
    queue = WeightGradQueue(streams=streams)
    _queued_on_s1(queue)
    streams.now = streams.s2
    queue.run(0, 0)
    assert streams.log == [
        "s1 waits s2",
        "run on s1",
        "s2 waits s1",
        "s1 waits s2",
        "run on s1",
        "s2 waits s1",
    ]


def test_stream_without_sync_raises() -> None:
    streams = FakeStreams()
    queue = WeightGradQueue(sync_streams=False, streams=streams)
    _queued_on_s1(queue)
    streams.now = streams.s2
    with pytest.raises(
        StreamSyncError,
        match=re.escape(
            "WeightGradQueue.run(stage=0, microbatch=0): its work was queued on stream s1 and "
            "is run from stream s2, which has not waited for it."
        ),
    ):
        queue.run(0, 0)
    for event in streams.s1.events:
        event.done = True  # the caller synchronised
    queue.run(0, 0)
    assert streams.log == []


def test_same_stream_runs_in_place() -> None:
    streams = FakeStreams()
    queue = WeightGradQueue(sync_streams=False, streams=streams)
    _queued_on_s1(queue)
    queue.run(0, 0)
    assert streams.log == []


# ---------------------------------------------------------------- queue.backward: graph shapes


class Odd(nn.Module):
    """Weights reached in unusual ways: through a view, through an op with saved tensors, shared
    with a native op, derived from the input, and a customgrad op on the weight side."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.s = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "view":
            return linear(x, self.w.mT)
        if self.kind == "saved":  # MulBackward saves w and s: it must not run (and free) in I
            return linear(x, self.w * self.s)
        if self.kind == "native_too":  # w also reaches the output through a native op
            return linear(x, self.w) + x @ self.w
        if self.kind == "from_input":  # the "weight" depends on the stage input
            return linear(x, self.w + x[:1].expand(8, 8))
        if self.kind == "nested":  # the weight is itself a customgrad op's output
            return linear(x, linear(self.s, self.w))
        return linear(torch.relu(linear(x, self.w)), self.s)


@pytest.mark.parametrize("kind", ["view", "saved", "native_too", "from_input", "nested", "plain"])
@pytest.mark.parametrize("x_grad", [True, False], ids=["x_grad", "first_stage"])
def test_queue_backward_matches_autograd_and_fires_hooks_once(kind: str, x_grad: bool) -> None:
    torch.manual_seed(0)
    net = Odd(kind)
    ref = copy.deepcopy(net)
    x = torch.randn(4, 8, requires_grad=x_grad)
    g = torch.randn(4, 8)
    rx = x.detach().clone().requires_grad_(x_grad)
    ref(rx).backward(g)
    seen = _record_hooks(net)
    queue = WeightGradQueue()
    with queue.microbatch(0, 0):
        out = net(x)
    queue.backward(out, g, inputs=[x])
    in_input_pass = [name for name, _ in seen]
    if x_grad:
        torch.testing.assert_close(x.grad, rx.grad)
    computed_in_input_pass = kind == "native_too" or (kind == "from_input" and x_grad)
    assert queue.pending() == ([] if computed_in_input_pass else [(0, 0)])
    if not computed_in_input_pass:
        queue.run(0, 0)
    queue.finish()
    used = []
    for (name, p), rp in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad)
        if rp.grad is not None:
            used.append(name)
    # Every hook fires once per backward, with the full gradient.
    assert sorted(name for name, _ in seen) == sorted(used)
    for name, grad in seen:
        torch.testing.assert_close(grad, dict(ref.named_parameters())[name].grad)
    # Deferred weights do not accumulate in I; the others do (the input pass needs them there).
    assert in_input_pass == (["w"] if computed_in_input_pass else [])


def test_queue_backward_does_not_requeue_in_weight_pass() -> None:
    net = Odd("nested")
    queue = WeightGradQueue()
    x = torch.randn(4, 8, requires_grad=True)
    with queue.microbatch(0, 0):
        out = net(x)
    queue.backward(out.sum(), inputs=[x])
    assert queue.pending() == [(0, 0)]
    queue.run(0, 0)
    assert queue.pending() == []
    queue.finish()


def test_queue_backward_of_a_non_differentiable_output_raises_as_torch() -> None:
    queue = WeightGradQueue()
    with pytest.raises(RuntimeError, match=re.escape("does not require grad")):
        queue.backward(torch.ones(()))


def test_input_only_backward_between_queue_passes_queues_nothing() -> None:
    net = Net()
    queue = WeightGradQueue()
    ((x, g),) = _data(1)
    with queue.microbatch(0, 0):
        out = net(x)
    (dx,) = torch.autograd.grad(out, x, g, retain_graph=True)
    assert queue.pending() == []
    queue.backward(out, g, inputs=[x])
    torch.testing.assert_close(x.grad, dx)
    queue.run(0, 0)
    queue.finish()


# --- W inside a collective's wait: overlap() and run_while() ----------------------------------


class Sending:
    """Stands for an async collective's ``Work``: done after ``polls`` checks; counts waits."""

    def __init__(self, polls: int = 1_000) -> None:
        self.polls, self.waited = polls, 0

    def is_completed(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def wait(self) -> bool:
        self.waited += 1
        return True


def _queued(queue: WeightGradQueue, net: Net, n: int) -> list[tuple[Tensor, Tensor]]:
    """``n`` microbatches through I (their W queued), and their data."""
    data = _data(n)
    for mb, (x, g) in enumerate(data):
        with queue.microbatch(0, mb):
            out = net(x)
        queue.backward(out, g, inputs=[x])
    return data


def test_run_while_outside_overlap_only_waits() -> None:
    net, queue = Net(), WeightGradQueue()
    _queued(queue, net, 2)
    work = Sending()
    assert queue.run_while(work) == []
    assert work.waited == 1 and queue.pending() == [(0, 0), (0, 1)] and net.w.grad is None
    queue.run(0, 0)
    queue.run(0, 1)
    queue.finish()


def test_run_while_runs_queued_w_oldest_first_while_in_flight() -> None:
    net, queue = Net(), WeightGradQueue()
    data = _queued(queue, net, 3)
    ref, _ = _reference(net, data)
    work = Sending()
    with queue.overlap():
        assert queue.run_while(work) == [(0, 0), (0, 1), (0, 2)]
    assert work.waited == 1 and queue.pending() == []
    queue.finish()
    for p, rp in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, rp.grad)


def test_run_while_runs_one_w_then_stops_once_the_collective_is_done() -> None:
    # The first queued W is due anyway: it runs; the next only while the collective is in
    # flight (here it completes at the second check). What is left stays queued.
    net, queue = Net(), WeightGradQueue()
    _queued(queue, net, 3)
    with queue.overlap():
        assert queue.run_while(Sending(polls=0)) == [(0, 0)]
        assert queue.run_while(Sending(polls=1)) == [(0, 1)]
    assert queue.pending() == [(0, 2)]
    queue.run(0, 2)
    queue.finish()


def test_overlap_keys_choose_which_w_may_run_and_in_which_order() -> None:
    net, queue = Net(), WeightGradQueue()
    _queued(queue, net, 3)
    with queue.overlap([(0, 2), (0, 7), (0, 0)]):  # (0, 7): never queued, passed over
        assert queue.run_while(Sending()) == [(0, 2), (0, 0)]
        assert queue.run_while(Sending()) == []  # both ran
    assert queue.pending() == [(0, 1)] and queue.ran(0, 2) and not queue.ran(0, 1)
    queue.run(0, 1)
    queue.finish()


def test_another_queue_s_overlap_runs_nothing_here() -> None:
    net, queue, other = Net(), WeightGradQueue(), WeightGradQueue()
    _queued(queue, net, 1)
    with other.overlap():
        assert queue.run_while(Sending()) == []
    with queue.overlap(), other.overlap():  # the innermost block of this queue counts
        assert queue.run_while(Sending()) == [(0, 0)]
    queue.finish()


def test_a_backward_s_wait_never_starts_w() -> None:
    # The gradient's all-to-all of one microbatch's I waits inside the engine: no W runs there,
    # even inside overlap(); W of the microbatch queued before runs in the next forward's wait.
    net, queue = Net(), WeightGradQueue()
    _queued(queue, net, 1)
    ran: list[list[tuple[int, int]]] = []

    class Exchange(torch.autograd.Function):  # an all-to-all stand-in, waited through the queue
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> Tensor:
            ran.append(queue.run_while(Sending()))
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: Tensor) -> Tensor:
            ran.append(queue.run_while(Sending()))
            return grad

    ((x, g),) = _data(1)
    with queue.overlap():
        with queue.microbatch(0, 1):
            out = Exchange.apply(net(x))
        queue.backward(out, g, inputs=[x])
    assert ran == [[(0, 0)], []]
    queue.run(0, 1)
    queue.finish()
