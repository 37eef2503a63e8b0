"""torchtitan 0.3.0's own MoE models, unmodified, through customgrad's ``PipelineStage`` (and
torch's) on 2 processes (gloo): a tiny Qwen3-MoE (router top-k, grouped experts) and DeepSeek-V3
(MLA attention, a dense first layer, a shared expert), cut into 4 stages by torchtitan's own
helpers, through ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``, eager and with each block
compiled (``block.compile()``), with torchtitan's load-balancing hook between the steps (so the
routing changes).

The experts' grouped GEMM is torchtitan's own (``torch._grouped_mm``), customgrad's
(``customgrad.ops.grouped_mm`` through torchtitan's ``_grouped_mm`` seam), or the same GEMM as a
plain ``autograd.Function`` (a loop over the experts, :class:`tests._torchtitan.LoopGroupedMM`,
which reads the group sizes from ``offs`` in its backward, and ``CtxLoopGroupedMM``, which keeps
them on ``ctx`` as ints). Checked: the first step's gradients equal one process's; a step's
FLOPs equal one process's forward and full backward (nothing computed twice) on customgrad's
stage, above it for the plain Function on torch's (its whole backward runs in I and again in W);
customgrad's op splits exactly as torch's own grouped GEMM (the same FLOPs in every F / I / W / B
action of every stage); a plain Function never runs twice, and splits as the op does for every
routing, the ints-on-ctx one too (its ints read by the capture from a tensor once they change),
and the one in a compiled block too (its weight edge leads into the region that casts the
weight, whose weight pass W then runs with the Function's).

One spawn runs every case (:mod:`tests._moe_workers`); compiled blocks are shared by the two
schedules.
"""

from __future__ import annotations

import importlib.util
import pickle

import pytest

from tests._skips import UNBACKED_SLICE_WRITES, optional_package, torch_stage_lacks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        importlib.util.find_spec("torchtitan") is None,
        reason=optional_package("torchtitan", "make install pins torchtitan 0.3.0"),
    ),
]

from tests import _moe_workers as mw  # noqa: E402
from tests import _mp_workers as w  # noqa: E402
from tests._moe_workers import Case  # noqa: E402

MODELS = ("qwen3", "deepseek_v3")
SCHEDULES = mw.V_SCHEDULES
EAGER = [
    *(Case(m, s, k, "customgrad", False) for m in MODELS for s in SCHEDULES
      for k in ("native", "customgrad", "function", "function_ctx")),
    *(Case(m, s, k, "torch", False) for m in MODELS for s in SCHEDULES
      for k in ("native", "function")),
]  # fmt: skip
COMPILED = [  # one model and kernel after the other: their blocks compile once
    *(Case("qwen3", s, k, "customgrad", True) for k in ("native", "customgrad") for s in SCHEDULES),
    *(Case("deepseek_v3", s, "customgrad", "customgrad", True) for s in SCHEDULES),
    Case("qwen3", "ScheduleZBVZeroBubble", "function", "customgrad", True),
]  # fmt: skip
CASES = EAGER + COMPILED


def _lacks(case: Case) -> str | None:
    return torch_stage_lacks(case.stage, case.schedule, functions=True)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[Case, mw.Outcome]:
    out = tmp_path_factory.mktemp("moe") / "outcomes.pkl"
    runnable = [c for c in CASES if _lacks(c) is None]
    w.spawn(mw.run_cases, (runnable, str(out)), world=2, timeout=540)
    result: dict[Case, mw.Outcome] = pickle.loads(out.read_bytes())
    return result


def outcome_of(outcomes: dict[Case, mw.Outcome], case: Case) -> mw.Outcome:
    reason = _lacks(case)
    if reason is not None:
        pytest.skip(reason)
    return outcomes[case]


def _ids(case: Case) -> str:
    return case.id


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_first_step_gradients_equal_one_process(
    outcomes: dict[Case, mw.Outcome], case: Case
) -> None:
    # bfloat16 experts, float32 elsewhere: the same computations per microbatch, summed over
    # the microbatches in another order
    outcome = outcome_of(outcomes, case)
    assert outcome.worst < 1e-5, f"{case.id}: gradients differ by {outcome.worst:.2e}"


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.stage == "customgrad" or c.kernel == "native"], ids=_ids
)
def test_a_step_does_one_process_forward_and_backward_flops(
    outcomes: dict[Case, mw.Outcome], case: Case
) -> None:
    outcome = outcome_of(outcomes, case)
    assert outcome.total == outcome.reference_flops > 0, (case.id, outcome.flops)
    n = 2 * 2 * mw.MICROBATCHES  # every stage, every microbatch
    assert outcome.actions["F"] == n and outcome.actions["I"] + outcome.actions["B"] == n
    assert outcome.actions["W"] == outcome.actions["I"] > 0


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("model", MODELS)
def test_torch_stage_runs_a_plain_function_grouped_gemm_twice(
    outcomes: dict[Case, mw.Outcome], model: str, schedule: str
) -> None:
    function = outcome_of(outcomes, Case(model, schedule, "function", "torch", False))
    native = outcome_of(outcomes, Case(model, schedule, "native", "torch", False))
    assert function.total > function.reference_flops == native.total
    # torch's I runs the Function's whole backward (the dW GEMMs too), its W all of it again
    for stage in (1, 2):  # the stages with MoE layers and an input pass
        assert function.of("I", stage) > native.of("I", stage)
        assert function.of("W", stage) > native.of("W", stage)
    assert function.of("B") == native.of("B")


@pytest.mark.parametrize("case", [c for c in CASES if c.kernel == "customgrad"], ids=_ids)
def test_customgrad_grouped_mm_splits_as_torchs_own(
    outcomes: dict[Case, mw.Outcome], case: Case
) -> None:
    # every F / I / W / B action of every stage does the FLOPs it does with torch._grouped_mm
    # (eager, on customgrad's stage): the dX GEMMs in I, the dW GEMMs in W
    swapped = outcome_of(outcomes, case)
    native = outcome_of(outcomes, Case(case.model, case.schedule, "native", "customgrad", False))
    assert swapped.flops == native.flops
    assert swapped.of("W", 1) > 0 and swapped.of("W", 2) > 0


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c.kernel.startswith("function") and c.stage == "customgrad"],
    ids=_ids,
)
def test_plain_function_grouped_gemm_never_runs_twice(
    outcomes: dict[Case, mw.Outcome], case: Case
) -> None:
    function = outcome_of(outcomes, case)
    native = outcome_of(outcomes, Case(case.model, case.schedule, "native", "customgrad", False))
    for stage in range(4):  # I + W of each stage as with torch's grouped GEMM: nothing twice
        both = function.of("I", stage) + function.of("W", stage)
        assert both == native.of("I", stage) + native.of("W", stage), stage
        assert function.of("B", stage) == native.of("B", stage)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=UNBACKED_SLICE_WRITES)
        for c in CASES
        if c.kernel.startswith("function") and c.stage == "customgrad"
    ],
    ids=_ids,
)
def test_plain_function_grouped_gemm_splits_for_every_routing(
    outcomes: dict[Case, mw.Outcome], case: Case
) -> None:
    function = outcome_of(outcomes, case)
    native = outcome_of(outcomes, Case(case.model, case.schedule, "native", "customgrad", False))
    assert function.flops == native.flops  # the dW GEMMs in W, for the second step's routings
