"""Step time of a zero-bubble schedule against a full-backward one, customgrad vs plain ops.

One run, two local processes (gloo on CPU; NCCL when each rank has its own GPU). The same
model (pre-norm MLP blocks of linear + RMSNorm, ``examples/_pipeline.py``) runs under
``ScheduleZBVZeroBubble`` and ``ScheduleInterleaved1F1B`` (same 4 stages, same microbatches),
built from customgrad ops and from plain ``torch.autograd.Function`` ops. Configurations
are interleaved round by round so that drifts of the machine hit all of them alike; the
table gives the median and the minimum step time (the slowest rank's) and their ratios:
on a shared machine the minimum is the least disturbed.

    python benchmarks/pipeline.py                 # about a minute on 2 CPU cores
    python benchmarks/pipeline.py --rounds 40     # steadier
    torchrun --nproc-per-node 2 benchmarks/pipeline.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import _pipeline as pp

ZB, FULL = "ScheduleZBVZeroBubble", "ScheduleInterleaved1F1B"
CONFIGS = [(impl, sched) for impl in pp.IMPLS for sched in (ZB, FULL)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--stage", choices=pp.STAGE_KINDS, default="customgrad", help=pp.STAGE_HELP)
    p.add_argument("--rounds", type=int, default=20, help="rounds over all configurations")
    p.add_argument("--steps", type=int, default=1, help="timed steps per configuration a round")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--batch", type=int, default=256)
    pp.add_launch_args(p, timeout=500.0)
    return p.parse_args(argv)


def bench_worker(device: torch.device, args: argparse.Namespace) -> None:
    world = dist.get_world_size()
    cfg = pp.ModelConfig(
        dim=args.dim,
        hidden=args.hidden,
        blocks=2 * world,
        batch=args.batch,
        microbatches=args.microbatches,
    )
    pipes = {c: pp.build_pipeline(cfg, c[1], c[0], args.stage, device) for c in CONFIGS}
    x, target = pp.make_batch(cfg, 0, device)
    flops: dict[tuple[str, str], int] = {}
    bubbles: dict[tuple[str, str], list[float]] = {c: [] for c in CONFIGS}
    times: dict[tuple[str, str], list[float]] = {c: [] for c in CONFIGS}

    def step(c: tuple[str, str], count_flops: bool = False) -> float:
        pipe = pipes[c]
        for p in pipe.parameters():
            p.grad = None
        dist.barrier()
        pipe.recorder.start_step(count_flops=count_flops)
        pipe.step(x, target)
        pipe.recorder.sync()
        elapsed = torch.tensor([time.perf_counter() - pipe.recorder.t0], dtype=torch.float64)
        busy = torch.tensor(
            [sum(e.end - e.start for e in pipe.recorder.events)], dtype=torch.float64
        )
        stats = torch.cat([elapsed, busy]).to(device)
        dist.all_reduce(stats[:1], op=dist.ReduceOp.MAX)
        dist.all_reduce(stats[1:])
        span, busy_all = stats.tolist()
        bubbles[c].append(1 - busy_all / (span * world))
        if count_flops:
            total = torch.tensor([sum(pipe.recorder.flops.values())], device=device)
            dist.all_reduce(total)
            flops[c] = int(total.item())
        return span

    for c in CONFIGS:  # warm up: metadata inference, allocator, FLOP count
        step(c, count_flops=True)
        step(c)
    for r in range(args.rounds):
        for c in CONFIGS:
            times[c].extend(step(c) for _ in range(args.steps))
        if dist.get_rank() == 0 and (r + 1) % max(1, args.rounds // 5) == 0:
            print(f"  round {r + 1}/{args.rounds}", flush=True)
    if dist.get_rank() == 0:
        print(report(times, bubbles, flops, args, device))


def report(
    times: dict[tuple[str, str], list[float]],
    bubbles: dict[tuple[str, str], list[float]],
    flops: dict[tuple[str, str], int],
    args: argparse.Namespace,
    device: torch.device,
) -> str:
    med = {c: statistics.median(t) for c, t in times.items()}
    n = len(next(iter(times.values())))
    lines = [
        f"pipeline step time, {dist.get_world_size()} ranks on {device.type}"
        f" ({dist.get_backend()}), stage: {args.stage}, {args.microbatches} microbatches x"
        f" {args.batch // args.microbatches} rows, dim {args.dim}/{args.hidden}, {n} steps each",
        f"{'ops':<18} {'schedule':<24} {'median ms':>9} {'min ms':>7} {'bubble':>6} {'GFLOP':>7}",
    ]
    for c in CONFIGS:
        lines.append(
            f"{pp.IMPLS[c[0]].name:<18} {c[1]:<24} {1e3 * med[c]:>9.1f}"
            f" {1e3 * min(times[c]):>7.1f} {statistics.median(bubbles[c]):>6.0%}"
            f" {flops[c] / 1e9:>7.2f}"
        )
    low = {c: min(t) for c, t in times.items()}

    def ratio(a: tuple[str, str], b: tuple[str, str]) -> str:
        return f"{med[a] / med[b]:>6.2f} {low[a] / low[b]:>6.2f}"

    cg_zb, cg_full, fn_zb, fn_full = (
        ("customgrad", ZB),
        ("customgrad", FULL),
        ("function", ZB),
        ("function", FULL),
    )
    lines += [
        "",
        f"{'ratio of step times':<48} {'median':>6} {'min':>6}",
        f"{'ZBV / Interleaved1F1B, customgrad ops':<48} {ratio(cg_zb, cg_full)}",
        f"{'ZBV / Interleaved1F1B, autograd.Function ops':<48} {ratio(fn_zb, fn_full)}",
        f"{'ZBV, autograd.Function / customgrad':<48} {ratio(fn_zb, cg_zb)}",
        f"{'Interleaved1F1B, autograd.Function / customgrad':<48} {ratio(fn_full, cg_full)}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return pp.launch(bench_worker, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
