"""FLOP counters see customgrad ops as they see native ones.

``torch.utils.flop_counter.FlopCounterMode`` around a model's forward and backward counts what
the same model written with native ops counts, for every way of writing an op: the pair, one
backward split automatically, one that runs once, ``from_function`` (annotated, and defined at
its first call inside the counter), and a region compiled by ``customgrad.compile``. An op whose
kernel a counter cannot see into gives its FLOPs with ``register_flops``. A pipeline step counts
per stage and per action (F / I / W) with ``ActionTimer(count_flops=True)``, and as a whole
under ``FlopCounterMode`` on customgrad's stage, its first step too.
"""

from __future__ import annotations

import gc
import itertools
import logging
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.pipelining import ScheduleZBVZeroBubble
from torch.utils.flop_counter import FlopCounterMode

import customgrad as cg
from customgrad._flops import FlopCounter
from customgrad.pipelining import ActionTimer, PipelineStage
from tests.conftest import linear_op

_ids = itertools.count()
ROWS, WIDTH, HIDDEN = 8, 16, 32


def unique(name: str) -> str:
    return f"test_flops{next(_ids)}::{name}"


def flops(fn: Callable[[], object]) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def native(x: Tensor, w: Tensor) -> Tensor:
    return x @ w.mT


def once_op() -> cg.CustomOp[..., Tensor]:
    """A linear whose single backward branches on a tensor value: it runs once, not split."""
    op = linear_op(unique("once"), backward=None)

    @op.register_backward
    def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor]:
        x, w = saved
        if grad.abs().max() > 1e6:
            grad = grad / grad.abs().max()
        return {"x": grad @ w, "weight": grad.mT @ x}

    return op


def _linear_function() -> type[torch.autograd.Function]:
    """A plain linear ``autograd.Function``, a class of its own for each ``from_function`` style."""

    class Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor, weight: Tensor) -> Tensor:
            ctx.save_for_backward(x, weight)
            return x @ weight.mT

        @staticmethod
        def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
            x, weight = ctx.saved_tensors
            return grad @ weight, grad.mT @ x

    return Linear


_CONVERTED, _DEFERRED = _linear_function(), _linear_function()


STYLES: dict[str, Callable[[], Callable[[Tensor, Tensor], Tensor]]] = {
    "pair": lambda: linear_op(unique("pair")),
    "automatic split": lambda: linear_op(unique("auto"), backward="every"),
    "runs once": once_op,
    "from_function": lambda: cg.from_function(_CONVERTED, unique("fn"), weights=("weight",)),
    # defined at its first call, which runs inside the counter
    "from_function, deferred": lambda: cg.from_function(
        _DEFERRED, unique("deferred"), weights=("weight",)
    ),
}


def mlp(linear: Callable[[Tensor, Tensor], Tensor], x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
    return linear(torch.relu(linear(x, w1)), w2)


def weights() -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(ROWS, WIDTH, generator=g).requires_grad_(),
        torch.randn(HIDDEN, WIDTH, generator=g).requires_grad_(),
        torch.randn(WIDTH, HIDDEN, generator=g).requires_grad_(),
    )


@pytest.mark.parametrize("style", STYLES)
def test_flop_counter_mode_counts_a_customgrad_model_as_the_native_model(style: str) -> None:
    op = STYLES[style]()
    x, w1, w2 = weights()
    want_forward = flops(lambda: mlp(native, x, w1, w2))
    want = flops(lambda: mlp(native, x, w1, w2).sum().backward())
    assert want_forward == 2 * 2 * ROWS * WIDTH * HIDDEN  # two matmuls
    assert want == 3 * want_forward  # and two more per matmul in the backward
    got = flops(lambda: mlp(op, x, w1, w2).sum().backward())  # the first call
    assert got == want
    assert flops(lambda: mlp(op, x, w1, w2)) == want_forward  # once each, not also inside
    assert flops(lambda: mlp(op, x, w1, w2).sum().backward()) == want


def test_a_region_compiled_by_customgrad_counts_as_the_native_block() -> None:
    op = linear_op(unique("compiled"))

    class Block(nn.Module):
        def __init__(self, linear: Callable[[Tensor, Tensor], Tensor]) -> None:
            super().__init__()
            self.linear = linear
            _, w1, w2 = weights()
            self.w1, self.w2 = nn.Parameter(w1.detach()), nn.Parameter(w2.detach())

        def forward(self, x: Tensor) -> Tensor:
            return x + mlp(self.linear, x, self.w1, self.w2)

    x = weights()[0]
    want_forward = flops(lambda: Block(native)(x))
    want = flops(lambda: Block(native)(x).sum().backward())
    block = cg.compile(Block(op), backend="aot_eager")  # a customgrad op inside the region
    block(x).sum().backward()  # compiles
    # The compiled forward, under a counter that lets compiled code run (FlopCounterMode does
    # not: torch runs a compiled frame eagerly under it), and its compiled backward.
    with FlopCounter() as forward:
        out = block(x)
    assert type(out.grad_fn).__name__ == "CompiledFunctionBackward"
    assert forward.total == want_forward
    assert flops(lambda: out.sum().backward()) == want - want_forward
    assert flops(lambda: block(x).sum().backward()) == want  # the whole step, torch's way


class _OpaqueMatmul:
    """A kernel no FLOP counter sees into (as a Triton kernel): a ``torch.library`` op."""

    def __init__(self) -> None:
        name = unique("opaque_mm")

        @torch.library.custom_op(name, mutates_args=())
        def mm(a: Tensor, b: Tensor) -> Tensor:
            return a @ b

        self.mm = mm


def test_register_flops_gives_the_flops_of_a_kernel_a_counter_cannot_see_into() -> None:
    opaque = _OpaqueMatmul().mm
    op = linear_op(unique("opaque"))
    op.register_kernel(None, lambda x, weight: opaque(x, weight.mT))
    x, w, _ = weights()
    assert flops(lambda: op(x, w)) == 0  # what torch's counter sees of the opaque kernel

    @op.register_flops
    def _(x: Tensor, weight: Tensor) -> int:
        return 2 * math.prod(x.shape) * weight.shape[0]

    assert flops(lambda: op(x, w)) == flops(lambda: native(x, w)) == 2 * ROWS * WIDTH * HIDDEN


def test_a_kernel_that_cannot_run_on_fake_tensors_counts_zero_and_says_how_to_give_its_flops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    name = unique("data_dependent")

    @cg.op(name)
    def op(x: Tensor) -> Tensor:
        return x[: int(x.sum().item() > 0) + 1] @ x.mT  # reads a value: no fake run

    x = torch.randn(4, 4)
    with caplog.at_level(logging.WARNING, logger="customgrad"):
        assert flops(lambda: op(x)) == 0
        assert flops(lambda: op(x)) == 0
    (record,) = caplog.records  # said once
    message = record.getMessage()
    assert message.startswith(
        f"{name}: FLOP counters count 0 FLOPs for this op's kernel: counting the torch ops it "
        f"runs on fake tensors raised "
    )
    assert "    @data_dependent.register_flops\n    def _(x):\n" in message
    with FlopCounter() as counter:  # customgrad's tools name it among what they cannot see
        op(x)
    assert counter.uncounted == {name: 1}


def test_the_derived_flops_are_counted_once_per_shape() -> None:
    runs: list[tuple[int, ...]] = []

    @cg.op(unique("counted_once"))
    def op(x: Tensor) -> Tensor:
        runs.append(tuple(x.shape))
        return x @ x.mT

    for rows in (4, 4, 8, 4):
        assert flops(lambda rows=rows: op(torch.randn(rows, 3))) == 2 * rows * 3 * rows
    # each call, and once per new shape on fake tensors
    assert runs == [(4, 3), (4, 3), (4, 3), (8, 3), (8, 3), (4, 3)]


def test_fake_and_meta_tensors_count_as_real_ones() -> None:
    op = linear_op(unique("fake"))
    x, w, _ = weights()
    want = flops(lambda: native(x, w).sum().backward())
    assert flops(lambda: op(x, w).sum().backward()) == want
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        xf = torch.randn(ROWS, WIDTH, requires_grad=True)
        wf = torch.randn(HIDDEN, WIDTH, requires_grad=True)
        assert flops(lambda: op(xf, wf).sum().backward()) == want
    xm = torch.randn(ROWS, WIDTH, device="meta", requires_grad=True)
    wm = torch.randn(HIDDEN, WIDTH, device="meta", requires_grad=True)
    assert flops(lambda: op(xm, wm).sum().backward()) == want


def test_a_redefined_op_is_counted_after_the_old_definition_is_collected() -> None:
    name = unique("redefined")
    linear_op(name)
    op = linear_op(name)  # a notebook cell run again
    gc.collect()  # the old definition's torch.library fragment is finalized
    x, w, _ = weights()
    assert flops(lambda: op(x, w)) == flops(lambda: native(x, w))
    ns, opname = name.split("::")
    by_name = getattr(getattr(torch.ops, ns), opname)
    assert flops(lambda: by_name(x, w)) == flops(lambda: native(x, w))


def test_a_formula_given_with_torch_s_api_is_refused_as_a_duplicate() -> None:
    # customgrad registers every op's formula: torch's register_flop_formula refuses a second
    # one (use op.register_flops).
    from torch.utils.flop_counter import register_flop_formula

    name = unique("duplicate")
    linear_op(name)
    ns, opname = name.split("::")
    with pytest.raises(RuntimeError, match="duplicate registrations"):
        register_flop_formula(getattr(getattr(torch.ops, ns), opname))(lambda *a, **k: 0)


# --------------------------------------------------------------------------------------------
# A pipeline step


N_MB = 4


class Stage(nn.Module):
    def __init__(self, linear: Callable[[Tensor, Tensor], Tensor]) -> None:
        super().__init__()
        self.linear = linear
        self.w1 = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)
        self.w2 = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(torch.relu(self.linear(x, self.w1)), self.w2)


def _loss(out: Tensor, target: Tensor) -> Tensor:
    return ((out - target) ** 2).sum()


def test_a_pipeline_step_counts_per_stage_and_action_and_as_a_whole(group: None) -> None:
    op = linear_op(unique("stage"))
    torch.manual_seed(0)
    x, y = torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)
    # one process: the same model's forward and backward, in native ops
    model = [Stage(native) for _ in range(2)]
    one_process = flops(lambda: _loss(model[1](model[0](x)), y).backward())

    timer = ActionTimer()
    cls = timer.stage_class(PipelineStage)
    stages = [cls(Stage(op), i, 2, torch.device("cpu")) for i in range(2)]
    schedule = ScheduleZBVZeroBubble(stages, N_MB, loss_fn=_loss)
    # The first step also infers the stages' shapes (a forward and a backward of torch's):
    # customgrad's stage keeps them out of the count.
    assert flops(lambda: schedule.step(x, target=y)) == one_process
    assert flops(lambda: schedule.step(x, target=y)) == one_process
    with timer.step(count_flops=True):
        schedule.step(x, target=y)
    (step,) = timer.gather()
    (rank,) = step.ranks
    per = {(s, k): sum(a.flops or 0 for a in rank.actions if (a.stage, a.kind) == (s, k))
           for s in (0, 1) for k in "FIW"}  # fmt: skip
    mm = 2 * (ROWS // N_MB) * WIDTH * WIDTH * N_MB  # one linear over the step's microbatches
    assert per == {
        (0, "F"): 2 * mm, (0, "I"): 0, (0, "W"): 3 * mm,  # stage 0's input needs no gradient
        (1, "F"): 2 * mm, (1, "I"): 2 * mm, (1, "W"): 2 * mm,
    }  # fmt: skip
    assert rank.flops() == one_process
