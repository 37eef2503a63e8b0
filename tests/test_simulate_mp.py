"""The simulator replays what a real run does: 2 processes (gloo), customgrad ops, ZBV and
1F1B, m = 8, timed step by step with :class:`customgrad.pipelining.ActionTimer`; the simulation
from the run's own costs has the same stages on the same ranks and the same actions in the same
order on every rank. How close its predicted step time comes to the measured one is a timing,
which needs an idle machine: ``python -m benchmarks.simulate_accuracy`` measures it. Processes
are always stopped (bounded joins, then killed).
"""

from __future__ import annotations

import pickle

import pytest
import torch.distributed.pipelining as pipelining

from customgrad.pipelining import StepTimeline, simulate
from tests import _simulate_worker as w
from tests._mp_workers import spawn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SCHEDULES = ("ScheduleZBVZeroBubble", "Schedule1F1B")
STEPS = 2


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[StepTimeline]]:
    out = tmp_path_factory.mktemp("simulate") / "steps.pkl"
    spawn(w.time_steps, (list(SCHEDULES), STEPS, str(out)), world=2, timeout=150)
    result: dict[str, list[StepTimeline]] = pickle.loads(out.read_bytes())
    return result


def test_the_run_did_what_the_simulation_replays(measured: dict[str, list[StepTimeline]]) -> None:
    # Same stages on the same ranks, the same actions in the same order on every rank.
    assert sorted(measured) == sorted(SCHEDULES)
    for schedule, steps in measured.items():
        assert len(steps) == STEPS
        costs = w.measured_costs(steps)
        sim = simulate(getattr(pipelining, schedule), len(costs), w.MICROBATCHES, costs)
        assert steps[0].stage_ranks() == dict(enumerate(sim.stage_to_rank))
        for step in steps:
            for rank in step.ranks:
                ran = [(a.stage, a.kind, a.microbatch) for a in rank.actions]
                replayed = [(a.stage, a.kind, a.microbatch) for a in sim.actions(rank.rank)]
                assert ran == replayed, f"{schedule} rank {rank.rank}"
