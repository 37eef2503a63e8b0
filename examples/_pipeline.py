"""Shared pieces of the zero-bubble demo, its multi-process tests and its benchmark.

One small model (pre-norm MLP blocks), written twice: with customgrad ops and with plain
``torch.autograd.Function`` ops. Helpers build torch pipeline stages for a schedule, time
each F / I / W / B action of a stage (by subclassing the stage, no monkeypatching), count
FLOPs per action, and launch local processes that are always cleaned up.

Everything here is device-agnostic: ``cuda:<local rank>`` with NCCL when every local rank
has its own GPU, else CPU with gloo.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import functools
import math
import multiprocessing.connection
import multiprocessing.process
import os
import signal
import socket
import sys
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, register_flop_formula

import customgrad as cg

# --------------------------------------------------------------------------------------
# Schedules
# --------------------------------------------------------------------------------------

SCHEDULES: dict[str, type] = {  # those this torch has (DualPipeV is recent)
    name: getattr(pipelining, name)
    for name in (
        "ScheduleZBVZeroBubble",
        "ScheduleInterleavedZeroBubble",
        "ScheduleDualPipeV",
        "Schedule1F1B",
        "ScheduleInterleaved1F1B",
    )
    if hasattr(pipelining, name)
}
ZERO_BUBBLE = tuple(
    s
    for s in ("ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble", "ScheduleDualPipeV")
    if s in SCHEDULES
)
_V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
_SINGLE_STAGE = ("Schedule1F1B",)


def stages_of_rank(schedule: str, rank: int, world: int) -> list[int]:
    """The global stage indices that ``rank`` runs under ``schedule`` (in stage order)."""
    if schedule in _SINGLE_STAGE:
        return [rank]
    if schedule in _V_SHAPED:  # rank r holds stages r and 2 * world - 1 - r
        return [rank, 2 * world - 1 - rank]
    return [rank, rank + world]  # looped: stage s on rank s % world


def num_stages(schedule: str, world: int) -> int:
    return world if schedule in _SINGLE_STAGE else 2 * world


# --------------------------------------------------------------------------------------
# The ops: customgrad and plain autograd.Function, same maths
# --------------------------------------------------------------------------------------

EPS = 1e-6


@cg.op("zbdemo::linear", weights=("weight", "bias"))
def cg_linear(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    return torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight.mT).reshape(
        *x.shape[:-1], weight.shape[0]
    )


@cg_linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@cg_linear.register_save_for_backward
def _(inputs: Any, output: Tensor) -> Any:
    return inputs.x, inputs.weight


@cg_linear.register_backward_input
def _(ctx: Any, saved: Any, grad: Tensor) -> dict[str, Tensor]:
    _, weight = saved
    return {"x": grad @ weight}


@cg_linear.register_backward_weight
def _(ctx: Any, saved: Any, grad: Tensor) -> dict[str, Tensor | None]:
    x, _ = saved
    g, xs = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    return {
        "weight": g.mT @ xs if ctx.needs_input_grad("weight") else None,
        "bias": g.sum(0) if ctx.needs_input_grad("bias") else None,
    }


@register_flop_formula(torch.ops.zbdemo.linear)
def _linear_flops(x_shape: Any, w_shape: Any, *args: Any, **kwargs: Any) -> int:
    # A custom op is opaque to a dispatch-mode FLOP counter: say what its forward costs.
    return 2 * math.prod(x_shape[:-1]) * x_shape[-1] * w_shape[0]


@cg.op("zbdemo::rms_norm", weights=("weight",))
def cg_rms_norm(x: Tensor, weight: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


@cg_rms_norm.register_fake
def _(x: Tensor, weight: Tensor) -> Tensor:
    return torch.empty_like(x)


@cg_rms_norm.register_save_for_backward
def _(inputs: Any, output: Tensor) -> Any:
    x = inputs.x
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return x * rstd, rstd, inputs.weight


@cg_rms_norm.register_backward_input
def _(ctx: Any, saved: Any, grad: Tensor) -> dict[str, Tensor]:
    xhat, rstd, weight = saved
    gw = grad * weight
    return {"x": rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))}


@cg_rms_norm.register_backward_weight
def _(ctx: Any, saved: Any, grad: Tensor) -> dict[str, Tensor]:
    xhat, _, _ = saved
    return {"weight": (grad * xhat).reshape(-1, xhat.shape[-1]).sum(0)}


class FnLinear(torch.autograd.Function):
    """The same linear as a plain ``autograd.Function``: its backward does both halves."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        out = torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight.mT)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        g, xs = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        need_x, need_w, need_b = ctx.needs_input_grad  # fixed at forward time
        return (
            grad @ weight if need_x else None,
            g.mT @ xs if need_w else None,
            g.sum(0) if need_b else None,
        )


class FnRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor) -> Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
        ctx.save_for_backward(x * rstd, rstd, weight)
        return x * rstd * weight

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        xhat, rstd, weight = ctx.saved_tensors
        gw = grad * weight
        gx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
        return gx, (grad * xhat).reshape(-1, xhat.shape[-1]).sum(0)


@dataclass(frozen=True)
class Ops:
    name: str
    linear: Callable[[Tensor, Tensor, Tensor], Tensor]
    rms_norm: Callable[[Tensor, Tensor], Tensor]


IMPLS = {
    "customgrad": Ops("customgrad", cg_linear, cg_rms_norm),
    "function": Ops("autograd.Function", FnLinear.apply, FnRMSNorm.apply),
}


# --------------------------------------------------------------------------------------
# The model: pre-norm residual MLP blocks; one or more blocks per pipeline stage
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    dim: int = 256
    hidden: int = 1024
    blocks: int = 4  # total; split evenly over the stages
    batch: int = 256  # rows per step, split into microbatches
    microbatches: int = 8
    dtype: torch.dtype = torch.float32


class Block(nn.Module):
    """``x + fc2(relu(fc1(rms_norm(x))))`` with customgrad or plain-Function ops."""

    def __init__(self, dim: int, hidden: int, impl: str, generator: torch.Generator) -> None:
        super().__init__()
        self.impl = impl

        def param(*shape: int, scale: float) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=generator) * scale)

        self.norm = param(dim, scale=0.1)
        with torch.no_grad():
            self.norm += 1.0
        self.w1, self.b1 = param(hidden, dim, scale=dim**-0.5), param(hidden, scale=0.02)
        self.w2, self.b2 = param(dim, hidden, scale=hidden**-0.5), param(dim, scale=0.02)

    def forward(self, x: Tensor) -> Tensor:
        ops = IMPLS[self.impl]
        h = ops.linear(ops.rms_norm(x, self.norm), self.w1, self.b1)
        return x + ops.linear(torch.relu(h), self.w2, self.b2)


def build_blocks(cfg: ModelConfig, impl: str, seed: int = 0) -> nn.ModuleList:
    """All blocks of the model, deterministically initialised from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    blocks = nn.ModuleList(Block(cfg.dim, cfg.hidden, impl, gen) for _ in range(cfg.blocks))
    return blocks.to(cfg.dtype)


def stage_blocks(cfg: ModelConfig, stage: int, n_stages: int) -> range:
    if cfg.blocks % n_stages:
        raise ValueError(f"{cfg.blocks} blocks do not split evenly over {n_stages} stages")
    per = cfg.blocks // n_stages
    return range(stage * per, (stage + 1) * per)


def make_batch(cfg: ModelConfig, step: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Step ``step``'s inputs, and targets from a fixed random map the model can learn."""
    mix = torch.randn(cfg.dim, cfg.dim, generator=torch.Generator().manual_seed(7)) / cfg.dim**0.5
    x = torch.randn(cfg.batch, cfg.dim, generator=torch.Generator().manual_seed(1000 + step))
    target = torch.tanh(x @ mix)
    return x.to(device, cfg.dtype), target.to(device, cfg.dtype)


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return torch.nn.functional.mse_loss(output, target)


def reference_grads(
    cfg: ModelConfig,
    impl: str,
    step: int,
    device: torch.device,
    flop_counter: TorchDispatchMode | None = None,
) -> dict[str, Tensor]:
    """Gradients of one step on one process, microbatched like the schedules do it.

    The schedules call ``loss_fn`` per microbatch and (``scale_grads=True``) divide the
    summed gradients by the number of microbatches: the mean of the microbatch losses.
    ``flop_counter``, when given, is entered around the forward and backward.
    """
    blocks = build_blocks(cfg, impl).to(device)
    x, target = make_batch(cfg, step, device)
    with flop_counter or contextlib.nullcontext():
        loss = torch.zeros((), device=device, dtype=cfg.dtype)
        for xm, tm in zip(x.tensor_split(cfg.microbatches), target.tensor_split(cfg.microbatches)):
            h = xm
            for block in blocks:
                h = block(h)
            loss = loss + loss_fn(h, tm)
        (loss / cfg.microbatches).backward()
    return {name: p.grad for name, p in blocks.named_parameters() if p.grad is not None}


# --------------------------------------------------------------------------------------
# FLOPs and timing of each action
# --------------------------------------------------------------------------------------


class FlopCounter(TorchDispatchMode):
    """Adds up FLOPs with torch's formulas (``torch.utils.flop_counter``).

    Unlike ``FlopCounterMode`` it tracks no modules, so it can be entered around any
    single pipeline action. Ops without a formula count zero.
    """

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(getattr(func, "_overloadpacket", None))
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out


@dataclass
class Event:
    kind: str  # "F", "I", "W" or "B" (full backward)
    stage: int
    microbatch: int
    start: float  # seconds since the step's start on this rank
    end: float


@dataclass
class Recorder:
    """What the timed stages of one rank measured. Shared by the rank's stages."""

    device: torch.device
    count_flops: bool = False
    events: list[Event] = field(default_factory=list)
    flops: Counter[str] = field(default_factory=Counter)
    t0: float = 0.0

    def start_step(self, count_flops: bool = False) -> None:
        self.events.clear()
        self.flops.clear()
        self.count_flops = count_flops
        self.sync()
        self.t0 = time.perf_counter()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def action(self, kind: str, stage: int, microbatch: int) -> Iterator[None]:
        self.sync()
        start = time.perf_counter()
        if self.count_flops:
            counter = FlopCounter()
            with counter:
                yield
            self.flops[kind] += counter.total
        else:
            yield
        self.sync()
        self.events.append(
            Event(kind, stage, microbatch, start - self.t0, time.perf_counter() - self.t0)
        )


class TimedStageMixin:
    """Put in front of a pipeline stage class to time (and count FLOPs of) every action.

    ``class TimedStage(TimedStageMixin, PipelineStage)`` overrides the three methods the
    schedules call per microbatch; everything else is the stage's own behaviour.
    """

    recorder: Recorder
    stage_index: int

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with self.recorder.action("F", self.stage_index, fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)  # type: ignore[misc]

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, **kwargs: Any
    ) -> Any:
        kind = "B" if full_backward else "I"
        with self.recorder.action(kind, self.stage_index, bwd_chunk_id):
            return super().backward_one_chunk(  # type: ignore[misc]
                bwd_chunk_id, loss=loss, full_backward=full_backward, **kwargs
            )

    def backward_weight_one_chunk(self, bwd_chunk_id: int, **kwargs: Any) -> Any:
        with self.recorder.action("W", self.stage_index, bwd_chunk_id):
            return super().backward_weight_one_chunk(bwd_chunk_id, **kwargs)  # type: ignore[misc]


_TIMED: dict[type, type] = {}


def timed(stage_cls: type) -> type:
    """``stage_cls`` with every action timed (see :class:`TimedStageMixin`)."""
    if stage_cls not in _TIMED:
        _TIMED[stage_cls] = type(f"Timed{stage_cls.__name__}", (TimedStageMixin, stage_cls), {})
    return _TIMED[stage_cls]


# --------------------------------------------------------------------------------------
# Stages and schedules
# --------------------------------------------------------------------------------------

STAGE_KINDS = ("customgrad", "torch", "queue", "customgrad+queue")
STAGE_HELP = """\
customgrad: customgrad.pipelining.PipelineStage (torch's stage, customgrad's split backward);
torch: torch's own PipelineStage (torch's split, which calls each customgrad op half per phase);
queue: torch's PipelineStage with a customgrad WeightGradQueue as dw_builder;
customgrad+queue: customgrad's PipelineStage(queue=WeightGradQueue())"""


def make_stages(
    kind: str,
    submods: dict[int, nn.Module],
    n_stages: int,
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> tuple[list[Any], Any]:
    """Timed pipeline stages of ``kind`` (see :data:`STAGE_HELP`) and their queue, if any."""
    if kind not in STAGE_KINDS:
        raise ValueError(f"unknown stage kind {kind!r}; expected one of {STAGE_KINDS}")
    if kind == "torch":
        cls = timed(PipelineStage)
        return [cls(m, s, n_stages, device, group=group) for s, m in submods.items()], None
    import customgrad.pipelining as cgp

    queue = cgp.WeightGradQueue() if "queue" in kind else None
    if kind == "queue":
        cls, stages = timed(PipelineStage), []
        for s, m in submods.items():
            queue.attach(m, s)  # tags each forward with (stage, microbatch)
            builder = functools.partial(queue.dw_builder, s)
            stages.append(cls(m, s, n_stages, device, group=group, dw_builder=builder))
        return stages, queue
    cls = timed(cgp.PipelineStage)
    return [
        cls(m, s, n_stages, device, group=group, queue=queue) for s, m in submods.items()
    ], queue


@dataclass
class Pipeline:
    schedule: Any
    stages: list[Any]
    modules: dict[int, nn.Module]  # global block index -> block
    recorder: Recorder
    has_first: bool
    has_last: bool
    queue: Any = None  # a customgrad WeightGradQueue used as dw_builder, if any

    def step(self, x: Tensor, target: Tensor) -> list[Tensor]:
        losses: list[Tensor] = []
        args = (x,) if self.has_first else ()
        kwargs = {"target": target, "losses": losses} if self.has_last else {}
        self.schedule.step(*args, **kwargs)
        if self.queue is not None:
            self.queue.finish()  # every W ran; number the next step's microbatches from 0
        return losses

    def named_grads(self) -> dict[str, Tensor]:
        return {
            f"{i}.{name}": p.grad
            for i, block in self.modules.items()
            for name, p in block.named_parameters()
            if p.grad is not None
        }

    def parameters(self) -> list[nn.Parameter]:
        return [p for block in self.modules.values() for p in block.parameters()]


def build_pipeline(
    cfg: ModelConfig,
    schedule: str,
    impl: str,
    stage_kind: str,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> Pipeline:
    """This rank's stages of the model under ``schedule``, with timed stages."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    n_stages = num_stages(schedule, world)
    blocks = build_blocks(cfg, impl).to(device)
    submods, modules = {}, {}
    for s in stages_of_rank(schedule, rank, world):
        idx = stage_blocks(cfg, s, n_stages)
        submods[s] = nn.Sequential(*(blocks[i] for i in idx))
        modules.update({i: blocks[i] for i in idx})
    stages, queue = make_stages(stage_kind, submods, n_stages, device, group)
    recorder = Recorder(device)
    for stage in stages:
        stage.recorder = recorder
    cls = SCHEDULES[schedule]
    if schedule in _SINGLE_STAGE:
        sched = cls(stages[0], cfg.microbatches, loss_fn=loss_fn)
    else:
        sched = cls(stages, cfg.microbatches, loss_fn=loss_fn)
    return Pipeline(sched, stages, modules, recorder, 0 in submods, n_stages - 1 in submods, queue)


def expected_backward_flops(
    cfg: ModelConfig, schedule: str, impl: str, device: torch.device
) -> dict[int, int]:
    """FLOPs of one plain full backward of each of this rank's stages, times the microbatches.

    Runs on a fresh copy of the stages, so nothing touches the pipeline's (or its queue's)
    state.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    n_stages = num_stages(schedule, world)
    blocks = build_blocks(cfg, impl).to(device)
    out = {}
    for s in stages_of_rank(schedule, rank, world):
        submod = nn.Sequential(*(blocks[i] for i in stage_blocks(cfg, s, n_stages)))
        x = torch.randn(cfg.batch // cfg.microbatches, cfg.dim, device=device, dtype=cfg.dtype)
        y = submod(x.requires_grad_(s != 0))
        counter = FlopCounter()
        with counter:
            torch.autograd.backward(y, torch.ones_like(y))
        out[s] = counter.total * cfg.microbatches
    return out


def compare_grads(got: dict[str, Tensor], want: dict[str, Tensor], rtol: float, atol: float) -> str:
    """Empty when ``got`` matches ``want`` on ``got``'s keys, else a readable report."""
    problems = []
    for name, g in got.items():
        w = want.get(name)
        if w is None:
            problems.append(f"{name}: no reference gradient")
        elif not torch.allclose(g.cpu(), w.cpu(), rtol=rtol, atol=atol):
            err = (g.cpu() - w.cpu()).abs().max().item()
            problems.append(f"{name}: max abs difference {err:.3g} (rtol={rtol}, atol={atol})")
    return "\n".join(problems)


# --------------------------------------------------------------------------------------
# Launching: torchrun or local spawn, always cleaned up
# --------------------------------------------------------------------------------------


def pick_device(local_rank: int, local_world: int, want: str = "auto") -> tuple[torch.device, str]:
    """(device, backend): a GPU each with NCCL when there are enough, else CPU with gloo."""
    if want == "cuda" or (
        want == "auto" and torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    ):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def default_nproc(want_device: str) -> int:
    """2 local processes; with ``--device cuda`` as many as there are GPUs, at most 2."""
    if want_device == "cuda" and torch.cuda.is_available():
        return max(1, min(2, torch.cuda.device_count()))
    return 2


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(
    rank: int,
    world: int,
    port: int,
    want_device: str,
    worker: Callable[..., None],
    args: tuple,
    failures: Any,
    parent: int,
) -> None:
    _die_with_parent(parent)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    reported = []

    def report(e: BaseException) -> None:
        # Tell the parent when and why, at once (before leaving the process group), so it
        # can name the rank that failed first: the others then fail on a closed connection.
        if not reported and not isinstance(e, KeyboardInterrupt):
            failures.put((time.time(), rank, f"{type(e).__name__}: {e}".splitlines()[0]))
            reported.append(e)

    try:
        run_worker(worker, args, want_device, on_error=report)
    except KeyboardInterrupt:
        sys.exit(130)
    except BaseException as e:
        report(e)
        if isinstance(e, UserError):
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:
            traceback.print_exc()
            sys.stderr.flush()
        sys.exit(2 if isinstance(e, UserError) else 1)


PR_SET_PDEATHSIG = 1  # from <sys/prctl.h>


def _die_with_parent(parent: int) -> None:
    """Have Linux kill this process when its parent dies, even by SIGKILL (no orphans)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl
        os._exit(1)


def run_worker(
    worker: Callable[..., None],
    args: tuple,
    want_device: str = "auto",
    on_error: Callable[[BaseException], None] | None = None,
) -> None:
    """Join the process group from the environment, call ``worker(device, *args)``, leave.

    The process group comes from torchrun's variables (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ...), set by :func:`spawn` for local runs.
    """
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device, backend = pick_device(local_rank, local_world, want_device)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group(
        backend,
        timeout=datetime.timedelta(seconds=120),
        device_id=device if device.type == "cuda" else None,
    )
    try:
        worker(device, *args)
        dist.barrier()
    except BaseException as e:
        if on_error is not None:
            on_error(e)
        raise
    finally:
        dist.destroy_process_group()


class UserError(RuntimeError):
    """A failure a worker explains in its message: printed without a traceback."""


class WorkerFailed(RuntimeError):
    """A spawned worker failed or timed out; the others were stopped."""


def spawn(
    worker: Callable[..., None],
    args: tuple = (),
    world: int = 2,
    timeout: float = 300.0,
    device: str = "auto",
) -> None:
    """Run ``worker(device, *args)`` on ``world`` local processes; raise if any fails.

    Waits at most ``timeout`` seconds; on a failure, a timeout or Ctrl-C every process
    still alive is terminated, then killed, and all are joined before returning.

    Raises:
        WorkerFailed: naming the rank that failed first and its error.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    failures = ctx.SimpleQueue()
    procs = [
        ctx.Process(
            target=_child,
            args=(r, world, port, device, worker, args, failures, os.getpid()),
            daemon=True,
        )
        for r in range(world)
    ]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.exitcode for p in procs]
            if any(c not in (None, 0) for c in codes):
                raise WorkerFailed(_first_failure(codes, failures))
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                raise WorkerFailed(f"workers still running after {timeout:.0f}s; stopped them")
            alive = [p.sentinel for p in procs if p.exitcode is None]
            multiprocessing.connection.wait(alive, 0.5)
    finally:
        _stop(procs)
        failures.close()


def add_launch_args(parser: argparse.ArgumentParser, timeout: float = 300.0) -> None:
    """Add the options :func:`launch` reads: ``--nproc``, ``--device`` and ``--timeout``."""
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local processes to spawn (default 2; with --device cuda, one per GPU up to 2)",
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds before giving up")


def launch(worker: Callable[..., None], args: argparse.Namespace) -> int:
    """A script's ``main``: run ``worker(device, args)`` under torchrun or on local processes.

    ``args``: parsed command-line options, with those of :func:`add_launch_args`. Returns
    the exit status: 0, 1 if a worker failed (reported on stderr), 130 on Ctrl-C.
    """
    try:
        if launched_by_torchrun():
            run_worker(worker, (args,), args.device)
        else:
            spawn(
                worker,
                (args,),
                world=args.nproc or default_nproc(args.device),
                timeout=args.timeout,
                device=args.device,
            )
    except WorkerFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; workers stopped", file=sys.stderr)
        return 130
    return 0


def _first_failure(codes: list[int | None], failures: Any) -> str:
    reports = []
    while not failures.empty():
        reports.append(failures.get())
    if reports:
        _, rank, what = min(reports)
        return f"rank {rank} failed first: {what.rstrip(':')} (details above); stopped the others"
    rank, code = next((r, c) for r, c in enumerate(codes) if c not in (None, 0))
    how = f"signal {-code}" if code < 0 else f"exit code {code}"
    return f"rank {rank} died ({how}); stopped the others"


def _stop(procs: list[multiprocessing.process.BaseProcess]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive() and p.pid is not None:
            os.kill(p.pid, signal.SIGKILL)
            p.join(5)


def gather_to_rank0(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (None elsewhere)."""
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def summarize(events: Sequence[Event]) -> dict[str, tuple[int, float]]:
    """Per kind: (count, total seconds)."""
    acc: dict[str, list[float]] = defaultdict(list)
    for e in events:
        acc[e.kind].append(e.end - e.start)
    return {k: (len(v), sum(v)) for k, v in acc.items()}
