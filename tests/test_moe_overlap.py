"""Weight work hides the expert all-to-all: gradients unchanged, W inside the waits, hooks and
FSDP2's reduction after W, and the simulator replaying what ran.

One spawn of 2 processes (gloo, expert-parallel over both) runs every case of
``tests/_moe_overlap_worker.py``; processes are always stopped (bounded joins, then killed).
Timings are not asserted: ``python -m benchmarks.moe_overlap`` measures the gain.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.pipelining as pipelining

from customgrad.pipelining import StepTimeline, simulate, stage_costs
from examples import moe_ep
from tests import _moe_overlap_worker as w
from tests._mp_workers import spawn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SCHEDULES = ("ScheduleDualPipeV", "ScheduleZBVZeroBubble")
# Expert-parallel over both processes (each its own pipeline): DualPipeV, FSDP2, a loop; one
# pipeline over both (receives between them): DualPipeV and ZBV.
CASES = [
    *(w.Case("ScheduleDualPipeV", overlap) for overlap in (False, True)),
    w.Case("ScheduleDualPipeV", True, fsdp=True),
    w.Case("loop", False),
    w.Case("loop", True),
    *(w.Case(s, overlap, pipeline=True) for s in SCHEDULES for overlap in (False, True)),
    w.Case("ScheduleDualPipeV", True, pipeline=True, ddp=True),
]
PAIRS = [(c, w.Case(c.runner, True, pipeline=c.pipeline)) for c in CASES
         if not c.overlap and not c.fsdp]  # fmt: skip
Results = list[dict[w.Case, w.Outcome]]  # per rank


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    out = tmp_path_factory.mktemp("moe_overlap") / "outcomes.pkl"
    spawn(w.run_cases, (CASES, str(out)), world=2, timeout=180)
    loaded: Results = pickle.loads(out.read_bytes())
    return loaded


def _reference(case: w.Case) -> list[dict[str, torch.Tensor]]:
    if case.pipeline:  # one pipeline over both processes, every block with all its experts
        (one,) = moe_ep.reference_grads(w.CFG, case.stages, w.batches()[:1], w.MICROBATCHES)
        return [{k: v for k, v in one.items() if int(k.split(".")[0]) in w.stages_of(case, r)}
                for r in range(2)]  # fmt: skip
    return moe_ep.reference_grads(w.CFG, w.BLOCKS, w.batches(), w.MICROBATCHES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_gradients_equal_one_process(results: Results, case: w.Case) -> None:
    ref = _reference(case)
    if case.fsdp:  # FSDP2 averages the dense weights' gradients over the two processes
        for name in ref[0]:
            if not name.endswith((".w1", ".w2")):
                ref[0][name] = ref[1][name] = (ref[0][name] + ref[1][name]) / 2
    for rank, outcomes in enumerate(results):
        got = outcomes[case].grads
        assert sorted(got) == sorted(ref[rank])
        for name, want in ref[rank].items():
            torch.testing.assert_close(got[name], want, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p[0].id)
def test_gradients_with_the_overlap_are_those_without_exactly(
    results: Results, pair: tuple[w.Case, w.Case]
) -> None:
    for outcomes in results:
        plain, hidden = outcomes[pair[0]], outcomes[pair[1]]
        for name, g in plain.grads.items():
            assert torch.equal(hidden.grads[name], g), name


def _nested_w(outcome: w.Outcome) -> list[tuple[str, int, int]]:
    """Each W that ran inside another action: (the action it ran in, its stage, microbatch)."""
    (rank,) = outcome.step.ranks
    found = []
    for a in rank.actions:
        if a.kind == "W":
            outer = [o for o in rank.actions
                     if o is not a and o.start <= a.start and a.end <= o.end]  # fmt: skip
            found += [(f"{o.kind}{o.stage}.{o.microbatch}", a.stage, a.microbatch) for o in outer]
    return found


def test_a_ddp_stage_keeps_its_w_in_its_slot(results: Results) -> None:
    # DDP reduces in a stage's last W: nothing of a DDP stage runs in a wait, and DDP reduced
    # (the step would end with customgrad's "DDP did not reduce" error otherwise).
    case = w.Case("ScheduleDualPipeV", True, pipeline=True, ddp=True)
    plain = w.Case("ScheduleDualPipeV", False, pipeline=True)
    for outcomes in results:
        assert not _nested_w(outcomes[case])
        for name, g in outcomes[plain].grads.items():
            assert torch.equal(outcomes[case].grads[name], g), name


@pytest.mark.parametrize("case", [c for c in CASES if c.overlap and not c.ddp], ids=lambda c: c.id)
def test_w_runs_inside_the_forwards_all_to_all_waits(results: Results, case: w.Case) -> None:
    for outcomes in results:
        outcome = outcomes[case]
        nested = _nested_w(outcome)
        assert nested and all(outer.startswith("F") for outer, _, _ in nested)
        (rank,) = outcome.step.ranks
        carrying = [c for c in rank.comms if c.overlapped > 0]
        assert carrying and all(c.kind == "F" and c.label == "dispatch" for c in carrying)
        assert rank.hidden > 0
        assert sum(1 for a in rank.actions if a.kind == "W" and a.nested == 0) >= len(nested)
        # a backward's waits never run W
        assert all(c.overlapped == 0 for c in rank.comms if c.kind != "F")


@pytest.mark.parametrize("case", [c for c, _ in PAIRS], ids=lambda c: c.id)
def test_without_the_overlap_every_wait_is_exposed(results: Results, case: w.Case) -> None:
    for outcomes in results:
        (rank,) = outcomes[case].step.ranks
        assert rank.comms and rank.hidden == 0
        assert all(c.overlapped == 0 and c.exposed > 0 for c in rank.comms)
        assert not _nested_w(outcomes[case])


@pytest.mark.parametrize("case", [c for c in CASES if not c.fsdp], ids=lambda c: c.id)
def test_hooks_fire_after_w_once_per_microbatch(results: Results, case: w.Case) -> None:
    # At its k-th post-accumulate-grad hook a weight's stage has run W for exactly k
    # microbatches: every accumulation is a W's, none comes before its W, none twice.
    for outcomes in results:
        hooks = outcomes[case].hooks
        assert len(hooks) == len(outcomes[case].grads) * w.MICROBATCHES
        assert all(fired == ran for _, fired, ran in hooks), hooks[:8]


def test_fsdp_reduces_after_every_w_of_the_stage(results: Results) -> None:
    # Once per stage, when each of its dense weights has accumulated every microbatch's W.
    for outcomes in results:
        reductions = outcomes[w.Case("ScheduleDualPipeV", True, fsdp=True)].reductions
        assert sorted(reductions) == [(s, w.MICROBATCHES) for s in range(w.BLOCKS)]


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.runner != "loop" and not (c.fsdp or c.ddp)], ids=lambda c: c.id
)
def test_the_simulator_replays_what_ran(results: Results, case: w.Case) -> None:
    # From the run's own costs, simulate(..., overlap=) runs the same actions in the same
    # order on every rank, with the same W inside the same forwards.
    if case.pipeline:  # one pipeline: both processes' steps, replayed together
        steps = [StepTimeline(tuple(r for o in results for r in o[case].step.ranks))]
    else:  # a pipeline per process: each replayed alone
        steps = [o[case].step for o in results]
    for step in steps:
        costs = stage_costs([step])
        assert all(c.dispatch > 0 and c.combine > 0 for c in costs.values())
        n_ranks = len(step.ranks)
        sim = simulate(getattr(pipelining, case.runner), case.stages, w.MICROBATCHES,
                       [costs[s] for s in range(case.stages)], n_ranks=n_ranks,
                       overlap=case.overlap)  # fmt: skip
        for i, rank in enumerate(step.ranks):
            ran = [(a.stage, a.kind, a.microbatch, a.nested > 0) for a in rank.actions]
            replayed = [
                (a.stage, a.kind, a.microbatch,
                 any(n.in_wait and n.rank == a.rank and a.start <= n.start <= a.end and n is not a
                     for n in sim.timeline))
                for a in sim.actions(i)
            ]  # fmt: skip
            assert ran == replayed, f"{case.id}, rank {rank.rank}"
