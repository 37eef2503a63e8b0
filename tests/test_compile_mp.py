"""customgrad.compile'd blocks through torch's zero-bubble schedules, on 2 processes (gloo).

Each block of the pipeline model is compiled (``aot_eager``: the backend does not matter for
what is checked, and inductor compiles slowly on 2 CPU cores). Through torch's
``PipelineStage`` and customgrad's, with ScheduleZBVZeroBubble, ScheduleInterleavedZeroBubble
and ScheduleDualPipeV: gradients equal one process's, and a step's FLOPs equal a full-backward
(Interleaved1F1B) step's. Torch's schedules accept the stages (no ``OptimizedModule``).
"""

from __future__ import annotations

import pickle
from typing import TypeVar

import pytest

from tests import _compile_workers as cw
from tests import _mp_workers as w
from tests._mp_workers import Case
from tests._skips import torch_stage_lacks

T = TypeVar("T")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CASES = [Case(s, impl, st) for st in cw.STAGES for impl in cw.IMPLS for s in cw.SCHEDULES]


def lacks(case: Case) -> str | None:
    """What this torch release lacks to run ``case`` (compiled blocks are Functions)."""
    return torch_stage_lacks(case.stage, case.schedule, functions=True)


def outcome_of(results: dict[Case, T], case: Case) -> T:
    """``case``'s result; the test skips, saying why, where this torch release cannot run it."""
    reason = lacks(case)
    if reason is not None:
        pytest.skip(reason)
    return results[case]


@pytest.fixture(scope="module")
def results(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[Case, tuple[w.Outcome, dict[str, int]]]:
    out = tmp_path_factory.mktemp("compiled_pipeline") / "outcomes.pkl"
    runnable = [c for c in CASES if lacks(c) is None]
    w.spawn(cw.run_cases, (runnable, str(out)), world=2, timeout=240)
    result: dict[Case, tuple[w.Outcome, dict[str, int]]] = pickle.loads(out.read_bytes())
    return result


@pytest.fixture(scope="module")
def outcomes(results: dict[Case, tuple[w.Outcome, dict[str, int]]]) -> dict[Case, w.Outcome]:
    return {case: outcome for case, (outcome, _) in results.items()}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_compiled_graphs_ran_split_under_zero_bubble_and_whole_under_1f1b(
    results: dict[Case, tuple[w.Outcome, dict[str, int]]], case: Case
) -> None:
    outcome, runs = outcome_of(results, case)
    per = w.BLOCKS // 4  # blocks (regions) per stage: 4 stages on 2 ranks
    # DualPipeV runs some backwards whole (B). The first stage's input needs no gradient: its
    # I runs no region, and its W or B runs the weight graph alone (it needs no hand-off).
    a = outcome.actions
    assert runs["full"] + runs["weight"] == (a["B"] + a["W"]) * per, (runs, a)
    assert a["I"] * per - w.MICROBATCHES * per <= runs["input"] <= a["I"] * per, (runs, a)
    if case.schedule != w.FULL_BACKWARD:
        assert runs["input"] > 0


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_compiled_stage_gradients_equal_single_process(
    outcomes: dict[Case, w.Outcome], case: Case
) -> None:
    outcome = outcome_of(outcomes, case)
    assert not outcome.mismatch, f"{case.id}: gradients differ:\n{outcome.mismatch}"


@pytest.mark.parametrize("impl", cw.IMPLS)
@pytest.mark.parametrize("stage", cw.STAGES)
@pytest.mark.parametrize("schedule", w.ZERO_BUBBLE)
def test_compiled_zero_bubble_step_does_the_flops_of_a_full_backward_step(
    outcomes: dict[Case, w.Outcome], schedule: str, stage: str, impl: str
) -> None:
    zb = outcome_of(outcomes, Case(schedule, impl, stage))
    full = outcome_of(outcomes, Case(w.FULL_BACKWARD, impl, stage))
    n = 2 * 2 * w.MICROBATCHES
    assert zb.actions["W"] > 0, zb.actions
    assert zb.actions["I"] + zb.actions["B"] == zb.actions["W"] + zb.actions["B"] == n
    assert sum(zb.flops.values()) == sum(full.flops.values()), (
        f"{schedule}, {impl} blocks compiled, {stage} stages: {zb.flops} FLOPs, "
        f"{w.FULL_BACKWARD} {full.flops}"
    )
