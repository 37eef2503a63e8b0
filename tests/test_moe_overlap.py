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

from customgrad.pipelining import simulate, stage_costs
from examples import moe_ep
from tests import _moe_overlap_worker as w
from tests._mp_workers import spawn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SCHEDULES = ("ScheduleDualPipeV", "ScheduleZBVZeroBubble")
CASES = [
    *(w.Case(s, overlap) for s in SCHEDULES for overlap in (False, True)),
    w.Case("ScheduleDualPipeV", True, fsdp=True),
    w.Case("loop", False),
    w.Case("loop", True),
]
Results = list[dict[w.Case, w.Outcome]]  # per rank


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    out = tmp_path_factory.mktemp("moe_overlap") / "outcomes.pkl"
    spawn(w.run_cases, (CASES, str(out)), world=2, timeout=180)
    loaded: Results = pickle.loads(out.read_bytes())
    return loaded


def _reference() -> list[dict[str, torch.Tensor]]:
    return moe_ep.reference_grads(w.CFG, w.BLOCKS, w.batches(), w.MICROBATCHES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_gradients_equal_one_process(results: Results, case: w.Case) -> None:
    ref = _reference()
    if case.fsdp:  # FSDP2 averages the dense weights' gradients over the two processes
        for name in ref[0]:
            if not name.endswith((".w1", ".w2")):
                ref[0][name] = ref[1][name] = (ref[0][name] + ref[1][name]) / 2
    for rank, outcomes in enumerate(results):
        got = outcomes[case].grads
        assert sorted(got) == sorted(ref[rank])
        for name, want in ref[rank].items():
            torch.testing.assert_close(got[name], want, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("runner", [*SCHEDULES, "loop"])
def test_gradients_with_the_overlap_are_those_without_exactly(
    results: Results, runner: str
) -> None:
    for outcomes in results:
        plain, hidden = outcomes[w.Case(runner, False)], outcomes[w.Case(runner, True)]
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


@pytest.mark.parametrize("case", [c for c in CASES if c.overlap], ids=lambda c: c.id)
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


@pytest.mark.parametrize("runner", [*SCHEDULES, "loop"])
def test_without_the_overlap_every_wait_is_exposed(results: Results, runner: str) -> None:
    for outcomes in results:
        (rank,) = outcomes[w.Case(runner, False)].step.ranks
        assert rank.comms and rank.hidden == 0
        assert all(c.overlapped == 0 and c.exposed > 0 for c in rank.comms)
        assert not _nested_w(outcomes[w.Case(runner, False)])


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


@pytest.mark.parametrize("case", [c for c in CASES if c.runner != "loop" and not c.fsdp],
                         ids=lambda c: c.id)  # fmt: skip
def test_the_simulator_replays_what_ran(results: Results, case: w.Case) -> None:
    # From the run's own costs, simulate(..., overlap=) runs the same actions in the same
    # order, with the same W inside the same forwards.
    for outcomes in results:
        step = outcomes[case].step
        costs = stage_costs([step])
        assert all(c.dispatch > 0 and c.combine > 0 for c in costs.values())
        sim = simulate(getattr(pipelining, case.runner), w.BLOCKS, w.MICROBATCHES,
                       list(costs.values()), n_ranks=1, overlap=case.overlap)  # fmt: skip
        (rank,) = step.ranks
        ran = [(a.stage, a.kind, a.microbatch, a.nested > 0) for a in rank.actions]
        replayed = [(a.stage, a.kind, a.microbatch, a.kind == "F" and
                     any(n.in_wait and a.start <= n.start <= a.end for n in sim.timeline))
                    for a in sim.timeline]  # fmt: skip
        assert ran == replayed
