"""Weight work hides the expert all-to-all: the step with the overlap and without, one run.

2 processes (gloo on CPU), expert-parallel over both: each holds half of every MoE block's
experts (``examples/moe_ep.py``, float32) and runs its own pipeline of two stages, one block
each (a V on one rank), through ``ScheduleDualPipeV`` and ``ScheduleZBVZeroBubble`` on
``customgrad.pipelining.PipelineStage(..., queue=queue)``; "overlap" adds
``overlap_forward_backward(schedule)``, which runs each microbatch's weight gradients (W) inside
a later forward's all-to-all wait. The configurations take turns step by step (a new seeded
order each round), so drifts of a shared machine hit them alike.

Per configuration: the median step (the slower process's), its ratio to the same schedule
without the overlap (step by step, then the median), the all-to-all time hidden behind W and
exposed (rank blocked) per process and step (``ActionTimer``), and two steps ``simulate`` gives
(``stage_costs`` with means: each stage's F / I / W / B compute, its dispatch and combine
all-to-alls, the runtime's time per action): *replayed*, from the configuration's own costs, as
``benchmarks/simulate_accuracy.py`` does; *predicted*, from the costs of ZBV without the overlap
(where every stage runs F, I and W), what one would know before turning the overlap on. Timing
needs the machine: the last column is the share of their wall time the actions ran on a CPU
(below about 75% the processes lost their cores to others, and the comparison says little).

    python -m benchmarks.moe_overlap [--steps 8] [--out docs/img/moe_overlap.png]
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining

import customgrad.pipelining as cgp
from customgrad.pipelining import StepTimeline, simulate, stage_costs
from examples import moe_ep
from tests._mp_workers import spawn

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = ("ScheduleDualPipeV", "ScheduleZBVZeroBubble")
BLOCKS = 2


@dataclass(frozen=True)
class Sizes:
    rows: int = 2048  # tokens per process and step
    microbatches: int = 8
    dim: int = 256
    hidden: int = 512  # the dense MLP's and each expert's width
    experts: int = 8
    top_k: int = 2

    def config(self) -> moe_ep.Config:
        return moe_ep.Config(self.dim, self.hidden, self.experts, self.top_k, torch.float32)


Config = tuple[str, bool]  # (schedule, overlap)


def time_steps(sizes: Sizes, steps: int, out_path: str) -> None:
    """Every configuration for ``steps`` timed rounds (after one untimed); rank 0 pickles
    ``{(schedule, overlap): [StepTimeline, ...]}``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pp_groups = [dist.new_group([r]) for r in range(world)]  # each process its own pipeline
    cfg = sizes.config()
    queue = cgp.WeightGradQueue()
    blocks = [moe_ep.MoEBlock(cfg, b, dist.group.WORLD, queue) for b in range(BLOCKS)]
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(sizes.rows, cfg.dim, generator=gen)
    target = torch.randn(sizes.rows, cfg.dim, generator=gen)
    timers: dict[Config, cgp.ActionTimer] = {}
    schedules = {}
    for name in SCHEDULES:
        for overlap in (False, True):
            timer = timers[name, overlap] = cgp.ActionTimer()
            stage_cls = timer.stage_class(cgp.PipelineStage)
            stages = [stage_cls(b, s, BLOCKS, torch.device("cpu"), group=pp_groups[rank],
                                queue=queue) for s, b in enumerate(blocks)]  # fmt: skip
            schedule = getattr(pipelining, name)(
                stages, sizes.microbatches, loss_fn=timer.time_loss(moe_ep.loss_fn)
            )
            if overlap:
                cgp.overlap_forward_backward(schedule)
            schedules[name, overlap] = schedule
    order = list(schedules)
    rounds = random.Random(0)  # the same order on both processes
    for step in range(steps + 1):
        rounds.shuffle(order)
        for key in order:
            dist.barrier()  # both clocks start together
            if step == 0:
                schedules[key].step(x, target=target)  # warm-up: shapes, first-call paths
            else:
                with timers[key].step():
                    schedules[key].step(x, target=target)
            for b in blocks:
                b.zero_grad(set_to_none=True)
    measured = {key: timer.gather() for key, timer in timers.items()}
    if rank == 0:
        Path(out_path).write_bytes(pickle.dumps(measured))


def cpu_share(steps: list[StepTimeline]) -> float:
    """CPU time over wall time of the actions: below 1 when the processes lost their cores."""
    busy = sum(r.busy for s in steps for r in s.ranks)
    return sum(r.busy_cpu for s in steps for r in s.ranks) / busy


def simulated(name: str, steps: list[StepTimeline], microbatches: int, overlap: bool) -> float:
    """The step ``simulate`` gives from ``steps``' mean costs (one process's pipeline)."""
    costs = stage_costs(steps, statistic=statistics.mean)
    sim = simulate(getattr(pipelining, name), BLOCKS, microbatches, list(costs.values()),
                   n_ranks=1, overlap=overlap)  # fmt: skip
    return sim.step_time


def report(measured: dict[Config, list[StepTimeline]], sizes: Sizes) -> str:
    lines = [
        f"{'schedule':22} {'overlap':>7} {'step ms':>8} {'vs without':>10} {'hidden ms':>9} "
        f"{'exposed ms':>10} {'replayed ms':>11} {'error':>7} {'predicted ms':>12} {'error':>7} "
        f"{'CPU share':>9}"
    ]
    before = measured["ScheduleZBVZeroBubble", False]
    for name in SCHEDULES:
        plain = measured[name, False]
        for overlap in (False, True):
            steps = measured[name, overlap]
            step = statistics.median(s.duration for s in steps)
            ratio = statistics.median(s.duration / p.duration for s, p in zip(steps, plain))
            hidden = statistics.median(s.hidden / len(s.ranks) for s in steps)
            exposed = statistics.median(s.exposed / len(s.ranks) for s in steps)
            replayed = simulated(name, steps, sizes.microbatches, overlap)
            guess = simulated(name, before, sizes.microbatches, overlap)
            lines.append(
                f"{name.removeprefix('Schedule'):22} {'yes' if overlap else 'no':>7} "
                f"{step * 1e3:8.1f} {ratio:10.3f} {hidden * 1e3:9.1f} {exposed * 1e3:10.1f} "
                f"{replayed * 1e3:11.1f} {replayed / step - 1:+7.1%} {guess * 1e3:12.1f} "
                f"{guess / step - 1:+7.1%} {cpu_share(steps):9.0%}"
            )
    return "\n".join(lines)


def draw(measured: dict[Config, list[StepTimeline]], path: Path) -> None:
    """The median step of DualPipeV without and with the overlap, on one time axis."""
    from matplotlib.figure import Figure

    name = "ScheduleDualPipeV"
    median = {}
    for overlap in (False, True):
        steps = sorted(measured[name, overlap], key=lambda s: s.duration)
        median[overlap] = steps[len(steps) // 2]
    span = max(s.duration for s in median.values())
    fig = Figure(figsize=(8.0, 5.8))
    fig.suptitle(
        "DualPipeV, two MoE stages on each of 2 processes, the experts split between them "
        "(measured, the median step)",
        fontsize=9,
    )
    axes = fig.subplots(2, 1)
    for ax, overlap in zip(axes, (False, True)):
        step = median[overlap]
        how = "with overlap_forward_backward" if overlap else "without the overlap"
        step.draw(ax=ax, span=span, title=(
            f"{how}: step {step.duration * 1e3:.0f} ms; all-to-all per process "
            f"{step.hidden / 2 * 1e3:.0f} ms hidden behind W, {step.exposed / 2 * 1e3:.0f} ms "
            f"exposed"
        ))  # fmt: skip
        ax.set_yticks(range(2), ["process 0", "process 1"])
        if not overlap:
            legend = ax.get_legend()
            if legend is not None:
                legend.remove()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150, bbox_inches="tight")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="timed rounds")
    p.add_argument("--rows", type=int, default=Sizes.rows, help="tokens per process and step")
    p.add_argument("--microbatches", type=int, default=Sizes.microbatches)
    p.add_argument("--out", type=Path, help="the picture (e.g. docs/img/moe_overlap.png)")
    args = p.parse_args(argv)
    sizes = Sizes(rows=args.rows, microbatches=args.microbatches)
    print(
        f"2 processes, experts over both; per process {sizes.rows} tokens a step in "
        f"{sizes.microbatches} microbatches, {BLOCKS} MoE blocks (dim {sizes.dim}, {sizes.experts} "
        f"experts of width {sizes.hidden}, top-{sizes.top_k}), float32, 1 thread each"
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "steps.pkl"
        spawn(time_steps, (sizes, args.steps, str(out)), world=2, timeout=900)
        measured: dict[Config, list[StepTimeline]] = pickle.loads(out.read_bytes())
    print(report(measured, sizes))
    if args.out is not None:
        draw(measured, args.out)
        shown = args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out
        print(f"wrote {shown}")


if __name__ == "__main__":
    main()
