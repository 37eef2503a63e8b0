"""Train customgrad ops through a real zero-bubble pipeline, and draw the schedule.

Two processes on this machine (gloo on CPU; NCCL when each rank has its own GPU) train a
small model of customgrad ops (linear, RMSNorm) with ``ScheduleZBVZeroBubble``. The first
step's gradients are checked against a single-process reference; every F / I / W action
is timed and its FLOPs counted; the same model with plain ``torch.autograd.Function`` ops
runs next, to show the work torch's split backward repeats for them.

    python examples/zero_bubble.py                       # spawns 2 local processes
    python examples/zero_bubble.py --schedule DualPipeV  # or any of --help's schedules
    torchrun --nproc-per-node 2 examples/zero_bubble.py  # the standard launcher
    python examples/zero_bubble.py --check               # a few seconds, for CI

Writes ``<out>/zero_bubble.png`` (default ``out/``): one row per rank, F / I / W coloured,
bubbles left white, the bubble fraction in each panel's title.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import _pipeline as pp
import torch
import torch.distributed as dist

SHORT_NAMES = {name.removeprefix("Schedule"): name for name in pp.SCHEDULES}
IMPL_ORDER = ("customgrad", "function")
COLORS = {"F": "#4C72B0", "I": "#DD8452", "W": "#55A868", "B": "#8172B3"}
BUBBLE = "#e4e4e4"
LABELS = {"F": "forward", "I": "backward, input", "W": "backward, weight", "B": "full backward"}


class GradientMismatch(pp.UserError):
    """The pipeline's gradients differ from the single-process reference."""


@dataclass
class RankResult:
    rank: int
    stages: list[int]
    step_times: list[float]  # seconds, every step, from the barrier before it
    summary: dict[str, tuple[int, float]]  # kind -> (count per step, median seconds per step)
    flops: dict[str, int]  # kind -> FLOPs of step 0
    expected_backward_flops: int  # one plain full backward of the rank's stages, per step
    events: list[list[pp.Event]]  # per step
    losses: list[float]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument(
        "--schedule",
        default="ZBVZeroBubble",
        help=f"one of {', '.join(SHORT_NAMES)} (default ZBVZeroBubble)",
    )
    p.add_argument("--stage", choices=pp.STAGE_KINDS, default="customgrad", help=pp.STAGE_HELP)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--batch", type=int, default=256, help="rows per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--no-plain", action="store_true", help="skip the autograd.Function run")
    p.add_argument("--out", type=Path, default=Path("out"))
    pp.add_launch_args(p, timeout=300.0)
    p.add_argument("--check", action="store_true", help="tiny and fast: for CI")
    args = p.parse_args(argv)
    name = SHORT_NAMES.get(args.schedule.removeprefix("Schedule"))
    if name is None:
        p.error(f"unknown schedule {args.schedule!r}; choose from {', '.join(SHORT_NAMES)}")
    args.schedule = name
    if args.check:
        args.steps, args.microbatches, args.dim, args.hidden, args.batch = 2, 4, 32, 64, 16
    return args


def model_config(args: argparse.Namespace, world: int) -> pp.ModelConfig:
    return pp.ModelConfig(
        dim=args.dim,
        hidden=args.hidden,
        blocks=2 * world,
        batch=args.batch,
        microbatches=args.microbatches,
    )


class Run:
    """One ops flavour's pipeline on this rank, trained a step at a time."""

    def __init__(self, device: torch.device, args: argparse.Namespace, impl: str) -> None:
        self.device, self.args, self.impl = device, args, impl
        self.cfg = model_config(args, dist.get_world_size())
        self.pipe = pp.build_pipeline(self.cfg, args.schedule, impl, args.stage, device)
        self.expected = pp.expected_backward_flops(self.cfg, args.schedule, impl, device)
        self.opt = torch.optim.SGD(self.pipe.parameters(), lr=args.lr)
        self.step_times: list[float] = []
        self.losses: list[float] = []
        self.events: list[list[pp.Event]] = []
        self.flops: dict[str, int] = {}

    def step(self, step: int) -> None:
        """Train one step; step 0 also counts FLOPs and checks the gradients."""
        rec, device = self.pipe.recorder, self.device
        x, target = pp.make_batch(self.cfg, step, device)
        self.opt.zero_grad(set_to_none=True)
        dist.barrier()
        rec.start_step(count_flops=step == 0)
        mb_losses = self.pipe.step(x, target)
        rec.sync()
        self.step_times.append(time.perf_counter() - rec.t0)
        self.events.append(list(rec.events))
        if step == 0:
            self.flops = dict(rec.flops)
            check_gradients(self.pipe, self.cfg, self.impl, device)
        loss = torch.stack(mb_losses).mean() if mb_losses else torch.zeros((), device=device)
        dist.all_reduce(loss)  # only the rank with the last stage has the losses
        self.losses.append(loss.item())
        self.opt.step()

    def result(self) -> RankResult:
        timed = self.events[1:] or self.events
        summary = {
            kind: (
                sum(e.kind == kind for e in timed[0]),
                statistics.median(
                    sum(e.end - e.start for e in ev if e.kind == kind) for ev in timed
                ),
            )
            for kind in {e.kind for e in timed[0]}
        }
        return RankResult(
            rank=dist.get_rank(),
            stages=[s.stage_index for s in self.pipe.stages],
            step_times=self.step_times,
            summary=summary,
            flops=self.flops,
            expected_backward_flops=sum(self.expected.values()),
            events=self.events,
            losses=self.losses,
        )


def check_gradients(
    pipe: pp.Pipeline, cfg: pp.ModelConfig, impl: str, device: torch.device
) -> None:
    """Raise :class:`GradientMismatch` on every rank if any rank's gradients are off."""
    want = pp.reference_grads(cfg, impl, 0, device)
    got = pipe.named_grads()
    report = pp.compare_grads(got, want, rtol=1e-4, atol=1e-5)
    missing = [
        f"{i}.{name}: no gradient"
        for i, block in pipe.modules.items()
        for name, _ in block.named_parameters()
        if f"{i}.{name}" not in got
    ]
    report = "\n".join(filter(None, [report, *missing]))
    bad = torch.tensor([int(bool(report))], device=device)
    dist.all_reduce(bad)
    if bad.item():
        where = f"on rank {dist.get_rank()}:\n{report}" if report else "on another rank"
        raise GradientMismatch(
            f"{pp.IMPLS[impl].name} ops under {pipe.schedule.__class__.__name__}: the first"
            f" step's gradients differ from the single-process reference {where}"
        )


def demo_worker(device: torch.device, args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    impls = IMPL_ORDER[:1] if args.no_plain else IMPL_ORDER
    if rank == 0:
        world = dist.get_world_size()
        backend = dist.get_backend()
        print(
            f"{args.schedule}: {world} ranks, {pp.num_stages(args.schedule, world)} stages,"
            f" {args.microbatches} microbatches of {args.batch // args.microbatches} rows,"
            f" dim {args.dim}/{args.hidden}, {device.type}/{backend}, stage: {args.stage}",
            flush=True,
        )
    # The flavours take turns, step by step, so that both see the same machine.
    runs = [Run(device, args, impl) for impl in impls]
    for step in range(args.steps):
        for run in runs:
            run.step(step)
        if rank == 0:
            print(
                f"  step {step + 1:>2}/{args.steps} "
                + " | ".join(
                    f" {pp.IMPLS[run.impl].name}: loss {run.losses[-1]:.4f},"
                    f" {1e3 * run.step_times[-1]:6.1f} ms"
                    for run in runs
                ),
                flush=True,
            )
    results = {run.impl: run.result() for run in runs}
    gathered = pp.gather_to_rank0(results)
    if gathered is None:
        return
    by_impl = {impl: [r[impl] for r in gathered] for impl in impls}
    print()
    print(format_table(by_impl, args))
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / "zero_bubble.png"
    try:
        draw_timeline(by_impl, args, png)
        print(f"\nschedule picture: {png}")
    except ImportError as e:  # matplotlib is a dev dependency, not a customgrad one
        print(f"\nno schedule picture ({e}); `pip install matplotlib` to get one")
    if args.check:
        verify_flops(by_impl, args)


def timed_steps(results: list[RankResult]) -> list[int]:
    """Steps that count for times: all but the first (FLOP counting, shape inference)."""
    n = len(results[0].step_times)
    return list(range(1, n)) if n > 1 else [0]


def step_span(results: list[RankResult], step: int) -> float:
    """A step's time: from the barrier before it to the end of the slowest rank."""
    return max(r.step_times[step] for r in results)


def median_step(results: list[RankResult]) -> int:
    """The timed step of median length: the one to draw."""
    steps = sorted(timed_steps(results), key=lambda s: step_span(results, s))
    return steps[len(steps) // 2]


def bubble_fraction(results: list[RankResult], step: int) -> float:
    """Share of (ranks x step time) in which no F, I, W or B action ran."""
    busy = sum(e.end - e.start for r in results for e in r.events[step])
    return 1.0 - busy / (step_span(results, step) * len(results))


def repeated_flops(r: RankResult) -> int:
    """Backward FLOPs (I + W + B) beyond one plain full backward of the same stages."""
    return sum(r.flops.get(k, 0) for k in "IWB") - r.expected_backward_flops


def format_table(by_impl: dict[str, list[RankResult]], args: argparse.Namespace) -> str:
    all_results = [r for rs in by_impl.values() for r in rs]
    steps = timed_steps(all_results)
    biggest = max(max(r.flops.values(), default=0) for r in all_results)
    scale, unit = (1e9, "GFLOP") if biggest >= 1e9 else (1e6, "MFLOP")
    head = (
        f"{'ops':<17} {'rank':>4} {'stages':>6} |"
        + "".join(f" {k + ' n':>4} {k + ' ms':>7}" for k in "FIWB")
        + f" | {unit + ' F':>8} {'I':>7} {'W':>7} {'B':>7} {'repeated':>8} | {'step ms':>7}"
    )
    which = f"steps 2-{args.steps}" if len(steps) > 1 else "step 1"
    lines = [
        f"Per rank and step: actions run and their time (median of {which}), FLOPs (step 1),"
        " step time (median)",
        head,
        "-" * len(head),
    ]
    for impl, results in by_impl.items():
        for r in results:
            acts = "".join(
                f" {r.summary.get(k, (0, 0.0))[0]:>4} {1e3 * r.summary.get(k, (0, 0.0))[1]:>7.1f}"
                for k in "FIWB"
            )
            f = {k: r.flops.get(k, 0) / scale for k in "FIWB"}
            step_ms = 1e3 * statistics.median(r.step_times[s] for s in steps)
            lines.append(
                f"{pp.IMPLS[impl].name:<17} {r.rank:>4} {','.join(map(str, r.stages)):>6} |{acts}"
                f" | {f['F']:>8.2f} {f['I']:>7.2f} {f['W']:>7.2f} {f['B']:>7.2f}"
                f" {repeated_flops(r) / scale:>8.2f} | {step_ms:>7.1f}"
            )
    lines += [
        "F forward, I input-gradient backward, W weight-gradient backward, B full backward;"
        " repeated: I + W + B",
        "minus one plain backward of the same stages. Stage 0 has no input gradient to send,"
        " so torch runs its whole",
        "backward in W.",
        "",
    ]
    base: float | None = None
    for impl, results in by_impl.items():
        step = statistics.median(step_span(results, s) for s in steps)
        rep = sum(repeated_flops(r) for r in results)
        bwd = sum(r.expected_backward_flops for r in results)
        rel = "" if base is None else f" ({step / base:.2f}x customgrad's)"
        base = step if base is None else base
        lines.append(
            f"{pp.IMPLS[impl].name:>17}: step {1e3 * step:.1f} ms{rel}, bubble"
            f" {bubble_fraction(results, median_step(results)):.0%}, repeated backward work"
            f" {rep / scale:.2f} {unit} = {rep / bwd:.0%} of the backward"
        )
    return "\n".join(lines)


def verify_flops(by_impl: dict[str, list[RankResult]], args: argparse.Namespace) -> None:
    cg_rep = sum(repeated_flops(r) for r in by_impl["customgrad"])
    if cg_rep != 0:
        raise pp.UserError(f"customgrad ops repeated {cg_rep} FLOPs of backward work")
    # With a queue as dw_builder, plain Functions do their whole backward in I: no repeat.
    splits = args.schedule in pp.ZERO_BUBBLE and "queue" not in args.stage
    plain = sum(repeated_flops(r) for r in by_impl.get("function", []))
    if "function" in by_impl and splits and plain <= 0:
        raise pp.UserError("plain autograd.Function ops should repeat work under a split backward")
    print("check: gradients match the reference; customgrad repeats no FLOPs")


def draw_timeline(
    by_impl: dict[str, list[RankResult]], args: argparse.Namespace, path: Path
) -> None:
    """One panel per ops flavour, one row per rank, one bar per measured action.

    Each panel draws its step of median length; the x axes are shared, so the panels'
    lengths compare directly.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    world = len(next(iter(by_impl.values())))
    fig, axes = plt.subplots(
        len(by_impl), 1, figsize=(14, 1.2 + 1.2 * world * len(by_impl)), sharex=True, squeeze=False
    )
    longest = 0.0
    kinds: set[str] = set()
    for ax, (impl, results) in zip(axes[:, 0], by_impl.items()):
        step = median_step(results)
        span = 1e3 * step_span(results, step)
        longest = max(longest, span)
        for r in results:
            y = world - 1 - r.rank
            ax.barh(y, span, height=0.8, color=BUBBLE, lw=0)
            second = r.stages[-1] if len(r.stages) > 1 else None
            for e in r.events[step]:
                kinds.add(e.kind)
                start, width = 1e3 * e.start, 1e3 * (e.end - e.start)
                ax.barh(
                    y,
                    width,
                    left=start,
                    height=0.8,
                    color=COLORS[e.kind],
                    edgecolor="white",
                    lw=0.6,
                    hatch="//" if e.stage == second else None,
                )
                if width > 0.012 * span:
                    ax.text(
                        start + width / 2,
                        y,
                        str(e.microbatch),
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white",
                    )
        ax.set_yticks(
            [world - 1 - r.rank for r in results],
            [f"rank {r.rank}\nstages {','.join(map(str, r.stages))}" for r in results],
        )
        ax.set_title(
            f"{pp.IMPLS[impl].name} ops: step {step + 1}, {span:.1f} ms,"
            f" bubble {bubble_fraction(results, step):.0%}",
            fontsize=10,
        )
    axes[-1, 0].set_xlim(0, longest)
    axes[-1, 0].set_xlabel("ms since the step started; each bar shows its microbatch")
    handles = [
        Patch(color=COLORS[k], label=f"{k}: {LABELS[k]}") for k in sorted(kinds, key="FIWB".index)
    ]
    handles.append(
        Patch(facecolor="white", edgecolor="gray", hatch="//", label="the rank's second stage")
    )
    handles.append(Patch(facecolor=BUBBLE, label="bubble (idle)"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(
        f"{args.schedule} on {world} ranks, measured (stage: {args.stage},"
        f" {args.microbatches} microbatches; the step of median length of {args.steps})",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()
    status = pp.launch(demo_worker, parse_args(argv))
    if status == 0 and int(os.environ.get("RANK", "0")) == 0:
        print(f"done in {time.perf_counter() - start:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
