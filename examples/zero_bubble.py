"""Train a small language model of customgrad ops through a zero-bubble pipeline.

A decoder-only transformer (token embedding, RMSNorm, causal attention, SwiGLU MLP, LM head with
cross-entropy; every op a customgrad op, see ``lm_ops.py``) learns to predict the next byte of
the Python standard library's own source files. ``ScheduleZBVZeroBubble`` runs it as 4 stages on
2 processes (gloo on CPU, NCCL when each process has a GPU); the first step's gradients are
checked against the same model on one process.

    python examples/zero_bubble.py                           # spawns 2 local processes
    torchrun --nproc-per-node 2 examples/zero_bubble.py      # torch's launcher (multi-node too)
    python examples/zero_bubble.py --schedule DualPipeV      # any zero-bubble schedule
    python examples/zero_bubble.py --check                   # seconds, for CI
    python examples/zero_bubble.py --compile                 # blocks by customgrad.compile

Writes ``out/zero_bubble.png`` (each action of a step as measured, above the same schedule
replayed with the measured action times and no waits) and ``out/loss.png``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import socket
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
import torch.multiprocessing as mp
from torch import Tensor, nn

import customgrad
import customgrad.pipelining as cgp

if __package__:  # python -m examples.zero_bubble, or imported (python -m benchmarks.scale)
    from examples import lm_ops as ops
    from examples import pipeline_report
else:  # python examples/zero_bubble.py
    import lm_ops as ops
    import pipeline_report


@dataclass(frozen=True)
class Config:
    vocab: int = 256  # bytes
    dim: int = 128
    heads: int = 4
    hidden: int = 352  # SwiGLU width, about 8/3 of dim
    layers: int = 4  # one per stage: 2 per process
    seq: int = 64  # tokens per sequence


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a SwiGLU MLP."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        d, h = cfg.dim, cfg.hidden
        self.heads = cfg.heads
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.qkv = nn.Parameter(torch.randn(3 * d, d) * d**-0.5)
        self.proj = nn.Parameter(torch.randn(d, d) * (2 * d * cfg.layers) ** -0.5)
        self.mlp_norm = nn.Parameter(torch.ones(d))
        self.gate_up = nn.Parameter(torch.randn(2 * h, d) * d**-0.5)
        self.down = nn.Parameter(torch.randn(d, h) * (2 * h * cfg.layers) ** -0.5)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        qkv = ops.linear(ops.rms_norm(x, self.attn_norm), self.qkv)
        q, k, v = qkv.view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = ops.causal_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = x + ops.linear(attn, self.proj)
        h = ops.silu_and_mul(ops.linear(ops.rms_norm(x, self.mlp_norm), self.gate_up))
        return x + ops.linear(h, self.down)


class Embedding(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.tokens = nn.Parameter(torch.randn(cfg.vocab, cfg.dim) * 0.1)
        self.positions = nn.Parameter(torch.randn(cfg.seq, cfg.dim) * 0.1)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return ops.embedding(tokens, self.tokens) + ops.embedding(positions, self.positions)


class Head(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(cfg.dim))
        self.weight = nn.Parameter(torch.randn(cfg.vocab, cfg.dim) * cfg.dim**-0.5)

    def forward(self, x: Tensor) -> Tensor:
        return ops.linear(ops.rms_norm(x, self.norm), self.weight)  # logits


class LanguageModel(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.head = Head(cfg)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Stage(nn.Module):
    """Stage ``index`` of ``n``: an even share of the model's blocks (its own modules, not
    copies); the first stage also embeds, the last also predicts."""

    def __init__(self, model: LanguageModel, index: int, n: int) -> None:
        super().__init__()
        per = len(model.blocks) // n
        self.embed = model.embed if index == 0 else None
        self.blocks = nn.ModuleList(model.blocks[index * per : (index + 1) * per])
        self.head = model.head if index == n - 1 else None

    def forward(self, x: Tensor) -> Tensor:
        x = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    return ops.cross_entropy(logits, targets)


def load_text(limit: int = 8 << 20) -> Tensor:
    """The standard library's ``.py`` files as bytes, in a fixed order: the same on every rank."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    data = b"".join(f.read_bytes() for f in files)[:limit]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def get_batch(text: Tensor, step: int, rows: int, seq: int) -> tuple[Tensor, Tensor]:
    """``rows`` windows at random places (the same on every rank): inputs, and the next bytes."""
    gen = torch.Generator().manual_seed(step)
    starts = torch.randint(len(text) - seq - 1, (rows,), generator=gen)
    windows = torch.stack([text[s : s + seq + 1] for s in starts.tolist()])
    # contiguous: torch 2.11's schedule checks a microbatch's strides against the ones it
    # inferred, and a slice of the windows has the windows' row stride
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def check_first_step(
    model: LanguageModel,
    stages: list[Stage],
    reference: LanguageModel,
    x: Tensor,
    y: Tensor,
    microbatches: int,
) -> str:
    """Compare this rank's gradients with one process's, microbatched as the schedule does
    (it averages the microbatches' losses). Raises on every rank if any rank's differ."""
    loss = sum(
        loss_fn(reference(xm), ym) for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches))
    )
    (loss / microbatches).backward()  # type: ignore[operator]
    names = {id(p): name for name, p in model.named_parameters()}
    want = dict(reference.named_parameters())
    worst = 0.0
    for p in (p for stage in stages for p in stage.parameters()):
        g, w = p.grad, want[names[id(p)]].grad
        err = 1.0 if g is None or w is None else ((g - w).abs().max() / w.abs().max()).item()
        worst = max(worst, err)
    ok = torch.tensor([float(worst < 1e-4)], device=x.device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        raise RuntimeError(f"first-step gradients differ from one process's ({worst:.2g} here)")
    return (
        f"check passed: first-step gradients equal one process's (max relative error {worst:.1g})"
    )


def train(args: argparse.Namespace) -> None:
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    try:
        run(args, device)
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    n_stages = 2 * world
    cfg = dataclasses.replace(args.config, layers=n_stages)  # a block per stage
    torch.manual_seed(0)  # the same initial model on every rank
    model = LanguageModel(cfg).to(device)
    reference = copy.deepcopy(model)
    if args.compile:  # regional compile: each block, its backward split into I and W
        for block in model.blocks:
            customgrad.compile(block)
    timer = cgp.ActionTimer(device)
    if args.schedule == "ScheduleInterleavedZeroBubble":
        mine = [rank, rank + world]  # looped: stage s on rank s % world
    else:
        mine = [rank, n_stages - 1 - rank]  # V-shaped: rank r holds stages r and 2w-1-r
    stages = [Stage(model, s, n_stages) for s in mine]
    pipeline_stages = [
        timer.stage_class(cgp.PipelineStage)(m, s, n_stages, device) for m, s in zip(stages, mine)
    ]
    schedule = getattr(pipelining, args.schedule)(
        pipeline_stages, args.microbatches, loss_fn=timer.time_loss(loss_fn)
    )
    weights = [p for m in stages for p in m.parameters()]
    optimizer = torch.optim.AdamW(weights, lr=args.lr, weight_decay=0.0)
    text, losses = load_text(), []
    if rank == 0:
        print(
            f"{args.schedule}: {world} ranks x 2 stages, {dist.get_backend()} on {device.type}, "
            f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
            f"{len(text) / 1e6:.1f} MB of text, {args.steps} steps",
            flush=True,
        )
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = (t.to(device) for t in get_batch(text, step, args.batch, cfg.seq))
        mb_losses: list[Tensor] = []
        with timer.step():
            schedule.step(
                *([x] if 0 in mine else []),
                **({"target": y, "losses": mb_losses} if n_stages - 1 in mine else {}),
            )
        if step == 0:
            message = check_first_step(model, stages, reference, x, y, args.microbatches)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.stack(mb_losses).mean() if mb_losses else torch.zeros((), device=device)
        dist.all_reduce(loss)  # only the last stage's rank has it
        losses.append(loss.item())
        if rank == 0 and (step == 0 or (step + 1) % max(1, args.steps // 10) == 0):
            if step == 0:
                print(message, flush=True)
            rate = (step + 1) / (time.perf_counter() - start)
            print(
                f"  step {step + 1:>4}/{args.steps}  loss {losses[-1]:.3f}  ({rate:.1f} steps/s)",
                flush=True,
            )
    timeline = timer.gather()
    if rank == 0:
        pipeline_report.report(timeline, losses, schedule, args.out)
        if sum(losses[-5:]) / len(losses[-5:]) >= losses[0]:
            raise RuntimeError(f"the loss did not go down: {losses[0]:.3f} -> {losses[-5:]}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--schedule",
        default="ZBVZeroBubble",
        choices=["ZBVZeroBubble", "DualPipeV", "InterleavedZeroBubble"],
        help="torch's zero-bubble schedule to train with (torch.distributed.pipelining's "
        "Schedule<name>)",
    )
    p.add_argument("--steps", type=int, default=150, help="training steps")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument(
        "--microbatches", type=int, default=8, help="microbatches each step is split into"
    )
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
    p.add_argument(
        "--nproc", type=int, default=2, help="local processes to spawn when not under torchrun"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("out"),
        help="folder for the pictures: zero_bubble.png (the measured step and its replay) and "
        "loss.png",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="a tiny model for 2 steps, for CI: checks the gradients and that the run works",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile each block with customgrad.compile (inductor), its backward split into I and W",
    )
    args = p.parse_args(argv)
    args.schedule = "Schedule" + args.schedule
    args.config = Config(dim=32, heads=2, hidden=64, seq=16) if args.check else Config()
    if args.check:
        args.steps, args.batch, args.microbatches = 2, 8, 4
    return args


def _spawned(local_rank: int, args: argparse.Namespace) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(args.nproc),
        LOCAL_WORLD_SIZE=str(args.nproc),
    )
    train(args)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:  # started by torchrun
        train(args)
        return
    with socket.socket() as s:  # a free port for the process group's rendezvous
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    mp.spawn(_spawned, args=(args,), nprocs=args.nproc)  # stops the others if one fails


if __name__ == "__main__":
    sys.exit(main())
