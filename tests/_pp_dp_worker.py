"""Workers for ``tests/test_pp_dp.py``: pipeline x data parallel on 4 processes.

2 pipeline ranks x 2 data-parallel ranks on a 2-D ``DeviceMesh`` ("dp", "pp"), every stage's
module wrapped in DDP or FSDP2 (``fully_shard``) over its "dp" group and given to
``customgrad.pipelining.PipelineStage`` (plain split, or ``queue=WeightGradQueue()``), run
through torch's zero-bubble schedules. Each case runs one step and records, per rank:

- each weight's gradient against a single-process float64 reference over the whole batch;
- every gradient reduction (a DDP comm hook per bucket, an FSDP2 all-reduce hook per parameter
  group, called after its reduce-scatter), with how many backward actions of the stage had
  run and how often each of its weights had accumulated by then;
- every tensor hook and post-accumulate-grad hook firing on the weights, with the action
  (kind, stage, microbatch) it fired in.

The model is defined here (customgrad ops under the ``pp_dp`` namespace), not taken from
``examples/``. This module is importable by name so that spawned processes can unpickle it.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import math
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.multiprocessing.spawn import ProcessException

import customgrad as cg
from customgrad.pipelining import PipelineStage, PipeliningError, WeightGradQueue
from tests.conftest import linear_op

# --------------------------------------------------------------------------------------
# The model: customgrad ops only, float64
# --------------------------------------------------------------------------------------


linear = linear_op("pp_dp::linear", bias=True)  # x @ weight.mT + bias, the pair backward


@cg.op("pp_dp::tanh")
def tanh(x: Tensor) -> Tensor:
    return torch.tanh(x)


@tanh.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x)


@tanh.register_save_for_backward
def _(inputs: Any, output: Tensor) -> Any:
    return output


@tanh.register_backward
def _(ctx: cg.BackwardContext, saved: Tensor, grad: Tensor) -> dict[str, Tensor]:
    return {"x": grad * (1 - saved * saved)}


DIM = 8
BATCH = 16  # whole batch; each data-parallel rank takes half
MICROBATCHES = 4
DTYPE = torch.float64


class Block(nn.Module):
    """``x + linear(tanh(linear(x)))``: one pipeline stage.

    With ``native=True`` the hidden activations are also scaled by a weight ``gain`` through a
    native multiplication (a weight outside customgrad ops, as a norm layer's would be).
    """

    def __init__(self, seed: int, native: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=g, dtype=DTYPE) / math.sqrt(DIM))

        self.w1, self.b1 = param(2 * DIM, DIM), param(2 * DIM)
        self.w2, self.b2 = param(DIM, 2 * DIM), param(DIM)
        self.gain = param(2 * DIM) if native else None

    def forward(self, x: Tensor) -> Tensor:
        h = tanh(linear(x, self.w1, self.b1))
        if self.gain is not None:
            h = h * self.gain
        return x + linear(h, self.w2, self.b2)


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return ((output - target) ** 2).mean()


def make_batch(device: torch.device) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(BATCH, DIM, generator=g, dtype=DTYPE)
    t = torch.randn(BATCH, DIM, generator=g, dtype=DTYPE)
    return x.to(device), t.to(device)


def reference_grads(
    n_stages: int, native: tuple[int, ...], device: torch.device
) -> dict[str, Tensor]:
    """Gradients of one process running the whole batch through every stage (mean loss)."""
    blocks = [Block(seed=s, native=s in native).to(device) for s in range(n_stages)]
    x, t = make_batch(device)
    for b in blocks:
        x = b(x)
    loss_fn(x, t).backward()
    return {f"{s}.{n}": p.grad for s, b in enumerate(blocks) for n, p in b.named_parameters()}


# --------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------

SCHEDULES = tuple(
    s
    for s in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV", "ScheduleInterleavedZeroBubble")
    if hasattr(pipelining, s)
)
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
DP_KINDS = ("ddp", "fsdp")
STAGE_KINDS = ("split", "queue")  # customgrad's PipelineStage, without and with queue=
PP = 2
DP = 2


@dataclass(frozen=True)
class Case:
    schedule: str
    dp: str  # "ddp" or "fsdp"
    stage: str  # "split" or "queue"
    native: tuple[int, ...] = ()  # stages whose block also has a native weight
    find_unused: tuple[int, ...] = ()  # stages whose DDP has find_unused_parameters=True

    @property
    def id(self) -> str:
        extra = "".join(
            f"-{what}{''.join(map(str, stages))}"
            for what, stages in (("native", self.native), ("find_unused", self.find_unused))
            if stages
        )
        return f"{self.schedule.removeprefix('Schedule')}-{self.dp}-{self.stage}{extra}"


@dataclass
class Reduction:
    stage: int
    params: tuple[str, ...]  # weight names ("<stage>.<name>") of the bucket / param group
    backwards_started: int  # backward actions (B or W) of the stage started by then
    accumulations: dict[str, int]  # post-accumulate-grad hook firings of each weight by then


@dataclass(frozen=True)
class HookCall:
    weight: str  # "<stage>.<name>"
    hook: str  # "tensor" or "post" (post-accumulate-grad)
    action: str  # the action it fired in: "F", "I", "W", "B", or "outside"
    stage: int  # the action's stage (-1 outside any)
    microbatch: int


@dataclass
class Step:
    """What one rank saw in one step of one case."""

    grad_mismatch: list[str] = field(default_factory=list)
    reductions: list[Reduction] = field(default_factory=list)
    hook_calls: list[HookCall] = field(default_factory=list)
    error: str = ""  # a customgrad PipeliningError the step raised, if any


@dataclass
class Outcome:
    stages: list[int]
    weights: list[str]  # "<stage>.<name>" of this rank's stages
    steps: list[Step]


def stages_of(schedule: str, pp_rank: int) -> list[int]:
    if schedule in V_SHAPED:
        return [pp_rank, 2 * PP - 1 - pp_rank]
    return [pp_rank, pp_rank + PP]


class Recorder:
    """What one rank sees during a step: the running action, hooks, reductions."""

    def __init__(self) -> None:
        self.step = Step()
        self.action: tuple[str, int, int] | None = None  # (kind, stage, microbatch)
        self.backwards: dict[int, int] = {}  # stage -> B/W actions started
        self.post_counts: dict[str, int] = {}

    def new_step(self) -> Step:
        self.step, self.backwards, self.post_counts = Step(), {}, {}
        return self.step

    @contextlib.contextmanager
    def running(self, kind: str, stage: int, mb: int) -> Iterator[None]:
        if kind in ("B", "W"):
            self.backwards[stage] = self.backwards.get(stage, 0) + 1
        self.action = (kind, stage, mb)
        try:
            yield
        finally:
            self.action = None

    def hooked(self, name: str, hook: str) -> None:
        kind, stage, mb = self.action if self.action is not None else ("outside", -1, -1)
        self.step.hook_calls.append(HookCall(name, hook, kind, stage, mb))
        if hook == "post":
            self.post_counts[name] = self.post_counts.get(name, 0) + 1

    def reduced(self, stage: int, params: tuple[str, ...]) -> None:
        self.step.reductions.append(
            Reduction(
                stage=stage,
                params=params,
                backwards_started=self.backwards.get(stage, 0),
                accumulations={p: self.post_counts.get(p, 0) for p in params},
            )
        )


class RecordingStage(PipelineStage):
    """customgrad's stage, telling the recorder which action runs."""

    recorder: Recorder

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with self.recorder.running("F", self.stage_index, fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, **kwargs: Any
    ) -> Any:
        kind = "B" if full_backward else "I"
        with self.recorder.running(kind, self.stage_index, bwd_chunk_id):
            return super().backward_one_chunk(
                bwd_chunk_id, loss=loss, full_backward=full_backward, **kwargs
            )

    def backward_weight_one_chunk(self, bwd_chunk_id: int, **kwargs: Any) -> Any:
        with self.recorder.running("W", self.stage_index, bwd_chunk_id):
            return super().backward_weight_one_chunk(bwd_chunk_id, **kwargs)


def _hook_weights(rec: Recorder, stage: int, params: dict[str, nn.Parameter]) -> None:
    for name, p in params.items():
        full = f"{stage}.{name}"

        def tensor_hook(g: Tensor, full: str = full) -> None:
            rec.hooked(full, "tensor")

        def post_hook(p: Tensor, full: str = full) -> None:
            rec.hooked(full, "post")

        p.register_hook(tensor_hook)
        p.register_post_accumulate_grad_hook(post_hook)


def _wrap_ddp(
    block: Block, stage: int, rec: Recorder, dp_group: dist.ProcessGroup, find_unused: bool
) -> nn.Module:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    _hook_weights(rec, stage, dict(block.named_parameters()))
    ddp = DistributedDataParallel(block, process_group=dp_group, find_unused_parameters=find_unused)
    names = {id(p): f"{stage}.{n}" for n, p in block.named_parameters()}

    # No annotations: DDP checks them against dist.GradBucket, and this module's are strings.
    def comm_hook(state, bucket):  # type: ignore[no-untyped-def]
        rec.reduced(stage, tuple(sorted(names[id(p)] for p in bucket.parameters())))
        return allreduce_hook(dp_group, bucket)

    ddp.register_comm_hook(None, comm_hook)
    return ddp


def _wrap_fsdp(block: Block, stage: int, rec: Recorder, dp_mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    fsdp = fully_shard(block, mesh=dp_mesh)
    names = tuple(f"{stage}.{n}" for n, _ in block.named_parameters())
    hooked: set[int] = set()

    def pre_forward(mod: nn.Module, args: Any) -> None:
        # Inside forward (after FSDP's own pre-forward) the module holds the unsharded
        # parameters, the tensors autograd accumulates into: hook those, once each.
        new = {n: p for n, p in mod.named_parameters() if id(p) not in hooked}
        hooked.update(id(p) for p in new.values())
        _hook_weights(rec, stage, new)

    fsdp.register_forward_pre_hook(pre_forward)
    fsdp.set_all_reduce_hook(lambda reduced: rec.reduced(stage, names))
    return fsdp


STEPS = 2  # the first step also runs the stages' metadata inference


def run_case(case: Case, mesh: Any, device: torch.device) -> Outcome:
    rec = Recorder()
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
    n_stages = 2 * PP
    mine = stages_of(case.schedule, pp_rank)
    blocks = {s: Block(seed=s, native=s in case.native).to(device) for s in mine}
    queue = WeightGradQueue() if case.stage == "queue" else None
    stages = []
    for s, block in blocks.items():
        if case.dp == "ddp":
            mod = _wrap_ddp(block, s, rec, dp_group, find_unused=s in case.find_unused)
        else:
            mod = _wrap_fsdp(block, s, rec, mesh["dp"])
        stage = RecordingStage(mod, s, n_stages, device, group=pp_group, queue=queue)
        stage.recorder = rec
        stages.append(stage)
    schedule = getattr(pipelining, case.schedule)(
        stages, n_microbatches=MICROBATCHES, loss_fn=loss_fn
    )
    x, t = make_batch(device)
    half = BATCH // DP
    x, t = x[dp_rank * half : (dp_rank + 1) * half], t[dp_rank * half : (dp_rank + 1) * half]
    args = (x,) if 0 in mine else ()
    kwargs = {"target": t} if n_stages - 1 in mine else {}
    want = reference_grads(n_stages, case.native, device)
    outcome = Outcome(
        stages=mine,
        weights=[f"{s}.{n}" for s, b in blocks.items() for n, _ in b.named_parameters()],
        steps=[],
    )
    for _ in range(STEPS):
        step = rec.new_step()
        for block in blocks.values():
            block.zero_grad(set_to_none=True)
        raised: PipeliningError | None = None
        try:
            schedule.step(*args, **kwargs)
        except PipeliningError as e:
            step.error = f"{type(e).__name__}: {e}"
            # Its traceback keeps the schedule's frames, and in them the works of the sends it
            # posted and had not waited for yet, alive: gloo drops a send whose work is freed
            # before the peer has received it, and the peer would wait for it forever.
            raised = e
        # Every rank stops the case once one of them failed a step (the error case is built
        # to fail in its ranks' last action, after their last send of the step).
        failed = torch.tensor([float(bool(step.error))], device=device)
        dist.all_reduce(failed)
        del raised
        if failed.item():
            outcome.steps.append(step)
            break
        for s, block in blocks.items():
            for n, p in block.named_parameters():
                g = p.grad
                if g is not None and case.dp == "fsdp":
                    g = g.full_tensor()  # type: ignore[attr-defined]
                name = f"{s}.{n}"
                if g is None:
                    step.grad_mismatch.append(f"{name}: no gradient")
                elif not torch.allclose(g, want[name], rtol=1e-10, atol=1e-12):
                    err = (g - want[name]).abs().max().item()
                    step.grad_mismatch.append(f"{name}: max abs difference {err:.3g}")
        outcome.steps.append(step)
    return outcome


# --------------------------------------------------------------------------------------
# Running all cases on one process group
# --------------------------------------------------------------------------------------


def _run_all(rank: int, cases: list[Case], out_path: str, device_type: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    world = PP * DP
    if device_type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    torch.set_num_threads(1)
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
        device_id=device if device.type == "cuda" else None,
    )
    try:
        mesh = init_device_mesh(device_type, (DP, PP), mesh_dim_names=("dp", "pp"))
        outcomes: dict[Case, Outcome] = {}
        for case in cases:
            outcomes[case] = run_case(case, mesh, device)
            dist.barrier()
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(outcomes, gathered, dst=0)
        if gathered is not None:
            Path(out_path).write_bytes(pickle.dumps(gathered))
    finally:
        dist.destroy_process_group()


def _child(rank: int, port: int, *args: Any) -> None:
    if sys.platform.startswith("linux"):  # die with the test process, even on SIGKILL
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        _run_all(rank, *args)
    except BaseException:
        traceback.print_exc()
        raise


class WorkerFailed(RuntimeError):
    """A worker process failed or the run timed out; every worker was stopped."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(
    cases: list[Case], out_path: str, device_type: str = "cpu", timeout: float = 120.0
) -> list[dict[Case, Outcome]]:
    """Run ``cases`` on 4 processes; return each rank's outcomes (index = global rank).

    Raises:
        WorkerFailed: a worker raised (its traceback is on stderr) or ``timeout`` passed; the
            other workers are stopped either way.
    """
    ctx = mp.start_processes(
        _child,
        args=(_free_port(), cases, out_path, device_type),
        nprocs=PP * DP,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise WorkerFailed(f"pipeline x data parallel run still going after {timeout:.0f}s")
    except ProcessException as e:
        raise WorkerFailed(f"a worker failed: {e}") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        for p in ctx.processes:
            p.join(5)
    result: list[dict[Case, Outcome]] = pickle.loads(Path(out_path).read_bytes())
    return result
