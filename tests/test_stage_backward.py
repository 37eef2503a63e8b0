"""torch's zero-bubble schedules on customgrad.pipelining.PipelineStage (one process, gloo)."""

from __future__ import annotations

import copy
import re
from collections import Counter
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.pipelining import (
    PipelineStage as TorchPipelineStage,
)
from torch.distributed.pipelining import (
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from customgrad._flops import FlopCounter
from customgrad.pipelining import PendingWeightWorkError, PipelineStage, WeightGradQueue
from tests._skips import TORCH_SPLIT, TORCH_STAGE_V
from tests.conftest import function_linear, linear_op

CALLS: Counter[tuple[str, str]] = Counter()
STEP_CALLS: Counter[tuple[str, str]] = Counter()


def _count(half: str, phase: str) -> None:
    CALLS[half, phase] += 1


linear = linear_op("stage_bw::linear", spy=_count)
fn_linear = function_linear(spy=_count)


class SharedOnly(nn.Module):
    """``op(relu(op(x, w)), w)``: torch's W re-runs the outer op's input half."""

    def __init__(self, kind: str, width: int = 8) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x: Tensor) -> Tensor:
        return linear(torch.relu(linear(x, self.w)), self.w)


class Block(nn.Module):
    """Two layers sharing nothing, then a layer reusing the first weight."""

    def __init__(self, kind: str, width: int = 8) -> None:
        super().__init__()
        self.kind = kind
        self.w1 = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.w2 = nn.Parameter(torch.randn(width, width) / width**0.5)

    def _lin(self, x: Tensor, w: Tensor) -> Tensor:
        if self.kind == "cg":
            return linear(x, w)
        if self.kind == "fn":
            return fn_linear(x, w)
        return nn.functional.linear(x, w)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self._lin(x, self.w1))
        return torch.tanh(self._lin(torch.relu(self._lin(h, self.w2)), self.w1))


def _loss(out: Tensor, target: Tensor) -> Tensor:
    return ((out - target) ** 2).sum()


SCHEDULES = [ScheduleZBVZeroBubble, ScheduleInterleavedZeroBubble, ScheduleDualPipeV]
N_MB = 4


def _run(
    schedule_cls: Any,
    kind: str,
    stage_cls: Any = PipelineStage,
    module_cls: Any = None,
    **stage_kwargs: Any,
) -> tuple[list[nn.Module], nn.Module]:
    torch.manual_seed(0)
    module_cls = module_cls or Block
    mods = [module_cls(kind), module_cls(kind)]
    ref = nn.Sequential(*copy.deepcopy(mods))
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    stages = [stage_cls(m, i, 2, torch.device("cpu"), **stage_kwargs) for i, m in enumerate(mods)]
    schedule = schedule_cls(stages, n_microbatches=N_MB, loss_fn=_loss)
    schedule.step(x, target=y)  # the first step also infers shapes (with a backward of its own)
    for m in mods:
        m.zero_grad()
    CALLS.clear()
    schedule.step(x, target=y)
    STEP_CALLS.clear()
    STEP_CALLS.update(CALLS)
    for xi, yi in zip(x.chunk(N_MB), y.chunk(N_MB)):
        (_loss(ref(xi), yi) / N_MB).backward()
    return mods, ref


def _calls(half: str) -> int:
    return sum(n for (h, _), n in STEP_CALLS.items() if h == half)


def _check(mods: list[nn.Module], ref: nn.Module) -> None:
    got = [p.grad for m in mods for p in m.parameters()]
    for g, p in zip(got, ref.parameters()):
        torch.testing.assert_close(g, p.grad)


@pytest.mark.parametrize("kind", ["cg", "fn", "native"])
@pytest.mark.parametrize("schedule_cls", SCHEDULES)
def test_schedules_match_full_backward(group: None, schedule_cls: Any, kind: str) -> None:
    _check(*_run(schedule_cls, kind))


@pytest.mark.parametrize("schedule_cls", SCHEDULES)
def test_each_backward_half_runs_once_per_microbatch(group: None, schedule_cls: Any) -> None:
    _check(*_run(schedule_cls, "cg"))
    # 2 stages x 3 op calls x microbatches; the very first op's input (the batch) needs no grad
    assert _calls("weight") == 2 * 3 * N_MB
    assert _calls("input") == (2 * 3 - 1) * N_MB


@TORCH_STAGE_V
@TORCH_SPLIT
@pytest.mark.parametrize("schedule_cls", [ScheduleZBVZeroBubble, ScheduleInterleavedZeroBubble])
def test_torch_stage_repeats_work_that_customgrad_stage_does_not(
    group: None, schedule_cls: Any
) -> None:
    # torch's own stage and split: in the last stage's W, the shared weight makes torch re-run
    # the outer op's input half; customgrad's stage runs each half once.
    _check(*_run(schedule_cls, "cg", module_cls=SharedOnly))
    assert _calls("input") == (2 * 2 - 1) * N_MB
    _check(*_run(schedule_cls, "cg", stage_cls=TorchPipelineStage, module_cls=SharedOnly))
    assert _calls("input") > (2 * 2 - 1) * N_MB
    assert _calls("weight") == 2 * 2 * N_MB


@pytest.mark.parametrize("schedule_cls", SCHEDULES)
def test_stage_with_queue(group: None, schedule_cls: Any) -> None:
    queue = WeightGradQueue()
    _check(*_run(schedule_cls, "cg", queue=queue))
    assert queue.pending() == []
    assert _calls("weight") == 2 * 3 * N_MB
    assert _calls("input") == (2 * 3 - 1) * N_MB


@TORCH_STAGE_V
def test_torch_stage_with_queue_dw_builder(group: None) -> None:
    queue = WeightGradQueue()
    torch.manual_seed(0)
    mods = [Block("cg"), Block("cg")]
    ref = nn.Sequential(*copy.deepcopy(mods))
    handles = [queue.attach(m, i) for i, m in enumerate(mods)]
    stages = [
        TorchPipelineStage(m, i, 2, torch.device("cpu"), dw_builder=queue.dw_builder)
        for i, m in enumerate(mods)
    ]
    schedule = ScheduleZBVZeroBubble(stages, n_microbatches=N_MB, loss_fn=_loss)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    schedule.step(x, target=y)  # the first step also infers shapes
    queue.finish()
    for m in mods:
        m.zero_grad()
    CALLS.clear()
    schedule.step(x, target=y)
    assert sum(n for (h, _), n in CALLS.items() if h == "weight") == 2 * 3 * N_MB
    assert sum(n for (h, _), n in CALLS.items() if h == "input") == (2 * 3 - 1) * N_MB
    queue.finish()
    for h in handles:
        h.remove()
    for xi, yi in zip(x.chunk(N_MB), y.chunk(N_MB)):
        (_loss(ref(xi), yi) / N_MB).backward()
    _check(mods, ref)


def test_stage_queue_and_dw_builder_exclusive(group: None) -> None:
    with pytest.raises(ValueError, match=re.escape("pass either queue= or dw_builder=")):
        PipelineStage(
            Block("cg"),
            0,
            2,
            torch.device("cpu"),
            queue=WeightGradQueue(),
            dw_builder=lambda: lambda: None,
        )


def test_stage_reports_work_left_at_step_end(group: None) -> None:
    queue = WeightGradQueue()
    stage = PipelineStage(Block("cg"), 0, 2, torch.device("cpu"), queue=queue)
    x = torch.randn(2, 8, requires_grad=True)
    with queue.microbatch(0, 7):
        out = stage.submod(x)
    queue.backward(out.sum(), inputs=[x])
    with pytest.raises(PendingWeightWorkError, match=re.escape("(0, 7): their W never ran")):
        stage.perform_reduce_grad(1)
    queue.run(0, 7)
    stage.perform_reduce_grad(1)


def _hook_log(mods: list[nn.Module]) -> list[tuple[int, bool]]:
    """Every post-accumulate-grad hook call: (parameter id, whether .grad was set)."""
    log: list[tuple[int, bool]] = []
    for m in mods:
        for p in m.parameters():
            p.register_post_accumulate_grad_hook(lambda p: log.append((id(p), p.grad is not None)))
    return log


@pytest.mark.parametrize("schedule_cls", SCHEDULES)
def test_stage_with_queue_fires_each_hook_once_per_microbatch(
    group: None, schedule_cls: Any
) -> None:
    torch.manual_seed(0)
    mods = [Block("cg"), Block("cg")]
    ref = nn.Sequential(*copy.deepcopy(mods))
    queue = WeightGradQueue()
    stages = [PipelineStage(m, i, 2, torch.device("cpu"), queue=queue) for i, m in enumerate(mods)]
    schedule = schedule_cls(stages, n_microbatches=N_MB, loss_fn=_loss)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    schedule.step(x, target=y)  # the first step also infers shapes
    for m in mods:
        m.zero_grad()
    log = _hook_log(mods)
    schedule.step(x, target=y)
    params = [p for m in mods for p in m.parameters()]
    assert Counter(log) == {(id(p), True): N_MB for p in params}
    for xi, yi in zip(x.chunk(N_MB), y.chunk(N_MB)):
        (_loss(ref(xi), yi) / N_MB).backward()
    _check(mods, ref)


@TORCH_STAGE_V
def test_torch_stage_with_queue_dw_builder_fires_hooks_in_input_pass_too(group: None) -> None:
    # The documented limit of torch's own stage: its I is a plain full backward, so the engine
    # also runs the queued weights' accumulators there, with no gradient.
    torch.manual_seed(0)
    mods = [Block("cg"), Block("cg")]
    queue = WeightGradQueue()
    for i, m in enumerate(mods):
        queue.attach(m, i)
    stages = [
        TorchPipelineStage(m, i, 2, torch.device("cpu"), dw_builder=queue.dw_builder)
        for i, m in enumerate(mods)
    ]
    schedule = ScheduleZBVZeroBubble(stages, n_microbatches=N_MB, loss_fn=_loss)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    schedule.step(x, target=y)
    queue.finish()
    for m in mods:
        m.zero_grad()
    log = _hook_log(mods)
    schedule.step(x, target=y)
    queue.finish()
    params = [p for m in mods for p in m.parameters()]
    assert Counter(pid for pid, _ in log) == {id(p): 2 * N_MB for p in params}
    # Each weight's first hook call of the step comes in I, before any gradient reached it.
    assert Counter(pid for pid, has_grad in log if not has_grad) == {id(p): 1 for p in params}


class NativeMLP(nn.Module):
    """Native layers only (no weight used twice): torch's split does each FLOP once."""

    def __init__(self, kind: str, width: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(width, width), nn.ReLU(), nn.LayerNorm(width), nn.Linear(width, width)
        )

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.net(x))


def _step_flops(
    schedule_cls: Any, stage_cls: Any, module_cls: Any, kind: str = ""
) -> tuple[int, int, list[nn.Module], nn.Module]:
    """FLOPs of a zero-bubble step of two stages and of the microbatches' full backwards."""
    torch.manual_seed(0)
    mods = [module_cls(kind), module_cls(kind)]
    ref = nn.Sequential(*copy.deepcopy(mods))
    stages = [stage_cls(m, i, 2, torch.device("cpu")) for i, m in enumerate(mods)]
    schedule = schedule_cls(stages, n_microbatches=N_MB, loss_fn=_loss)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    schedule.step(x, target=y)  # the first step also infers shapes
    for m in mods:
        m.zero_grad()
    with FlopCounter() as step:
        schedule.step(x, target=y)
    with FlopCounter() as full:
        for xi, yi in zip(x.chunk(N_MB), y.chunk(N_MB)):
            (_loss(ref(xi), yi) / N_MB).backward()
    return step.total, full.total, mods, ref


@pytest.mark.parametrize(
    "stage_cls",
    [PipelineStage, pytest.param(TorchPipelineStage, marks=TORCH_STAGE_V)],
    ids=["cg", "torch"],
)
@pytest.mark.parametrize("schedule_cls", SCHEDULES)
def test_native_stage_step_does_each_flop_once(
    group: None, schedule_cls: Any, stage_cls: Any
) -> None:
    # A zero-bubble step of native layers does the FLOPs of the microbatches' full backwards,
    # on customgrad's stage as on torch's (customgrad's W computed input gradients again).
    step, full, mods, ref = _step_flops(schedule_cls, stage_cls, NativeMLP)
    assert step == full
    _check(mods, ref)


@pytest.mark.parametrize("schedule_cls", SCHEDULES)
def test_native_weight_used_twice_stage_step_does_each_flop_once(
    group: None, schedule_cls: Any
) -> None:
    # Block("native") uses its first weight again above its second layer: customgrad's W asks
    # that top layer for its weight gradient only (it computed its input gradient again, as
    # torch's W does, issue 24 item 4).
    step, full, mods, ref = _step_flops(schedule_cls, PipelineStage, Block, "native")
    assert step == full
    _check(mods, ref)
