"""customgrad ops through torch's real pipeline schedules, on 2 processes (gloo).

One spawn runs every case on one process group: ZBV, InterleavedZeroBubble, DualPipeV and
a full-backward schedule (Interleaved1F1B), each with torch's ``PipelineStage``,
``customgrad.pipelining.PipelineStage`` and torch's stage with customgrad's weight-gradient
queue as ``dw_builder``. Checked: gradients equal a single-process reference; a zero-bubble
step does the FLOPs of a full-backward step with customgrad ops, and more with plain
``autograd.Function`` ops. Processes are always stopped (bounded joins, then killed).
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _mp_workers as w
from _mp_workers import Case, pp

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STAGES = pp.STAGE_KINDS
CASES = [Case(s, impl, st) for st in STAGES for impl in pp.IMPLS for s in w.SCHEDULES]


def _unavailable(stage: str) -> str | None:
    if stage == "torch":
        return None
    try:
        import customgrad.pipelining as cgp

        cgp.PipelineStage, cgp.WeightGradQueue  # noqa: B018
    except (ImportError, AttributeError) as e:
        return f"stage kind {stage!r} is not available: {e}"
    return None


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[Case, w.Outcome]:
    runnable = [c for c in CASES if _unavailable(c.stage) is None]
    out = tmp_path_factory.mktemp("pipeline") / "outcomes.pkl"
    pp.spawn(w.run_cases, (runnable, str(out)), world=2, timeout=180, device="cpu")
    result: dict[Case, w.Outcome] = pickle.loads(out.read_bytes())
    return result


def _get(outcomes: dict[Case, w.Outcome], case: Case) -> w.Outcome:
    reason = _unavailable(case.stage)
    if reason is not None:
        pytest.fail(reason)
    return outcomes[case]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_gradients_equal_single_process_reference(
    outcomes: dict[Case, w.Outcome], case: Case
) -> None:
    outcome = _get(outcomes, case)
    assert not outcome.mismatch, f"{case.id}: gradients differ:\n{outcome.mismatch}"


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("schedule", pp.ZERO_BUBBLE)
def test_zero_bubble_step_does_the_flops_of_a_full_backward_step(
    outcomes: dict[Case, w.Outcome], schedule: str, stage: str
) -> None:
    zb = _get(outcomes, Case(schedule, "customgrad", stage))
    full = _get(outcomes, Case(w.FULL_BACKWARD, "customgrad", stage))
    assert zb.actions.get("W", 0) > 0, f"{schedule} ran no weight-gradient action: {zb.actions}"
    assert zb.flops == full.flops, (
        f"{schedule} with customgrad ops did {zb.flops} FLOPs, {w.FULL_BACKWARD} did"
        f" {full.flops}: {zb.flops_by_kind} vs {full.flops_by_kind}"
    )


@pytest.mark.parametrize("stage", ["torch", "customgrad"])
@pytest.mark.parametrize("schedule", pp.ZERO_BUBBLE)
def test_plain_functions_repeat_work_under_the_split(
    outcomes: dict[Case, w.Outcome], schedule: str, stage: str
) -> None:
    zb = _get(outcomes, Case(schedule, "function", stage))
    full = _get(outcomes, Case(w.FULL_BACKWARD, "function", stage))
    assert zb.flops > full.flops, (zb.flops_by_kind, full.flops_by_kind)


def test_full_backward_flops_match_single_process(outcomes: dict[Case, w.Outcome]) -> None:
    full = _get(outcomes, Case(w.FULL_BACKWARD, "customgrad", "torch"))
    assert full.flops == w.reference_step_flops()


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
    with pytest.raises(
        pp.WorkerFailed, match="rank 1 failed first: ValueError: deliberate failure"
    ):
        pp.spawn(w.fail_on_rank, (1, str(tmp_path)), world=2, timeout=60, device="cpu")
    assert time.monotonic() - start < 50
    pids = _pids(tmp_path)
    assert len(pids) == 2
    assert not any(_alive(pid) for pid in pids)


def test_a_hanging_run_is_stopped_at_its_timeout(tmp_path: Path) -> None:
    with pytest.raises(pp.WorkerFailed, match="still running after 20s"):
        pp.spawn(w.hang, (str(tmp_path),), world=2, timeout=20, device="cpu")
    assert not any(_alive(pid) for pid in _pids(tmp_path))


CUDA_RANKS = min(2, torch.cuda.device_count())  # ZBV fits 2 stages on 1 rank if need be


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_RANKS == 0, reason="needs a CUDA GPU")
def test_zero_bubble_on_cuda(tmp_path: Path) -> None:
    cases = [Case(s, "customgrad", st) for st in STAGES for s in w.SCHEDULES]
    out = tmp_path / "outcomes.pkl"
    pp.spawn(w.run_cases, (cases, str(out)), world=CUDA_RANKS, timeout=300, device="cuda")
    outcomes: dict[Case, w.Outcome] = pickle.loads(out.read_bytes())
    for case in cases:
        assert not outcomes[case].mismatch, f"{case.id}: {outcomes[case].mismatch}"
        full = outcomes[Case(w.FULL_BACKWARD, "customgrad", case.stage)]
        assert outcomes[case].flops == full.flops, case.id


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_RANKS == 0, reason="needs a CUDA GPU")
def test_demo_check_on_cuda(tmp_path: Path) -> None:
    import zero_bubble

    argv = ["--check", "--device", "cuda", "--nproc", str(CUDA_RANKS), "--out", str(tmp_path)]
    assert zero_bubble.main(argv) == 0
    assert (tmp_path / "zero_bubble.png").stat().st_size > 0
