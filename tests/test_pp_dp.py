"""Pipeline x data parallel: customgrad's ``PipelineStage`` with DDP and FSDP2 replicas.

4 processes (gloo on CPU): 2 pipeline ranks x 2 data-parallel ranks on a 2-D ``DeviceMesh``
("dp", "pp"), every stage module wrapped in DDP or ``fully_shard`` over its "dp" group, run
through torch's zero-bubble schedules with customgrad's plain split and with ``queue=``. One
spawn runs every supported case, two steps each (the first also runs the stages' metadata
inference); each unsupported case, which stops its step with an error, runs in a spawn of its
own, so a reduction it leaves half-done cannot hold up another case's collectives.
Checked per step: each weight's gradient equals a single-process float64 reference over the
whole batch; each DDP bucket / FSDP parameter group is reduced exactly once, after the stage's
last backward (its last W) and after every microbatch's accumulation; each weight's tensor hook
and post-accumulate-grad hook fire once per microbatch, in that microbatch's W (B on schedules
that run full backwards).

The same cases run on 4 GPUs with NCCL under ``make gpu-check`` (``-m cuda``).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from customgrad.pipelining._stage import MSG_DDP_FIND_UNUSED, MSG_DDP_UNREDUCED

# Imported by the name pytest's doctest collection gives it (the ops it defines are global):
# the spawned processes import it by that name too (the repository root is on sys.path).
from tests import _pp_dp_worker as w
from tests._pp_dp_worker import Case, Outcome

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CASES = [
    Case(schedule, dp, stage)
    for schedule in w.SCHEDULES
    for dp in w.DP_KINDS
    for stage in w.STAGE_KINDS
]
# A native weight (outside customgrad ops) in every block: the plain split accumulates it in W
# like the rest; the queue accumulates it in I, which FSDP2 handles (it reduces at the end of
# the step) and DDP cannot (it reduces in the last W).
ALL_STAGES = tuple(range(2 * w.PP))
NATIVE_CASES = [
    Case("ScheduleZBVZeroBubble", "ddp", "split", native=ALL_STAGES),
    Case("ScheduleZBVZeroBubble", "fsdp", "split", native=ALL_STAGES),
    Case("ScheduleZBVZeroBubble", "fsdp", "queue", native=ALL_STAGES),
]
# DDP(find_unused_parameters=True) works on the first stage under the plain split: that stage
# runs its whole backward in W, in one pass from its outputs, where DDP looks for unused weights.
FIRST_STAGE_FIND_UNUSED = Case("ScheduleZBVZeroBubble", "ddp", "split", find_unused=(0,))
# Unsupported, made so in one stage whose W (or reduction) is the last action of its ranks' step
# under ZBV (stage 0 with the queue, stage 1 with the split), so the other ranks finish theirs.
# Each runs alone (see the module docstring).
NATIVE_WITH_QUEUE = Case("ScheduleZBVZeroBubble", "ddp", "queue", native=(0,))
FIND_UNUSED = [
    Case("ScheduleZBVZeroBubble", "ddp", "split", find_unused=(1,)),
    Case("ScheduleZBVZeroBubble", "ddp", "queue", find_unused=(0,)),
]
WORKING = [*CASES, *NATIVE_CASES, FIRST_STAGE_FIND_UNUSED]

Results = list[dict[Case, Outcome]]  # per global rank


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    out = tmp_path_factory.mktemp("pp_dp") / "outcomes.pkl"
    return w.spawn(WORKING, str(out), device_type="cpu", timeout=240)


def _run_alone(case: Case, tmp_path: Path) -> Results:
    return w.spawn([case], str(tmp_path / "outcomes.pkl"), device_type="cpu", timeout=120)


def _per_step(results: Results, case: Case) -> list[tuple[int, int, w.Step]]:
    return [(r, i, step) for r, o in enumerate(results) for i, step in enumerate(o[case].steps)]


def _stage_of(weight: str) -> int:
    return int(weight.split(".", 1)[0])


def _grad_problems(results: Results, case: Case) -> list[str]:
    problems = []
    for r, i, step in _per_step(results, case):
        if step.error:
            problems.append(f"rank {r} step {i}: {step.error}")
        problems += [f"rank {r} step {i}: {m}" for m in step.grad_mismatch]
    if any(len(o[case].steps) != w.STEPS for o in results):
        problems.append(f"not every rank ran {w.STEPS} steps")
    return problems


def _reduction_problems(results: Results, case: Case) -> list[str]:
    problems = []
    for r, i, step in _per_step(results, case):
        where = f"rank {r} step {i}"
        reduced = Counter(p for red in step.reductions for p in red.params)
        for weight in results[r][case].weights:
            if reduced[weight] != 1:
                problems.append(f"{where}: {weight} reduced {reduced[weight]} times, not once")
        for red in step.reductions:
            if red.backwards_started != w.MICROBATCHES:
                problems.append(
                    f"{where}: stage {red.stage} reduced {red.params} after "
                    f"{red.backwards_started} of its {w.MICROBATCHES} backwards (W or B) had "
                    "started, not in or after the last one"
                )
            early = {p: n for p, n in red.accumulations.items() if n != w.MICROBATCHES}
            if early:
                problems.append(
                    f"{where}: stage {red.stage} reduced before every microbatch's gradient "
                    f"was accumulated (accumulations so far: {early})"
                )
    return problems


def _hook_problems(results: Results, case: Case) -> list[str]:
    """Each weight's tensor and post-accumulate-grad hooks: once per microbatch, in a backward
    of that microbatch on the weight's stage (W or B; I for a native weight under a queue)."""
    problems = []
    for r, i, step in _per_step(results, case):
        where = f"rank {r} step {i}"
        calls = Counter((c.weight, c.hook, c.microbatch) for c in step.hook_calls)
        for weight in results[r][case].weights:
            for hook in ("tensor", "post"):
                for mb in range(w.MICROBATCHES):
                    n = calls[(weight, hook, mb)]
                    if n != 1:
                        problems.append(f"{where}: {weight} {hook} hook fired {n}x for mb {mb}")
        for c in step.hook_calls:
            native = c.weight.endswith(".gain")
            allowed = ("I", "B") if native and case.stage == "queue" else ("W", "B")
            if c.action not in allowed or c.stage != _stage_of(c.weight):
                problems.append(
                    f"{where}: {c.weight} {c.hook} hook fired in {c.action} of stage {c.stage} "
                    f"(mb {c.microbatch}), expected {' or '.join(allowed)} of its stage"
                )
    return problems


def _check(problems: list[str], case: Case) -> None:
    assert not problems, f"{case.id}:\n" + "\n".join(problems[:20])


@pytest.mark.parametrize("case", WORKING, ids=lambda c: c.id)
def test_gradients_equal_single_process_reference(results: Results, case: Case) -> None:
    _check(_grad_problems(results, case), case)


@pytest.mark.parametrize("case", WORKING, ids=lambda c: c.id)
def test_gradients_are_reduced_once_per_step_after_the_last_w(results: Results, case: Case) -> None:
    _check(_reduction_problems(results, case), case)


@pytest.mark.parametrize("case", WORKING, ids=lambda c: c.id)
def test_hooks_fire_once_per_weight_per_microbatch(results: Results, case: Case) -> None:
    _check(_hook_problems(results, case), case)


def _stage_error(results: Results, case: Case, stage: int = 0) -> str:
    """The error the ranks holding ``stage`` stopped the case's first step with (the others ran
    it without error), after checking that every rank stopped after that step."""
    errors = set()
    for r, outcome in enumerate(results):
        steps = outcome[case].steps
        assert len(steps) == 1, f"rank {r} ran {len(steps)} steps, not 1 (stopped)"
        if stage in outcome[case].stages:
            errors.add(steps[0].error)
        else:
            assert not steps[0].error, f"rank {r}: {steps[0].error}"
    assert len(errors) == 1, errors
    return errors.pop()


def test_ddp_with_queue_and_native_weights_raises_a_clear_error(tmp_path: Path) -> None:
    # DDP reduces in the step's last backward; a queue gives native weights their gradients in
    # I, before it, so DDP never sees them ready. customgrad says so at the end of the step
    # instead of leaving unreduced gradients (and DDP's own error at the next step).
    error = _stage_error(_run_alone(NATIVE_WITH_QUEUE, tmp_path), NATIVE_WITH_QUEUE)
    assert error == f"PipeliningError: {MSG_DDP_UNREDUCED.format(stage=0)}"


@pytest.mark.parametrize("case", FIND_UNUSED, ids=lambda c: c.id)
def test_ddp_find_unused_parameters_raises_a_clear_error(case: Case, tmp_path: Path) -> None:
    # Instead of DDP's "Expected to mark a variable ready only once" (it takes every weight for
    # unused when the reduction starts, then W marks them again).
    (stage,) = case.find_unused
    error = _stage_error(_run_alone(case, tmp_path), case, stage)
    assert error == f"PipeliningError: {MSG_DDP_FIND_UNUSED.format(stage=stage)}"


CUDA_GPUS = torch.cuda.device_count()


@pytest.mark.cuda
@pytest.mark.skipif(CUDA_GPUS < w.PP * w.DP, reason=f"needs {w.PP * w.DP} CUDA GPUs (NCCL)")
def test_pipeline_x_data_parallel_on_cuda(tmp_path: Path) -> None:
    out = tmp_path / "outcomes.pkl"
    results = w.spawn(WORKING, str(out), device_type="cuda", timeout=300)
    problems = []
    for case in WORKING:
        for check in (_grad_problems, _reduction_problems, _hook_problems):
            problems += [f"{case.id}: {p}" for p in check(results, case)]
    assert not problems, "\n".join(problems[:30])
