"""customgrad ops through torch's real pipeline schedules, on 2 processes (gloo).

One spawn runs every case on one process group: ZBV, InterleavedZeroBubble, DualPipeV and a
full-backward schedule (Interleaved1F1B); customgrad ops, plain ``autograd.Function``\\ s and
native ops; torch's ``PipelineStage``, ``customgrad.pipelining.PipelineStage``, and each with
customgrad's weight-gradient queue. Checked: gradients equal one process's; a zero-bubble step
does the FLOPs of a full-backward step with customgrad ops, and more with plain Functions; the
``ActionTimer`` sees every action and the waits between ranks. Processes are always stopped
(``tests/_mp_workers.spawn``: bounded, then killed).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.multiprocessing import ProcessRaisedException

from customgrad.pipelining import stage_costs
from tests import _mp_workers as w
from tests._mp_workers import Case
from tests._skips import NO_CUDA, cuda_gpus, torch_stage_lacks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CASES = [Case(s, impl, st) for st in w.STAGE_KINDS for impl in w.IMPLS for s in w.SCHEDULES]
ROOT = Path(__file__).resolve().parents[1]


def lacks(case: Case) -> str | None:
    """What this torch release lacks to run ``case`` (a skip reason), or None."""
    return torch_stage_lacks(case.stage, case.schedule, functions=case.impl != "native")


RUNNABLE = [c for c in CASES if lacks(c) is None]


def outcome_of(outcomes: dict[Case, w.Outcome], case: Case) -> w.Outcome:
    """``case``'s outcome; the test skips, saying why, where this torch release cannot run it."""
    reason = lacks(case)
    if reason is not None:
        pytest.skip(reason)
    return outcomes[case]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[Case, w.Outcome]:
    out = tmp_path_factory.mktemp("pipeline") / "outcomes.pkl"
    w.spawn(w.run_cases, (RUNNABLE, str(out)), world=2, timeout=180)
    result: dict[Case, w.Outcome] = pickle.loads(out.read_bytes())
    return result


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_gradients_equal_single_process_reference(
    outcomes: dict[Case, w.Outcome], case: Case
) -> None:
    outcome = outcome_of(outcomes, case)
    assert not outcome.mismatch, f"{case.id}: gradients differ:\n{outcome.mismatch}"


@pytest.mark.parametrize("stage", w.STAGE_KINDS)
@pytest.mark.parametrize("schedule", w.ZERO_BUBBLE)
def test_zero_bubble_step_does_the_flops_of_a_full_backward_step(
    outcomes: dict[Case, w.Outcome], schedule: str, stage: str
) -> None:
    zb = outcome_of(outcomes, Case(schedule, "customgrad", stage))
    full = outcome_of(outcomes, Case(w.FULL_BACKWARD, "customgrad", stage))
    n = 2 * 2 * w.MICROBATCHES  # every stage, every microbatch (DualPipeV runs some B whole)
    assert zb.actions["W"] > 0, zb.actions
    assert zb.actions["I"] + zb.actions["B"] == zb.actions["W"] + zb.actions["B"] == n, zb.actions
    assert full.actions["B"] == n, full.actions
    assert sum(zb.flops.values()) == sum(full.flops.values()), (
        f"{schedule} with customgrad ops did {zb.flops} FLOPs, {w.FULL_BACKWARD} {full.flops}"
    )


@pytest.mark.parametrize("schedule", w.ZERO_BUBBLE)
def test_plain_functions_repeat_work_under_torch_s_split(
    outcomes: dict[Case, w.Outcome], schedule: str
) -> None:
    zb = outcome_of(outcomes, Case(schedule, "function", "torch"))
    full = outcome_of(outcomes, Case(w.FULL_BACKWARD, "function", "torch"))
    assert sum(zb.flops.values()) > sum(full.flops.values()), (zb.flops, full.flops)


@pytest.mark.parametrize("schedule", w.ZERO_BUBBLE)
def test_plain_functions_run_once_under_customgrad_s_split(
    outcomes: dict[Case, w.Outcome], schedule: str
) -> None:
    # Each Function's backward runs once, in I; W sends on the weight gradients it returned.
    zb = outcomes[Case(schedule, "function", "customgrad")]
    full = outcomes[Case(w.FULL_BACKWARD, "function", "customgrad")]
    assert sum(zb.flops.values()) == sum(full.flops.values()), (zb.flops, full.flops)


def test_full_backward_flops_match_single_process(outcomes: dict[Case, w.Outcome]) -> None:
    full = outcome_of(outcomes, Case(w.FULL_BACKWARD, "customgrad", "torch"))
    assert sum(full.flops.values()) == w.reference_step_flops()


@pytest.mark.parametrize("schedule", w.ZERO_BUBBLE)
def test_the_first_stage_runs_its_whole_backward_in_w(
    outcomes: dict[Case, w.Outcome], schedule: str
) -> None:
    # The first stage's input needs no gradient: torch's stage and customgrad's skip its I and
    # run its whole backward in W, in one pass; the other stages split (stages 0 and 1 hold one
    # block each, so stage 0's W does stage 1's W and the activation gradients of its I).
    def per_action(case: Case, stage: int, kind: str) -> float:
        t = outcome_of(outcomes, case).timeline
        acts = [a for r in t.ranks for a in r.actions if (a.stage, a.kind) == (stage, kind)]
        return sum(a.flops or 0 for a in acts) / len(acts)

    for stage_kind in ("customgrad", "torch"):
        case = Case(schedule, "customgrad", stage_kind)
        assert per_action(case, 0, "I") == 0
        assert per_action(case, 1, "I") > 0
        assert per_action(case, 0, "W") > per_action(case, 1, "W")


@pytest.mark.parametrize("schedule", [*w.ZERO_BUBBLE, w.FULL_BACKWARD])
def test_timer_sees_the_waits_between_ranks(outcomes: dict[Case, w.Outcome], schedule: str) -> None:
    t = outcome_of(outcomes, Case(schedule, "customgrad", "customgrad")).timeline
    assert [r.rank for r in t.ranks] == [0, 1]
    assert sorted(t.stage_ranks()) == [0, 1, 2, 3]
    for r in t.ranks:
        count = {k: sum(a.kind == k for a in r.actions) for k in "FIWB"}
        n = 2 * w.MICROBATCHES  # 2 stages a rank
        assert count["F"] == count["I"] + count["B"] == count["W"] + count["B"] == n, count
        # an action that uses a tensor from the other rank waits for it first
        remote = [
            a
            for a in r.actions
            if (a.kind == "F" and a.stage > 0 and t.stage_ranks()[a.stage - 1] != r.rank)
            or (a.kind in "IB" and a.stage < 3 and t.stage_ranks()[a.stage + 1] != r.rank)
        ]
        waited = {(x.kind, x.stage, x.microbatch) for x in r.waits}
        assert waited == {(a.kind, a.stage, a.microbatch) for a in remote}
        for x in r.waits:
            assert 0 <= x.start <= x.end <= r.duration
    for b in t.breakdown():
        assert b.total == pytest.approx(t.duration)
        assert min(b.compute, b.peer, b.transfer, b.tail) >= 0
    costs = stage_costs([t])
    assert sorted(costs) == [0, 1, 2, 3]
    for c in costs.values():
        assert c.forward > 0
        assert c.backward_weight > 0 if schedule in w.ZERO_BUBBLE else c.backward is not None


def _pids(pid_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in pid_dir.glob("*.pid")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_failing_rank_stops_the_others(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(ProcessRaisedException, match="ValueError: deliberate failure"):
        w.spawn(w.fail_on_rank, (1, str(tmp_path)), world=2, timeout=60)
    assert time.monotonic() - start < 50
    pids = _pids(tmp_path)
    assert len(pids) == 2
    assert not any(_alive(pid) for pid in pids)


def test_a_hanging_run_is_stopped_at_its_timeout(tmp_path: Path) -> None:
    # The timeout must leave both processes time to import torch and join the group before they
    # hang: 20 s does on a quiet machine; where they were not both up by then (a busy 2-core
    # machine, a CUDA build of torch, slower to import), once more with 60 s.
    for timeout in (20, 60):
        pid_dir = tmp_path / f"timeout-{timeout}"
        pid_dir.mkdir()
        with pytest.raises(TimeoutError, match=f"still running after {timeout} s"):
            w.spawn(w.hang, (str(pid_dir),), world=2, timeout=timeout)
        pids = _pids(pid_dir)
        assert not any(_alive(pid) for pid in pids)
        if len(pids) == 2:
            break
    assert len(pids) == 2


CUDA_RANKS = min(2, torch.cuda.device_count())  # ZBV fits 2 stages on 1 rank if need be


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_RANKS == 0, reason=NO_CUDA)
def test_zero_bubble_on_cuda(tmp_path: Path) -> None:
    cases = [Case(s, "customgrad", st) for st in w.STAGE_KINDS for s in w.SCHEDULES]
    cases = [c for c in cases if lacks(c) is None]  # (torch 2.11 and 2.12: fewer)
    out = tmp_path / "outcomes.pkl"
    w.spawn(w.run_cases, (cases, str(out), "cuda"), world=CUDA_RANKS, timeout=300, backend="nccl")
    outcomes: dict[Case, w.Outcome] = pickle.loads(out.read_bytes())
    for case in cases:
        assert not outcomes[case].mismatch, f"{case.id}: {outcomes[case].mismatch}"
        full = outcomes[Case(w.FULL_BACKWARD, "customgrad", case.stage)]
        assert sum(outcomes[case].flops.values()) == sum(full.flops.values()), case.id


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_RANKS < 2, reason=cuda_gpus(2))
def test_demo_check_on_cuda(tmp_path: Path) -> None:
    demo = [sys.executable, str(ROOT / "examples" / "zero_bubble.py"), "--check"]
    result = subprocess.run(
        [*demo, "--out", str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "nccl on cuda" in result.stdout and "check passed" in result.stdout
    assert (tmp_path / "zero_bubble.png").stat().st_size > 0
