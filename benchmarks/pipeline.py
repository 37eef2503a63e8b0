"""Zero-bubble schedules against 1F1B: customgrad ops, native layers and plain Functions.

One run, 2 processes (gloo on CPU; NCCL when each process has its own GPU). The same model,
pre-norm MLP blocks (RMSNorm, two linears with bias, ``benchmarks/_models.py``), in three kinds
of op: native layers (``nn.Linear``'s and ``nn.RMSNorm``'s functions, the anchor), customgrad
ops, plain ``torch.autograd.Function``\\ s. Each runs under ``Schedule1F1B`` (one stage a rank),
``ScheduleInterleaved1F1B``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV`` and
``ScheduleInterleavedZeroBubble`` (two stages a rank); every rank holds the same blocks under
every schedule. customgrad ops run on ``customgrad.pipelining.PipelineStage``, the others on
torch's (what their users have); ``customgrad ops, torch's stage`` shows what customgrad's stage
adds. All configurations take turns step by step, so drifts of a shared machine hit them alike.

The step time is the slowest rank's, from a barrier to the end of ``schedule.step``; the ratio
to 1F1B is taken step by step (each step against the 1F1B step of the same round), then its
median. Every round runs the configurations in a new (seeded) order: a step's time depends a
little on the step before it. The last line: ZBV's ratio to 1F1B for each kind of op.

    python benchmarks/pipeline.py                       # spawns 2 local processes
    python benchmarks/pipeline.py --rounds 60           # steadier
    torchrun --nproc-per-node 2 benchmarks/pipeline.py
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
import torch.multiprocessing as mp
from _models import Block
from torch import Tensor, nn
from torch.distributed.pipelining import _backward as torch_split

import customgrad.pipelining as cgp

SCHEDULES = (
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
    "ScheduleInterleavedZeroBubble",
)
ZERO_BUBBLE = "ScheduleZBVZeroBubble"  # the schedule of the last line
# (label, kind of op, stage class)
OPS = (
    ("native", "native", pipelining.PipelineStage),
    ("customgrad", "customgrad", cgp.PipelineStage),
    ("function", "function", pipelining.PipelineStage),
    ("customgrad ops, torch's stage", "customgrad", pipelining.PipelineStage),
)


@dataclass(frozen=True)
class Config:
    ops: str  # a label of OPS
    schedule: str


def configs() -> list[Config]:
    out = [Config(label, s) for label, _, _ in OPS[:3] for s in SCHEDULES]
    return [*out, Config(OPS[3][0], ZERO_BUBBLE)]


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output, target)


class Pipeline:
    """One configuration's stages and schedule on this rank, timed by an ``ActionTimer``."""

    def __init__(self, config: Config, args: argparse.Namespace, device: torch.device) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        _, impl, stage_cls = next(o for o in OPS if o[0] == config.ops)
        single = config.schedule == "Schedule1F1B"
        n_stages = world if single else 2 * world
        gen = torch.Generator().manual_seed(0)  # the same model for every configuration
        blocks = [Block(args.dim, args.hidden, impl, gen) for _ in range(2 * world)]
        if single:
            mine = [rank]
        elif config.schedule in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
            mine = [rank, 2 * world - 1 - rank]  # the V
        else:
            mine = [rank, rank + world]  # looped
        per = len(blocks) // n_stages
        self.modules = [nn.Sequential(*blocks[s * per : (s + 1) * per]).to(device) for s in mine]
        self.timer = cgp.ActionTimer(device)
        timed = self.timer.stage_class(stage_cls)
        stages = [timed(m, s, n_stages, device) for m, s in zip(self.modules, mine)]
        cls = getattr(pipelining, config.schedule)
        self.schedule = cls(
            stages[0] if single else stages,
            args.microbatches,
            loss_fn=self.timer.time_loss(loss_fn),
        )
        self.first, self.last = 0 in mine, n_stages - 1 in mine

    def step(self, x: Tensor, target: Tensor, count_flops: bool = False) -> None:
        for m in self.modules:
            m.zero_grad(set_to_none=True)
        dist.barrier()  # the ranks' clocks start together
        with self.timer.step(count_flops=count_flops):
            self.schedule.step(
                *([x] if self.first else []), **({"target": target} if self.last else {})
            )


def bench(args: argparse.Namespace, device: torch.device) -> None:
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.dim, generator=gen).to(device)
    target = torch.randn(args.batch, args.dim, generator=gen).to(device)
    pipes = {c: Pipeline(c, args, device) for c in configs()}
    for pipe in pipes.values():  # warm up: shape inference, allocator; FLOPs counted once
        pipe.step(x, target)
        pipe.step(x, target, count_flops=True)
    order = list(pipes.values())
    for r in range(args.rounds):
        # A step runs a little faster or slower depending on the step before it (measured: a
        # ZBV step after another ZBV step ~5% faster than after a 1F1B one): every round takes
        # the configurations in a new order, the same on every rank.
        random.Random(r).shuffle(order)
        for pipe in order:
            pipe.step(x, target)
        if rank == 0 and (r + 1) % max(1, args.rounds // 5) == 0:
            print(f"  round {r + 1}/{args.rounds}", flush=True)
    steps = {c: pipe.timer.gather() for c, pipe in pipes.items()}
    if rank == 0:
        print(report(steps, args, device))


def replayed(args: argparse.Namespace, device: torch.device) -> str:
    """ZBV against 1F1B replayed from one block's F, I, W and B measured on one process (on a
    CPU in CPU time: free of other processes), without the schedule's runtime, per kind of op."""
    rows = args.batch // args.microbatches
    gen = torch.Generator().manual_seed(1)
    x0, g = (torch.randn(rows, args.dim, generator=gen).to(device) for _ in range(2))

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return time.thread_time()

    ratios = {}
    for label, impl, stage_cls in [*OPS[:3], *OPS[:3]]:  # the first round warms the allocator
        split: Any = cgp if stage_cls is cgp.PipelineStage else torch_split
        block = Block(args.dim, args.hidden, impl, torch.Generator().manual_seed(0)).to(device)
        times: dict[str, list[float]] = {k: [] for k in "FIWB"}
        for _ in range(25):
            x = x0.clone().requires_grad_()
            t = clock()
            y = block(x)
            times["F"].append(clock() - t)
            t = clock()
            _, groups = split.stage_backward_input([y], [g], [x], block.parameters())
            times["I"].append(clock() - t)
            t = clock()
            split.stage_backward_weight(block.parameters(), groups)
            times["W"].append(clock() - t)
            x = x0.clone().requires_grad_()
            y = block(x)
            t = clock()
            y.backward(g)
            times["B"].append(clock() - t)
        f, i, w, b = (statistics.median(times[k][5:]) for k in "FIWB")
        one = cgp.StageCosts(f, i, w, b)
        two = cgp.StageCosts(2 * f, 2 * i, 2 * w, 2 * b)  # 1F1B: two blocks a stage
        zb = cgp.simulate(getattr(pipelining, ZERO_BUBBLE), 4, args.microbatches, one)
        base = cgp.simulate(pipelining.Schedule1F1B, 2, args.microbatches, two)
        ratios[label] = (zb.step_time / base.step_time, (i + w) / b)
    how = "CPU time" if device.type == "cpu" else "time"
    return (
        f"replayed from one block's F / I / W / B in {how} on one process (no runtime, no other"
        " rank): zero-bubble/1F1B "
        + " ".join(f"{o}={r:.3f} ((I+W)/B {iw:.3f})" for o, (r, iw) in ratios.items())
    )


def report(
    steps: dict[Config, list[cgp.StepTimeline]], args: argparse.Namespace, device: torch.device
) -> str:
    flops = {c: sum(a.flops or 0 for r in s[1].ranks for a in r.actions) for c, s in steps.items()}
    timed = {c: s[2:] for c, s in steps.items()}
    ms = {c: [t.duration * 1e3 for t in s] for c, s in timed.items()}
    world = len(next(iter(timed.values()))[0].ranks)

    def base(c: Config) -> Config:
        return Config("customgrad" if c.ops == OPS[3][0] else c.ops, "Schedule1F1B")

    def vs_1f1b(c: Config) -> float:
        return statistics.median(a / b for a, b in zip(ms[c], ms[base(c)]))

    head = f"{'ops':<30} {'schedule':<30} {'median ms':>9} {'min ms':>7} {'GFLOP':>6}"
    head += f" {'/ 1F1B':>6} {'min /':>6} | {'bubble':>6} {'peer':>5} {'xfer':>5} {'cpu':>5}"
    head += f" {'off':>5}"
    lines = [
        f"pipeline step time, {world} ranks on {device.type} ({dist.get_backend()}),"
        f" {args.microbatches} microbatches x {args.batch // args.microbatches} rows,"
        f" dim {args.dim}/{args.hidden}, {len(next(iter(ms.values())))} steps each (median and"
        " min of the slowest rank); / 1F1B: median of step-by-step ratios to the same ops'"
        " Schedule1F1B (min /: of the minima, the steps least disturbed by other processes);"
        " bubble: idle share of ranks x step (median), and where it went (mean"
        " shares of the step): waiting while the peer computed or had finished (peer, with the"
        " step's tail), transfers (xfer), the runtime's CPU work between actions (cpu), off the"
        " CPU between actions (off: waiting for a core, blocked in sends)",
        head,
        "-" * len(head),
    ]
    for c in steps:
        parts = [b for t in timed[c] for b in t.breakdown()]
        ranks = [r for t in timed[c] for r in t.ranks]
        share = {
            "peer": statistics.mean((b.peer + b.tail) / b.total for b in parts),
            "xfer": statistics.mean(b.transfer / b.total for b in parts),
            "cpu": statistics.mean(r.other_cpu / b.total for r, b in zip(ranks, parts)),
            "off": statistics.mean((b.other - r.other_cpu) / b.total for r, b in zip(ranks, parts)),
        }
        lines.append(
            f"{c.ops:<30} {c.schedule:<30} {statistics.median(ms[c]):>9.1f} {min(ms[c]):>7.1f}"
            f" {flops[c] / 1e9:>6.2f} {vs_1f1b(c):>6.3f} {min(ms[c]) / min(ms[base(c)]):>6.3f} |"
            f" {statistics.median(t.bubble for t in timed[c]):>6.1%}"
            + "".join(f" {v:>5.1%}" for v in share.values())
        )
    lines.append(replayed(args, device))
    ratios = {o: vs_1f1b(Config(o, ZERO_BUBBLE)) for o in ("customgrad", "native", "function")}
    lines.append(
        "zero-bubble/1F1B step time: " + " ".join(f"{o}={r:.3f}" for o, r in ratios.items())
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20, help="steps of each configuration")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument(
        "--batch", type=int, default=2048, help="rows per step (256 a microbatch by default)"
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--nproc",
        type=int,
        help="local processes when not under torchrun (default 2; with --device cuda, one per"
        " GPU, at most 2)",
    )
    args = p.parse_args(argv)
    if args.nproc is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        args.nproc = max(1, min(2, gpus)) if args.device == "cuda" else 2
    return args


def run(args: argparse.Namespace) -> None:
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "cuda" or (args.device == "auto" and gpus >= local_world):
        device = torch.device("cuda", local_rank % max(gpus, 1))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    try:
        bench(args, device)
    finally:
        dist.destroy_process_group()


def _spawned(local_rank: int, args: argparse.Namespace) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(args.nproc),
        LOCAL_WORLD_SIZE=str(args.nproc),
    )
    run(args)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:  # started by torchrun
        run(args)
        return
    with socket.socket() as s:  # a free port for the process group's rendezvous
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    mp.spawn(_spawned, args=(args,), nprocs=args.nproc)  # stops the others if one fails


if __name__ == "__main__":
    sys.exit(main())
