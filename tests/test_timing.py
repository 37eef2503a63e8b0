"""ActionTimer: what it records on torch's schedules (one process, gloo), and its arithmetic.

Waits for a peer need two ranks: ``tests/test_pipeline_mp.py`` checks them on real runs.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage as TorchPipelineStage
from torch.distributed.pipelining import Schedule1F1B, ScheduleZBVZeroBubble

import customgrad as cg
from customgrad.pipelining import (
    ActionEvent,
    ActionTimer,
    PipelineStage,
    RankStep,
    StageCosts,
    StepTimeline,
    WaitEvent,
    stage_costs,
)
from tests._skips import TORCH_SPLIT, TORCH_STAGE_V
from tests.conftest import linear_op

linear = linear_op("timing::linear")
WIDTH, ROWS, N_MB = 16, 8, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)
        self.w2 = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)

    def forward(self, x: Tensor) -> Tensor:
        return linear(torch.relu(linear(x, self.w1)), self.w2)


def _loss(out: Tensor, target: Tensor) -> Tensor:
    return ((out - target) ** 2).sum()


def _zbv_steps(
    stage_cls: Any, steps: int = 2, loss_fn: Any = _loss, time_loss: bool = True
) -> list[StepTimeline]:
    """ZBV on one rank (both stages local), every step after the first timed, FLOPs counted."""
    torch.manual_seed(0)
    timer = ActionTimer()
    cls = timer.stage_class(stage_cls)
    stages = [cls(Block(), i, 2, torch.device("cpu")) for i in range(2)]
    loss_fn = timer.time_loss(loss_fn) if time_loss else loss_fn
    schedule = ScheduleZBVZeroBubble(stages, N_MB, loss_fn=loss_fn)
    x, y = torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)
    schedule.step(x, target=y)  # shape inference; not recorded
    for _ in range(steps):
        with timer.step(count_flops=True):
            schedule.step(x, target=y)
    return timer.gather()


def _flops(step: StepTimeline, stage: int, kind: str) -> int:
    return sum(a.flops or 0 for r in step.ranks for a in r.actions if (a.stage, a.kind) == (stage,
                                                                                          kind))  # fmt: skip


MATMUL = 2 * (ROWS // N_MB) * WIDTH * WIDTH  # FLOPs of one (rows x width) @ (width x width)


@pytest.mark.parametrize(
    "stage_cls",
    [PipelineStage, pytest.param(TorchPipelineStage, marks=[TORCH_STAGE_V, TORCH_SPLIT])],
)
def test_every_action_of_every_microbatch_is_recorded(group: None, stage_cls: Any) -> None:
    steps = _zbv_steps(stage_cls)
    assert len(steps) == 2
    for step in steps:
        (rank,) = step.ranks
        assert rank.stages == (0, 1)
        got = sorted((a.kind, a.stage, a.microbatch) for a in rank.actions)
        want = sorted((k, s, m) for k in "FIW" for s in (0, 1) for m in range(N_MB))
        assert got == want
        assert rank.waits == ()  # both stages on this rank: nothing is received
        assert all(0 <= a.start <= a.end <= rank.duration for a in rank.actions)
        starts = [a.start for a in rank.actions]
        assert starts == sorted(starts)  # one rank runs one action at a time
        assert 0 < rank.busy < rank.duration
        assert 0 < step.bubble < 1


@pytest.mark.parametrize(
    "stage_cls",
    [PipelineStage, pytest.param(TorchPipelineStage, marks=[TORCH_STAGE_V, TORCH_SPLIT])],
    ids=["ours", "torch"],
)
def test_the_first_stage_runs_its_whole_backward_in_w(group: None, stage_cls: type) -> None:
    # Per microbatch, each stage does 2 matmuls forward; its backward 2 weight-gradient matmuls
    # and 2 input-gradient ones, except that stage 0's input needs no gradient (1 matmul). The
    # first stage skips I and does its whole backward in W, in one pass (its I and W run back
    # to back in every zero-bubble schedule); the other stages split.
    step = _zbv_steps(stage_cls)[-1]
    assert _flops(step, 0, "F") == _flops(step, 1, "F") == 2 * MATMUL * N_MB
    assert _flops(step, 0, "I") == 0
    assert _flops(step, 0, "W") == 3 * MATMUL * N_MB
    assert _flops(step, 1, "I") == _flops(step, 1, "W") == 2 * MATMUL * N_MB


def test_zbv_gives_the_full_backward_gradients(group: None) -> None:
    torch.manual_seed(0)
    mods = [Block(), Block()]
    ref = nn.Sequential(*(Block() for _ in range(2)))
    ref.load_state_dict(nn.Sequential(*mods).state_dict())
    stages = [PipelineStage(m, i, 2, torch.device("cpu")) for i, m in enumerate(mods)]
    schedule = ScheduleZBVZeroBubble(stages, N_MB, loss_fn=_loss)
    x, y = torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)
    schedule.step(x, target=y)
    for m in mods:
        m.zero_grad()
    schedule.step(x, target=y)
    for xi, yi in zip(x.chunk(N_MB), y.chunk(N_MB)):
        (_loss(ref(xi), yi) / N_MB).backward()
    for got, want in zip([p.grad for m in mods for p in m.parameters()], ref.parameters()):
        torch.testing.assert_close(got, want.grad)


def _matmul_loss(out: Tensor, target: Tensor) -> Tensor:
    return (out.mT @ target).trace()  # one matmul: FLOPs a counter sees


def test_time_loss_counts_the_loss_in_the_last_stage_forward(group: None) -> None:
    timed = _zbv_steps(PipelineStage, loss_fn=_matmul_loss)[-1]
    untimed = _zbv_steps(PipelineStage, loss_fn=_matmul_loss, time_loss=False)[-1]
    assert _flops(untimed, 1, "F") == 2 * MATMUL * N_MB
    assert _flops(timed, 1, "F") == 3 * MATMUL * N_MB
    assert _flops(timed, 0, "F") == 2 * MATMUL * N_MB  # a stage without the loss: unchanged
    # The loss runs right after the forward it extends: each stage-1 forward got longer, and
    # still ends before the next action starts.
    (rank,) = timed.ranks
    for before, after in zip(rank.actions, rank.actions[1:]):
        assert before.end <= after.start


def test_full_backward_schedules_record_b(group: None) -> None:
    timer = ActionTimer()
    stage = timer.stage_class(PipelineStage)(Block(), 0, 1, torch.device("cpu"))
    schedule = Schedule1F1B(stage, N_MB, loss_fn=_loss)
    x, y = torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)
    schedule.step(x, target=y)
    with timer.step():
        schedule.step(x, target=y)
    (step,) = timer.gather()
    kinds = sorted(a.kind for a in step.ranks[0].actions)
    assert kinds == ["B"] * N_MB + ["F"] * N_MB
    assert all(a.flops is None for a in step.ranks[0].actions)  # not counted unless asked
    (costs,) = stage_costs([step]).values()
    assert costs.backward is not None and costs.backward > 0
    assert costs.backward_input == costs.backward_weight == 0.0


def test_actions_outside_a_step_are_not_recorded() -> None:
    timer = ActionTimer()
    with timer.action("F", 0, 0):
        pass
    assert timer.steps == []
    with timer.step(), timer.action("F", 0, 0):
        pass
    assert [len(s.actions) for s in timer.steps] == [1]


def _two_rank_step() -> StepTimeline:
    """Stage 0 on rank 0, stage 1 on rank 1, one microbatch, hand-made times (ms)."""
    ms = 1e-3
    rank0 = RankStep(
        rank=0,
        duration=10 * ms,
        actions=(
            ActionEvent("F", 0, 0, 0 * ms, 2 * ms),
            ActionEvent("I", 0, 0, 7 * ms, 8 * ms),
            ActionEvent("W", 0, 0, 8 * ms, 9 * ms),
        ),
        # waited from 2 ms for stage 1's I, which ended at 6 ms: 4 ms peer, 1 ms transfer
        waits=(WaitEvent("I", 0, 0, 2 * ms, 7 * ms),),
    )
    rank1 = RankStep(
        rank=1,
        duration=8 * ms,
        actions=(
            ActionEvent("F", 1, 0, 3 * ms, 5 * ms),
            ActionEvent("I", 1, 0, 5 * ms, 6 * ms),
            ActionEvent("W", 1, 0, 6 * ms, 7.5 * ms),
        ),
        # waited from 0 for stage 0's F, which ended at 2 ms: 2 ms peer, 1 ms transfer
        waits=(WaitEvent("F", 1, 0, 0 * ms, 3 * ms),),
    )
    return StepTimeline((rank0, rank1))


def test_breakdown_splits_each_wait_at_the_end_of_the_action_it_waited_for() -> None:
    step = _two_rank_step()
    assert step.duration == pytest.approx(10e-3)
    assert step.bubble == pytest.approx(1 - (4e-3 + 4.5e-3) / 20e-3)
    assert step.stage_ranks() == {0: 0, 1: 1}
    b0, b1 = step.breakdown()
    assert (b0.compute, b0.peer, b0.transfer, b0.tail) == pytest.approx((4e-3, 4e-3, 1e-3, 0))
    assert b0.other == pytest.approx(1e-3)  # 9 ms to 10 ms: its own step's end
    assert (b1.compute, b1.peer, b1.transfer, b1.tail) == pytest.approx((4.5e-3, 2e-3, 1e-3, 2e-3))
    assert b1.other == pytest.approx(0.5e-3)  # 7.5 ms to 8 ms; 8 ms to 10 ms is the tail
    assert b0.total == b1.total == pytest.approx(step.duration)


def test_stage_costs_are_medians_and_send_is_the_median_transfer() -> None:
    costs = stage_costs([_two_rank_step(), _two_rank_step()])
    assert sorted(costs) == [0, 1]
    fields = ("forward", "backward_input", "backward_weight", "send")
    assert [getattr(costs[0], f) for f in fields] == pytest.approx([2e-3, 1e-3, 1e-3, 1e-3])
    assert [getattr(costs[1], f) for f in fields] == pytest.approx([2e-3, 1e-3, 1.5e-3, 1e-3])
    assert costs[0].backward is None and costs[1].backward is None
    assert isinstance(costs[0], StageCosts)
    # per action, outside actions and waits: rank 0 1 ms / 3 actions, rank 1 0.5 ms / 3
    assert costs[0].overhead == costs[1].overhead == pytest.approx((1e-3 / 3 + 0.5e-3 / 3) / 2)
    highest = stage_costs([_two_rank_step()], statistic=max)
    assert highest[0].overhead == pytest.approx(1e-3 / 3)
    assert highest[1].send == pytest.approx(1e-3)


# --- what the timer showed: W copied every weight gradient it accumulated first ---------------

SEEN: list[int] = []  # data pointers: a reference would make the engine copy
kept_linear = linear_op("timing::kept_linear", spy=None)


def test_weight_pass_keeps_the_weight_half_gradient_as_grad() -> None:
    # A weight's first gradient becomes its .grad as computed, without a weight-sized copy (the
    # engine copies gradients its caller still references), on customgrad's split and queue.
    from customgrad.pipelining import WeightGradQueue, stage_backward_input, stage_backward_weight

    @kept_linear.register_backward_weight
    def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor]:
        dw = grad.flatten(0, -2).mT @ saved[0].flatten(0, -2)
        SEEN.append(dw.data_ptr())
        return {"weight": dw}

    for use_queue in (False, True):
        SEEN.clear()
        w = nn.Parameter(torch.randn(WIDTH, WIDTH))
        x = torch.randn(ROWS, WIDTH, requires_grad=True)
        if use_queue:
            queue = WeightGradQueue()
            with queue.microbatch(0, 0):
                y = kept_linear(x, w)
            queue.backward([y], [torch.ones_like(y)], inputs=[x])
            queue.run(0, 0)
        else:
            y = kept_linear(x, w)
            _, groups = stage_backward_input([y], [torch.ones_like(y)], [x], [w])
            stage_backward_weight([w], groups)
        (computed,) = SEEN
        assert w.grad is not None and w.grad.data_ptr() == computed
        torch.testing.assert_close(w.grad, torch.ones(ROWS, WIDTH).mT @ x.detach())


# --- the timed stage depends on torch's stage methods: checked, and refused when they change --


def test_torchs_stage_has_the_methods_the_timer_wraps() -> None:
    from customgrad.pipelining._timed_stage import stage_methods_mismatch

    # Fails loudly when a torch release renames or reorders what ActionTimer wraps.
    assert stage_methods_mismatch(TorchPipelineStage) is None
    assert stage_methods_mismatch(PipelineStage) is None


def test_a_stage_whose_methods_changed_is_refused() -> None:
    class Changed(TorchPipelineStage):
        def backward_one_chunk(self, chunk: int, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
            pass

    with pytest.raises(
        cg.UnsupportedError,
        match=re.escape(
            f"ActionTimer.stage_class(Changed): torch {torch.__version__}'s pipeline stage no "
            f"longer matches what the timer wraps (backward_one_chunk takes ('chunk', 'args', "
            f"'kwargs'), expected ('bwd_chunk_id', 'loss', 'full_backward') first). Time "
            f"actions by hand with timer.action(kind, stage, microbatch) around your own loop, "
            f"or use a torch release customgrad supports."
        ),
    ):
        ActionTimer().stage_class(Changed)


def test_thread_clocks_leave_no_file_descriptor_open() -> None:
    import os
    import threading

    from customgrad.pipelining._timing import _thread_clocks

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0

    before = open_fds()
    threads = [threading.Thread(target=_thread_clocks) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _thread_clocks()
    assert open_fds() == before
    cpu, queued = _thread_clocks()
    assert cpu > 0 and queued >= 0


@pytest.mark.slow  # two fresh interpreters
def test_import_customgrad_loads_neither_pipelining_nor_matplotlib() -> None:
    import subprocess
    import sys

    code = (
        "import sys, customgrad; "
        "print(sorted(m for m in sys.modules if m.startswith(('customgrad.pipelining', "
        "'matplotlib'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
    code = (
        "import sys, customgrad.pipelining; "
        "print(sorted(m for m in sys.modules if m.startswith('matplotlib')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


def test_the_demo_report_accounts_for_the_whole_bubble_in_plain_words(
    group: None, tmp_path: Any
) -> None:
    from examples import pipeline_report

    steps = _zbv_steps(PipelineStage, steps=3)
    costs = stage_costs(steps)
    no_wait = [dataclasses.replace(costs[s], send=0.0, overhead=0.0) for s in range(2)]
    text = pipeline_report.attribution(steps, no_wait, ScheduleZBVZeroBubble, N_MB)
    lines = text.splitlines()
    stage_0 = next(line for line in lines if line.lstrip().startswith("0    0"))
    assert stage_0.endswith("<- no I: its whole backward is in W")
    assert "Stage 0 has no I: nothing before it needs its input gradient" in text
    for jargon in ("peer", "tail", " | "):  # the old report's columns, undefined
        assert jargon not in text
    # The shares of the bubble's causes add up to the bubble's share of the step.
    share = re.compile(r"^\s+([+-]?\d+\.\d)%\s")
    computing = next(i for i, line in enumerate(lines) if "computing F, I and W" in line)
    bubble = float(share.match(lines[computing + 1]).group(1))  # type: ignore[union-attr]
    causes = [float(m.group(1)) for line in lines[computing + 2 :] if (m := share.match(line))]
    assert len(causes) == 6
    assert sum(causes) == pytest.approx(bubble, abs=0.35)
    assert float(share.match(lines[computing]).group(1)) + bubble == pytest.approx(100, abs=0.15)  # type: ignore[union-attr]

    sim = pipeline_report.cgp.simulate(ScheduleZBVZeroBubble, 2, N_MB, no_wait)
    pipeline_report.draw(steps, sim, [3.0, 2.0, 1.0], tmp_path)
    assert (tmp_path / "zero_bubble.png").stat().st_size > 0
    assert (tmp_path / "loss.png").stat().st_size > 0


# --- collectives waited for inside actions, and W nested in them ------------------------------


class _Sending:
    """Stands for an async all-to-all's ``Work``: never completes before its wait."""

    def is_completed(self) -> bool:
        return False

    def wait(self) -> bool:
        return True


def test_a_w_run_inside_a_wait_is_nested_in_the_action_that_waited() -> None:
    from customgrad.pipelining import WeightGradQueue

    w = nn.Parameter(torch.randn(WIDTH, WIDTH))
    queue, timer = WeightGradQueue(), ActionTimer()
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    with timer.step(count_flops=True):
        with timer.action("F", 0, 0), queue.microbatch(0, 0):
            out = linear(x, w)
            queue.run_while(_Sending(), "dispatch")  # nothing queued yet: a plain wait
        with timer.action("I", 0, 0):
            queue.backward(out.sum(), inputs=[x])
        with timer.action("F", 0, 1), queue.overlap():
            assert queue.run_while(_Sending(), "dispatch") == [(0, 0)]
            linear(x, w)
    queue.finish()
    (step,) = timer.steps
    f0, i0, f1, w0 = step.actions  # by start time: the W inside F1 comes after it
    assert [(a.kind, a.microbatch) for a in step.actions] == [
        ("F", 0),
        ("I", 0),
        ("F", 1),
        ("W", 0),
    ]
    assert f1.start <= w0.start and w0.end <= f1.end and f1.nested == w0.duration
    assert step.busy == pytest.approx(f0.duration + i0.duration + f1.duration)
    assert step.time_in("F") == pytest.approx(f0.duration + f1.own)
    # FLOPs: the W's dW GEMM is its own, not F1's (which is one forward GEMM)
    gemm = 2 * ROWS * WIDTH * WIDTH
    assert (f1.flops, w0.flops, f0.flops) == (gemm, gemm, gemm)
    plain, carrying = step.comms
    assert (plain.kind, plain.microbatch, plain.label, plain.overlapped, plain.hidden) == (
        "F", 0, "dispatch", 0.0, 0.0)  # fmt: skip
    assert plain.exposed == pytest.approx(plain.end - plain.start) and f0.comm == plain.exposed
    assert (carrying.kind, carrying.microbatch) == ("F", 1)
    assert carrying.overlapped >= w0.duration and carrying.hidden == carrying.overlapped
    assert step.hidden == carrying.hidden and step.exposed == pytest.approx(
        plain.exposed + carrying.exposed)  # fmt: skip
    (part,) = StepTimeline((step,)).breakdown()
    assert part.comm == pytest.approx(f0.comm + f1.comm)
    assert part.total == pytest.approx(step.duration)
    costs = stage_costs([StepTimeline((step,))])[0]
    assert costs.dispatch == pytest.approx(statistics.median([plain.in_flight, carrying.in_flight]))
    assert costs.combine == 0.0 and costs.forward == pytest.approx(
        statistics.median([f0.compute, f1.compute]))  # fmt: skip
    fig = StepTimeline((step,)).draw()
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "all-to-all in flight, hidden behind W" in legend
    assert "all-to-all in flight, rank blocked" in legend
