"""Compiled blocks in zero-bubble pipelines: customgrad.compile against plain torch.compile.

One run, three measurements, each against an anchor measured in the same run:

1. One compiled block (``benchmarks/_models.py``'s pre-norm MLP block, native layers, inductor):
   time of the split backward (``stage_backward_input`` then ``stage_backward_weight``) over
   the time of its full backward. customgrad.compile against plain ``torch.compile`` (which
   needs ``donated_buffer=False`` to run split at all, set here for it alone, and then runs its
   whole backward in both passes).
2. Compile time of the block (first forward and backward) against plain ``torch.compile``.
3. Pipeline step time on 2 processes (gloo on CPU; NCCL with ``--device cuda``, one process per
   GPU, at most 2): ZBV over 1F1B for blocks compiled with customgrad.compile (customgrad's
   ``PipelineStage``), for eager customgrad ops (customgrad's stage), and for blocks compiled
   with ``nn.Module.compile`` (torch's stage), the medians of step-by-step ratios. With one GPU
   one process holds both stages of the V (NCCL refuses two ranks on one device): there is no
   bubble to remove, and the ratio shows what the split costs on one device.

4. The same ratio replayed (``customgrad.pipelining.simulate``) from one block's F, I, W and B
   measured on one process (CPU time on a CPU: free of the other processes), for compiled and
   eager blocks: what the blocks' costs allow, without the schedule's runtime.

The last lines: ``compiled zero-bubble/1F1B step time: customgrad=<r> eager=<r> torch=<r or
error>`` and the replayed ratios.

    python benchmarks/compiled.py                    # a few minutes on 2 CPU cores
    python benchmarks/compiled.py --device cuda      # make gpu-check; 1 or 2 GPUs
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
import torch.multiprocessing as mp
from _models import Block
from pipeline import loss_fn
from torch import Tensor, nn
from torch.distributed.pipelining import _backward as torch_split

import customgrad as cg
import customgrad.pipelining as cgp
from customgrad._torch.functions import handles_keep_nodes

# (label, kind of op, stage class, how blocks are compiled)
CONFIGS = (
    ("customgrad", "native", cgp.PipelineStage, "customgrad"),
    ("eager", "customgrad", cgp.PipelineStage, None),
    ("torch", "native", pipelining.PipelineStage, "torch"),
)
SCHEDULES = ("Schedule1F1B", "ScheduleZBVZeroBubble")


def compiled_block(
    args: argparse.Namespace, how: str, device: torch.device, impl: str = "native"
) -> nn.Module:
    block = Block(args.dim, args.hidden, impl, torch.Generator().manual_seed(0)).to(device)
    if how == "customgrad":
        cg.compile(block)
    elif how == "torch":
        block.compile()
    return block


def clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# --- 1 and 2: one block on one process ------------------------------------------------------


def block_figures(
    args: argparse.Namespace, device: torch.device
) -> tuple[str, dict[str, float | None]]:
    """The one-block lines, and the (I+W)/full backward time ratio of each way of compiling."""
    rows = args.batch // args.microbatches
    gen = torch.Generator().manual_seed(1)
    x0, g = (torch.randn(rows, args.dim, generator=gen).to(device) for _ in range(2))
    lines = []
    ratios: dict[str, float | None] = {"torch": None}
    compile_s: dict[str, float] = {}
    warm = Block(8, 8, "native", torch.Generator().manual_seed(0)).to(device)  # imports
    torch.compile(warm)(torch.randn(2, 8, device=device, requires_grad=True)).sum().backward()
    # compile time: each twice in turns, the second time (on-disk kernel caches as warm for
    # both); the FX graph cache off, or the second compile would only load
    for how in ("torch", "customgrad", "torch", "customgrad"):
        torch._dynamo.reset()
        patch = torch._functorch.config.patch(donated_buffer=how != "torch")
        with patch, torch._inductor.config.patch(fx_graph_cache=False):
            block = compiled_block(args, how, device)
            t = clock(device)
            block(x0.clone().requires_grad_()).backward(g)
            compile_s[how] = clock(device) - t
    # torch's split (torch's stage) for both; before torch 2.13 it cannot run a compiled block
    # (an autograd.Function): customgrad's split there, and no figure for torch.compile's
    splits = {"torch": torch_split, "customgrad": torch_split}
    if not handles_keep_nodes():
        splits = {"customgrad": cgp}
    for how, splitter in splits.items():
        torch._dynamo.reset()
        patch = torch._functorch.config.patch(donated_buffer=how != "torch")
        with patch:
            block = compiled_block(args, how, device)
            block(x0.clone().requires_grad_()).backward(g)  # compiles (cached)
            full: list[float] = []
            split: list[float] = []
            for _ in range(args.reps):
                x = x0.clone().requires_grad_()
                y = block(x)
                t = clock(device)
                y.backward(g)
                full.append(clock(device) - t)
                x = x0.clone().requires_grad_()
                y = block(x)
                t = clock(device)
                _, groups = splitter.stage_backward_input([y], [g], [x], block.parameters())
                splitter.stage_backward_weight(block.parameters(), groups)
                split.append(clock(device) - t)
        skip = args.reps // 5
        ratios[how] = statistics.median(
            s / f for s, f in zip(split[skip:], full[skip:], strict=True)
        )
    lines.append(
        f"one compiled block ({rows} rows, dim {args.dim}/{args.hidden}, inductor, "
        f"{args.reps} reps): (I+W)/full backward time: customgrad={ratios['customgrad']:.3f} "
        f"torch(donated_buffer=False)="
        + (
            "n/a (torch's split before 2.13)"
            if ratios["torch"] is None
            else f"{ratios['torch']:.3f}"
        )
    )
    torch._dynamo.reset()  # nothing compiled here is reused by the pipelines
    lines.append(
        f"compile time (first forward+backward, FX graph cache off, kernels built once "
        f"before): "
        f"customgrad={compile_s['customgrad']:.1f}s torch={compile_s['torch']:.1f}s "
        f"ratio={compile_s['customgrad'] / compile_s['torch']:.2f}"
    )
    return "\n".join(lines), {
        "customgrad.compile": ratios["customgrad"],
        "torch.compile (donated_buffer=False)": ratios["torch"],
    }


def replayed(args: argparse.Namespace, device: torch.device) -> str:
    """ZBV over 1F1B replayed from one block's F, I, W and B (medians) measured on this process,
    for blocks compiled by customgrad.compile and for eager customgrad ops, both under
    customgrad's split: what the blocks' costs allow, without the schedule's runtime."""
    rows = args.batch // args.microbatches
    world = dist.get_world_size()
    gen = torch.Generator().manual_seed(1)
    x0, g = (torch.randn(rows, args.dim, generator=gen).to(device) for _ in range(2))

    def cpu_clock() -> float:
        return clock(device) if device.type == "cuda" else time.thread_time()

    out = {}
    for label, impl, _, how in [c for c in CONFIGS if c[0] in ("customgrad", "eager")]:
        block = compiled_block(args, how or "", device, impl)
        times: dict[str, list[float]] = {k: [] for k in "FIWB"}
        for _ in range(args.reps + 3):  # the first 3 compile and warm up
            x = x0.clone().requires_grad_()
            t = cpu_clock()
            y = block(x)
            times["F"].append(cpu_clock() - t)
            t = cpu_clock()
            _, groups = cgp.stage_backward_input([y], [g], [x], block.parameters())
            times["I"].append(cpu_clock() - t)
            t = cpu_clock()
            cgp.stage_backward_weight(block.parameters(), groups)
            times["W"].append(cpu_clock() - t)
            x = x0.clone().requires_grad_()
            y = block(x)
            t = cpu_clock()
            y.backward(g)
            times["B"].append(cpu_clock() - t)
        f, i, w, b = (statistics.median(times[k][3:]) for k in "FIWB")
        one = cgp.StageCosts(f, i, w, b)  # ZBV: a block a stage, 2 stages a rank
        two = cgp.StageCosts(2 * f, 2 * i, 2 * w, 2 * b)  # 1F1B: two blocks a stage
        zb = cgp.simulate(pipelining.ScheduleZBVZeroBubble, 2 * world, args.microbatches, one)
        base = cgp.simulate(pipelining.Schedule1F1B, world, args.microbatches, two)
        out[label] = (
            f"{label}={zb.step_time / base.step_time:.3f} (F {f * 1e3:.2f}, I {i * 1e3:.2f}, "
            f"W {w * 1e3:.2f}, B {b * 1e3:.2f} ms; (I+W)/B {(i + w) / b:.3f}, B/F {b / f:.2f})"
        )
    torch._dynamo.reset()
    how_timed = "CPU time" if device.type == "cpu" else "time"
    return (
        f"replayed from one block's F / I / W / B ({how_timed}, median of {args.reps}) on one "
        "process, no runtime: zero-bubble/1F1B " + " ".join(out.values())
    )


# --- 3: pipelines on 2 processes ------------------------------------------------------------


class Pipeline:
    """One configuration's stages and schedule on this rank."""

    def __init__(
        self, config: tuple[str, str, Any, str | None], schedule: str, args: argparse.Namespace,
        device: torch.device,
    ) -> None:  # fmt: skip
        _, impl, stage_cls, how = config
        rank, world = dist.get_rank(), dist.get_world_size()
        single = schedule == "Schedule1F1B"
        n_stages = world if single else 2 * world
        gen = torch.Generator().manual_seed(0)
        blocks = [Block(args.dim, args.hidden, impl, gen).to(device) for _ in range(2 * world)]
        for b in blocks:
            if how == "customgrad":
                cg.compile(b)
            elif how == "torch":
                b.compile()
        mine = [rank] if single else [rank, 2 * world - 1 - rank]
        per = len(blocks) // n_stages
        self.modules = [nn.Sequential(*blocks[s * per : (s + 1) * per]) for s in mine]
        stages = [stage_cls(m, s, n_stages, device) for m, s in zip(self.modules, mine)]
        cls = getattr(pipelining, schedule)
        self.schedule = cls(stages[0] if single else stages, args.microbatches, loss_fn=loss_fn)
        self.first, self.last = 0 in mine, n_stages - 1 in mine
        self.device = device

    def step(self, x: Tensor, target: Tensor) -> float:
        for m in self.modules:
            m.zero_grad(set_to_none=True)
        dist.barrier()
        t = clock(self.device)
        self.schedule.step(
            *([x] if self.first else []), **({"target": target} if self.last else {})
        )
        took = torch.tensor([clock(self.device) - t], device=self.device)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's
        return float(took.item())


def split_error(
    args: argparse.Namespace, device: torch.device, how: str | None, splitter: Any = torch_split
) -> str | None:
    """What a split backward (``splitter``'s, the stage's) of one block compiled ``how`` raises
    under torch's defaults, if anything (plain ``nn.Module.compile``: the donated-buffer error;
    before torch 2.13 torch's split cannot run any compiled block)."""
    if how is None:
        return None
    block = compiled_block(args, how, device)
    x = torch.randn(args.batch // args.microbatches, args.dim, device=device, requires_grad=True)
    try:
        y = block(x)
        _, groups = splitter.stage_backward_input(
            [y], [torch.ones_like(y)], [x], block.parameters()
        )
        splitter.stage_backward_weight(block.parameters(), groups)
    except Exception as e:
        cause = e.__cause__ or e
        return f"error({type(cause).__name__}: {str(cause).strip().splitlines()[0][:60]}...)"
    return None


def pipeline_figures(args: argparse.Namespace, device: torch.device) -> dict[str, str]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.dim, generator=gen).to(device)
    target = torch.randn(args.batch, args.dim, generator=gen).to(device)
    pipes: dict[tuple[str, str], Pipeline] = {}
    failed: dict[str, str] = {}
    for config in [c for c in CONFIGS if c[0] in args.only]:
        splitter = cgp if config[2] is cgp.PipelineStage else torch_split
        error = split_error(args, device, config[3], splitter)
        if error is not None:  # one rank failing inside a schedule would leave the other waiting
            failed[config[0]] = error
            continue
        for schedule in SCHEDULES:
            pipe = Pipeline(config, schedule, args, device)
            pipe.step(x, target)  # compiles; shape inference
            pipe.step(x, target)
            pipes[(config[0], schedule)] = pipe
    times: dict[tuple[str, str], list[float]] = {k: [] for k in pipes}
    order = list(pipes)
    for r in range(args.rounds):
        random.Random(r).shuffle(order)
        for key in order:
            times[key].append(pipes[key].step(x, target))
    out = {}
    for label, *_ in [c for c in CONFIGS if c[0] in args.only]:
        if label in failed:
            out[label] = failed[label]
            continue
        zb, base = times[(label, SCHEDULES[1])], times[(label, SCHEDULES[0])]
        out[label] = f"{statistics.median(a / b for a, b in zip(zb, base)):.3f}"
    return out


def bench(args: argparse.Namespace, device: torch.device) -> None:
    rank = dist.get_rank()
    block, block_ratios = (
        block_figures(args, device) if rank == 0 and not args.no_block else ("", {})
    )
    replay = replayed(args, device) if rank == 0 else ""
    dist.barrier()
    ratios = pipeline_figures(args, device)
    if rank == 0:
        print(block)
        one = " (1 rank holds both stages of the V)" if dist.get_world_size() == 1 else ""
        print(
            f"pipeline, {dist.get_world_size()} ranks on {device.type}{one}, {args.microbatches} "
            f"microbatches x {args.batch // args.microbatches} rows, {args.rounds} steps each: "
            "ZBV/1F1B (median of step-by-step ratios); customgrad: blocks compiled by "
            "customgrad.compile on customgrad's stage; eager: customgrad ops, not compiled; "
            "torch: blocks compiled by nn.Module.compile on torch's stage"
        )
        print(
            "compiled zero-bubble/1F1B step time: "
            + " ".join(f"{k}={v}" for k, v in ratios.items())
        )
        print(replay)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"block": block_ratios, "pipeline": ratios}, f)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10, help="pipeline steps of each configuration")
    p.add_argument("--reps", type=int, default=20, help="backwards of the one block, each way")
    p.add_argument("--no-block", action="store_true", help="skip the one-block figures")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2048, help="rows per step")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--json", help="also write the ratios to this file (benchmarks.gpu_check)")
    p.add_argument(
        "--nproc",
        type=int,
        help="processes (default 2; with --device cuda, one per GPU, at most 2)",
    )
    p.add_argument(
        "--only", nargs="+", default=[c[0] for c in CONFIGS], help="pipeline configurations"
    )
    args = p.parse_args(argv)
    if args.nproc is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        args.nproc = max(1, min(2, gpus)) if args.device == "cuda" else 2
    return args


def _spawned(rank: int, args: argparse.Namespace, port: int, main: Callable[..., None]) -> None:
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.nproc,
        device_id=device if device.type == "cuda" else None,
    )  # fmt: skip
    try:
        main(args, device)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/compiled.py --device cuda: no CUDA GPU is visible")
    mp.spawn(_spawned, args=(args, port, bench), nprocs=args.nproc)  # stops the others if one fails


if __name__ == "__main__":
    main()
