"""The simulator against real runs: its predicted step time over the measured one.

2 processes (gloo), customgrad ops (residual MLP blocks, ``tests/_simulate_worker.py``), ZBV and
1F1B, 8 microbatches, ``--steps`` timed steps each (after one untimed) with
:class:`customgrad.pipelining.ActionTimer`. From the same steps come the costs (each stage's mean
F / I / W / B, the hand-over between ranks, the runtime's time per action); what the simulator
predicts from them is when each rank waits for another, the schedule's bubble. The target: the
predicted step time within 10% of the measured median. Timing needs the machine: the last
column is the share of their wall time the actions ran on a CPU (below about 75% the processes
lost their cores to others, and the comparison says little).

The MoE rows: the expert-parallel MoE model of ``benchmarks/moe_overlap.py`` (2 processes, the
experts split between them, each its own pipeline of two MoE stages), DualPipeV and ZBV without
and with W hiding the all-to-alls (``overlap_forward_backward``), replayed with ``overlap=`` from
each configuration's own costs, the dispatch and combine all-to-alls among them.

    python -m benchmarks.simulate_accuracy [--steps 8] [--no-moe]
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import tempfile
from pathlib import Path

import torch.distributed.pipelining as pipelining

from benchmarks import moe_overlap
from customgrad.pipelining import StepTimeline, simulate
from tests import _simulate_worker as w
from tests._mp_workers import spawn

SCHEDULES = ("ScheduleZBVZeroBubble", "Schedule1F1B")


def cpu_share(steps: list[StepTimeline]) -> float:
    """CPU time over wall time of the actions: below 1 when the processes lost their cores."""
    busy = sum(r.busy for s in steps for r in s.ranks)
    return sum(r.busy_cpu for s in steps for r in s.ranks) / busy


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="timed steps per schedule")
    p.add_argument("--no-moe", action="store_true", help="skip the MoE rows")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "steps.pkl"
        spawn(w.time_steps, (list(SCHEDULES), args.steps, str(out)), world=2, timeout=600)
        measured: dict[str, list[StepTimeline]] = pickle.loads(out.read_bytes())
    print(
        f"{'schedule':28} {'predicted ms':>12} {'measured ms':>12} {'error':>8} {'CPU share':>10}"
    )
    for schedule in SCHEDULES:
        steps = measured[schedule]
        costs = w.measured_costs(steps)
        sim = simulate(getattr(pipelining, schedule), len(costs), w.MICROBATCHES, costs)
        step = statistics.median(s.duration for s in steps)
        print(
            f"{schedule:28} {sim.step_time * 1e3:12.1f} {step * 1e3:12.1f} "
            f"{sim.step_time / step - 1:+8.1%} {cpu_share(steps):10.0%}"
        )
    if args.no_moe:
        return
    sizes = moe_overlap.Sizes()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "moe.pkl"
        spawn(moe_overlap.time_steps, (sizes, args.steps, str(out)), world=2, timeout=900)
        moe: dict[tuple[str, bool], list[StepTimeline]] = pickle.loads(out.read_bytes())
    for (schedule, overlap), steps in sorted(moe.items()):
        predicted = moe_overlap.simulated(schedule, steps, sizes.microbatches, overlap)
        step = statistics.median(s.duration for s in steps)
        name = f"MoE {schedule.removeprefix('Schedule')}{' + overlap' if overlap else ''}"
        print(
            f"{name:28} {predicted * 1e3:12.1f} {step * 1e3:12.1f} "
            f"{predicted / step - 1:+8.1%} {cpu_share(steps):10.0%}"
        )


if __name__ == "__main__":
    main()
