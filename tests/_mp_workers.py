"""What ``tests/test_pipeline_mp.py`` runs on several processes, and a bounded launcher.

A small model (pre-norm MLP blocks) in three kinds of op: customgrad ops, plain
``torch.autograd.Function``\\ s and native ones; pipeline stages of four kinds; one training step
per case through torch's schedules, timed with ``customgrad.pipelining.ActionTimer`` (FLOPs
counted per action), compared with one process's gradients. Workers live in a module of their
own so that spawned processes can unpickle them.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import pickle
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
import torch.multiprocessing as mp
from torch import Tensor, nn

import customgrad as cg
import customgrad.pipelining as cgp
from customgrad._flops import FlopCounter
from tests.conftest import function_linear, linear_op

DIM, HIDDEN, ROWS, MICROBATCHES, BLOCKS = 16, 32, 16, 4, 4
DTYPE = torch.float64  # the pipeline's gradients must equal one process's to rounding
EPS = 1e-6
ZERO_BUBBLE = ("ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble", "ScheduleDualPipeV")
FULL_BACKWARD = "ScheduleInterleaved1F1B"
SCHEDULES = (*ZERO_BUBBLE, FULL_BACKWARD)
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
IMPLS = ("customgrad", "function", "native")
STAGE_KINDS = ("customgrad", "torch", "queue", "customgrad+queue")

cg_linear = linear_op("mp_pipeline::linear")
fn_linear = function_linear()


@cg.op("mp_pipeline::rms_norm", weights=("weight",))
def cg_rms_norm(x: Tensor, weight: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


@cg_rms_norm.register_fake
def _(x: Tensor, weight: Tensor) -> Tensor:
    return torch.empty_like(x)


@cg_rms_norm.register_save_for_backward
def _(inputs: Any, output: Tensor) -> Any:
    rstd = torch.rsqrt(inputs.x.pow(2).mean(-1, keepdim=True) + EPS)
    return inputs.x * rstd, rstd, inputs.weight


@cg_rms_norm.register_backward_input
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor]:
    x_hat, rstd, weight = saved
    gw = grad * weight
    return {"x": rstd * (gw - x_hat * (gw * x_hat).mean(-1, keepdim=True))}


@cg_rms_norm.register_backward_weight
def _(ctx: cg.BackwardContext, saved: Any, grad: Tensor) -> dict[str, Tensor]:
    return {"weight": (grad * saved[0]).flatten(0, -2).sum(0)}


class FnRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor) -> Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
        ctx.save_for_backward(x * rstd, rstd, weight)
        return x * rstd * weight

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        x_hat, rstd, weight = ctx.saved_tensors
        gw = grad * weight
        gx = rstd * (gw - x_hat * (gw * x_hat).mean(-1, keepdim=True))
        return gx, (grad * x_hat).flatten(0, -2).sum(0)


OPS: dict[str, tuple[Callable[[Tensor, Tensor], Tensor], Callable[[Tensor, Tensor], Tensor]]] = {
    "customgrad": (cg_linear, cg_rms_norm),
    "function": (fn_linear, FnRMSNorm.apply),
    "native": (nn.functional.linear, lambda x, w: nn.functional.rms_norm(x, x.shape[-1:], w, EPS)),
}


class Block(nn.Module):
    """``x + w2 @ relu(w1 @ rms_norm(x))`` in the ops of ``impl``."""

    def __init__(self, impl: str, generator: torch.Generator) -> None:
        super().__init__()
        self.impl = impl
        self.norm = nn.Parameter(1 + 0.1 * torch.randn(DIM, generator=generator, dtype=DTYPE))
        self.w1 = nn.Parameter(torch.randn(HIDDEN, DIM, generator=generator, dtype=DTYPE) / 4)
        self.w2 = nn.Parameter(torch.randn(DIM, HIDDEN, generator=generator, dtype=DTYPE) / 6)

    def forward(self, x: Tensor) -> Tensor:
        linear, rms_norm = OPS[self.impl]
        return x + linear(torch.relu(linear(rms_norm(x, self.norm), self.w1)), self.w2)


def build_blocks(impl: str) -> nn.ModuleList:
    gen = torch.Generator().manual_seed(0)
    return nn.ModuleList(Block(impl, gen) for _ in range(BLOCKS))


def batch(device: torch.device) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, DIM, generator=gen, dtype=DTYPE)
    return x.to(device), torch.tanh(x.flip(-1)).to(device)


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return ((output - target) ** 2).mean()


def reference(
    impl: str, device: torch.device, counter: FlopCounter | None = None
) -> dict[str, Tensor]:
    """Gradients of one step on one process, microbatched as the schedules do it."""
    blocks = build_blocks(impl).to(device)
    x, target = batch(device)
    with counter if counter is not None else contextlib.nullcontext():
        loss = sum(
            loss_fn(nn.Sequential(*blocks)(xm), tm)
            for xm, tm in zip(x.chunk(MICROBATCHES), target.chunk(MICROBATCHES))
        )
        (loss / MICROBATCHES).backward()  # type: ignore[operator]
    return {f"{i}.{n}": p.grad for i, b in enumerate(blocks) for n, p in b.named_parameters()}  # type: ignore[misc]


@dataclass(frozen=True)
class Case:
    schedule: str
    impl: str  # one of IMPLS
    stage: str  # one of STAGE_KINDS

    @property
    def id(self) -> str:
        return f"{self.schedule.removeprefix('Schedule')}-{self.impl}-{self.stage}"


@dataclass
class Outcome:
    mismatch: str  # empty when every gradient equals the reference's
    flops: dict[str, int]  # action kind -> FLOPs, all ranks
    actions: dict[str, int]  # action kind -> count, all ranks
    timeline: cgp.StepTimeline


def _stage_indices(schedule: str, rank: int, world: int) -> list[int]:
    if schedule in V_SHAPED:  # rank r holds stages r and 2 * world - 1 - r
        return sorted({rank, 2 * world - 1 - rank})
    return [rank, rank + world]  # looped: stage s on rank s % world


def _stages(
    case: Case, timer: cgp.ActionTimer, submods: dict[int, nn.Module], device: torch.device
) -> list[Any]:
    n = 2 * dist.get_world_size()
    if case.stage == "torch":
        cls = timer.stage_class(pipelining.PipelineStage)
        return [cls(m, s, n, device) for s, m in submods.items()]
    queue = cgp.WeightGradQueue()
    if case.stage == "queue":  # torch's stage, the queue as its dw_builder
        cls = timer.stage_class(pipelining.PipelineStage)
        for s, m in submods.items():
            queue.attach(m, s)
        return [
            cls(m, s, n, device, dw_builder=functools.partial(queue.dw_builder, s))
            for s, m in submods.items()
        ]
    cls = timer.stage_class(cgp.PipelineStage)
    queue_or_none = queue if case.stage == "customgrad+queue" else None
    return [cls(m, s, n, device, queue=queue_or_none) for s, m in submods.items()]


def run_case(case: Case, device: torch.device) -> Outcome:
    """One step of ``case`` on this rank; every rank returns the same merged outcome."""
    rank, world = dist.get_rank(), dist.get_world_size()
    blocks = build_blocks(case.impl).to(device)
    mine = _stage_indices(case.schedule, rank, world)
    per = BLOCKS // (2 * world)
    submods = {s: nn.Sequential(*blocks[s * per : (s + 1) * per]) for s in mine}
    timer = cgp.ActionTimer(device)
    stages = _stages(case, timer, submods, device)
    schedule = getattr(pipelining, case.schedule)(stages, MICROBATCHES, loss_fn=loss_fn)
    x, target = batch(device)
    kwargs = {"target": target} if 2 * world - 1 in mine else {}
    with timer.step(count_flops=True):
        schedule.step(*([x] if 0 in mine else []), **kwargs)
    problems = grad_problems(rank, mine, per, blocks, reference(case.impl, device))
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, problems)
    (timeline,) = timer.gather()
    actions = [a for r in timeline.ranks for a in r.actions]
    return Outcome(
        mismatch="\n".join(p for ps in everyone for p in ps),
        flops={k: sum(a.flops or 0 for a in actions if a.kind == k) for k in "FIWB"},
        actions={k: sum(a.kind == k for a in actions) for k in "FIWB"},
        timeline=timeline,
    )


def run_cases(cases: list[Case], out_path: str, device: str = "cpu") -> None:
    """Every case on one process group; rank 0 pickles the outcomes to ``out_path``.

    ``device``: "cpu", or "cuda" for this rank's GPU (the group is then NCCL's)."""
    dev = (
        torch.device("cuda", torch.cuda.current_device())
        if device == "cuda"
        else torch.device("cpu")
    )
    outcomes = {case: run_case(case, dev) for case in cases}
    if dist.get_rank() == 0:
        Path(out_path).write_bytes(pickle.dumps(outcomes))


def reference_step_flops() -> int:
    """FLOPs of one single-process forward + full backward of the whole batch."""
    counter = FlopCounter()
    reference("customgrad", torch.device("cpu"), counter)
    return counter.total


# --- launching: torch.multiprocessing, bounded, every process stopped -------------------------


def _entry(
    rank: int, port: int, world: int, backend: str, fn: Callable[..., None], args: tuple[Any, ...]
) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        fn(*args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(
    fn: Callable[..., None],
    args: tuple[Any, ...],
    world: int = 2,
    timeout: float = 180,
    backend: str = "gloo",
) -> None:
    """Run ``fn(*args)`` on ``world`` local processes in one group, at most ``timeout`` s.

    A failure in any process raises (``torch.multiprocessing`` stops the others); so does the
    timeout. Either way, every process is gone when this returns or raises.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a process raised.
        TimeoutError: still running after ``timeout`` seconds.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(
        _entry,
        args=(port, world, backend, fn, args),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"still running after {timeout:g} s; stopped the processes")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(10)


def fail_on_rank(failing_rank: int, pid_dir: str) -> None:
    """Record this process's pid; one rank raises, the others would sleep for an hour."""
    Path(pid_dir, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    dist.barrier()  # every pid is written
    if dist.get_rank() == failing_rank:
        raise ValueError("deliberate failure")
    time.sleep(3600)


def hang(pid_dir: str) -> None:
    Path(pid_dir, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    time.sleep(3600)


def grad_problems(
    rank: int, mine: list[int], per: int, blocks: Any, want: dict[str, torch.Tensor]
) -> list[str]:
    """Each parameter of this rank's stages whose gradient differs from one process's."""
    problems = []
    for s in mine:
        for i in range(s * per, (s + 1) * per):
            for name, p in blocks[i].named_parameters():
                w = want[f"{i}.{name}"]
                if p.grad is None or not torch.allclose(p.grad, w, rtol=1e-9, atol=1e-12):
                    err = "none" if p.grad is None else f"{(p.grad - w).abs().max().item():.3g}"
                    problems.append(f"rank {rank}: {i}.{name}: max abs difference {err}")
    return problems
