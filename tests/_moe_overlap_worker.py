"""Worker for ``tests/test_moe_overlap.py``: weight work hides the expert all-to-all.

2 processes, expert-parallel over both (``examples/moe_ep.py``: each MoE block's experts split
between them, every other weight replicated); each process runs its own pipeline of two stages
(one block each, a V on one rank: pipeline group of one) through torch's ``ScheduleDualPipeV`` and
``ScheduleZBVZeroBubble``, with and without :func:`customgrad.pipelining.overlap_forward_backward`,
once with the dense weights under FSDP2 (``fully_shard`` over both processes, the experts left
out), and through a hand-written loop that wraps each forward in ``queue.overlap()``. The
"pipeline" cases make the two processes one pipeline of four stages instead (a V over both,
sends and receives between them), each block with all its experts (an all-to-all with itself). Each case
runs one step timed by :class:`customgrad.pipelining.ActionTimer` and records its gradients, the
step, and what the weights' hooks and FSDP2's reduction saw. Launch with
``tests._mp_workers.spawn``; importable by name so spawned processes can unpickle it.
"""

from __future__ import annotations

import contextlib
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import customgrad.pipelining as cgp
from customgrad.pipelining import StepTimeline, WeightGradQueue
from examples import moe_ep

CFG = moe_ep.Config()
BLOCKS, MICROBATCHES, ROWS = 2, 4, 32


@dataclass(frozen=True)
class Case:
    runner: str  # a schedule's name, or "loop" (hand-written)
    overlap: bool
    fsdp: bool = False
    pipeline: bool = False  # the processes are one pipeline, not expert-parallel
    ddp: bool = False  # each stage in DDP (over its own process: a DDP stage keeps W in its slot)

    @property
    def id(self) -> str:
        flags = [f for f, on in (("overlap", self.overlap), ("fsdp", self.fsdp),
                                 ("pipeline", self.pipeline), ("ddp", self.ddp)) if on]  # fmt: skip
        return "+".join([self.runner, *flags])

    @property
    def stages(self) -> int:
        return 2 * BLOCKS if self.pipeline else BLOCKS


def stages_of(case: Case, rank: int) -> list[int]:
    """The stages ``rank`` runs: its V of the pipeline, or all of its own pipeline's."""
    return [rank, case.stages - 1 - rank] if case.pipeline else list(range(BLOCKS))


@dataclass
class Outcome:
    grads: dict[str, Tensor]  # this rank's, full tensors
    step: StepTimeline
    # at each post-accumulate-grad hook firing: (weight, firings so far, its stage's W run so far)
    hooks: list[tuple[str, int, int]] = field(default_factory=list)
    # at each FSDP2 reduction: (stage, accumulations of each of its dense weights so far)
    reductions: list[tuple[int, int]] = field(default_factory=list)


def batches() -> list[tuple[Tensor, Tensor]]:
    """Each rank's ``(x, target)``."""
    gen = torch.Generator().manual_seed(7)
    return [
        (torch.randn(ROWS, CFG.dim, generator=gen, dtype=CFG.dtype),
         torch.randn(ROWS, CFG.dim, generator=gen, dtype=CFG.dtype))
        for _ in range(2)
    ]  # fmt: skip


def _watch(out: Outcome, queue: WeightGradQueue, stage: int, block: nn.Module) -> None:
    for name, p in block.named_parameters():
        full, fired = f"{stage}.{name}", [0]

        def hook(p: Tensor, full: str = full, fired: list[int] = fired) -> None:
            fired[0] += 1
            ran = sum(queue.ran(stage, mb) for mb in range(MICROBATCHES))
            out.hooks.append((full, fired[0], ran))

        p.register_post_accumulate_grad_hook(hook)


def _fsdp(block: moe_ep.MoEBlock, stage: int, out: Outcome) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fsdp = fully_shard(block, mesh=mesh, ignored_params={block.w1, block.w2})
    dense = [n for n, _ in block.named_parameters() if n not in ("w1", "w2")]
    accumulated = dict.fromkeys(dense, 0)
    hooked: set[int] = set()

    def pre_forward(mod: nn.Module, args: object) -> None:
        # Inside forward (after FSDP's own pre-forward) the module holds the unsharded
        # parameters, the tensors autograd accumulates into: count their accumulations.
        for name, p in mod.named_parameters():
            if name in accumulated and id(p) not in hooked:
                hooked.add(id(p))
                p.register_post_accumulate_grad_hook(
                    lambda _, name=name: accumulated.__setitem__(name, accumulated[name] + 1)
                )

    fsdp.register_forward_pre_hook(pre_forward)
    fsdp.set_all_reduce_hook(lambda _: out.reductions.append((stage, min(accumulated.values()))))
    return fsdp


def run_case(case: Case, own_group: dist.ProcessGroup) -> Outcome:
    """One step of ``case``; ``own_group`` holds this process alone."""
    rank = dist.get_rank()
    queue = WeightGradQueue()
    mine = stages_of(case, rank)
    ep_group, pp_group = (
        (own_group, dist.group.WORLD) if case.pipeline else (dist.group.WORLD, own_group)
    )
    blocks = {s: moe_ep.MoEBlock(CFG, s, ep_group, queue) for s in mine}
    x, target = batches()[0 if case.pipeline else rank]
    timer = cgp.ActionTimer()
    out = Outcome({}, StepTimeline(()))
    if case.runner == "loop":
        model = nn.Sequential(*blocks.values())
        if not case.fsdp:
            _watch(out, queue, 0, model)
        with timer.step():
            _loop(model, queue, timer, x, target, case.overlap)
    else:
        mods: dict[int, nn.Module] = {}
        for s, block in blocks.items():
            if case.fsdp:
                mods[s] = _fsdp(block, s, out)
            else:
                _watch(out, queue, s, block)
                mods[s] = (
                    DistributedDataParallel(block, process_group=own_group) if case.ddp else block
                )
        stage_cls = timer.stage_class(cgp.PipelineStage)
        stages = [stage_cls(m, s, case.stages, torch.device("cpu"), group=pp_group, queue=queue)
                  for s, m in mods.items()]  # fmt: skip
        schedule = getattr(pipelining, case.runner)(stages, MICROBATCHES, loss_fn=moe_ep.loss_fn)
        if case.overlap:
            cgp.overlap_forward_backward(schedule)
        args = (x,) if 0 in mine else ()
        kwargs = {"target": target} if case.stages - 1 in mine else {}
        with timer.step():
            schedule.step(*args, **kwargs)
    out.step = StepTimeline(tuple(timer.steps))
    for b, block in blocks.items():
        for name, p in block.named_parameters():
            g = p.grad
            full = g.full_tensor() if hasattr(g, "full_tensor") else g  # FSDP2: a DTensor
            out.grads[f"{b}.{name}"] = full.detach().clone()
    return out


def _loop(
    model: nn.Module, queue: WeightGradQueue, timer: cgp.ActionTimer, x: Tensor, target: Tensor,
    overlap: bool,
) -> None:  # fmt: skip
    """One stage, microbatch after microbatch: the forward of ``i`` waits with the W of ``i -
    1`` (inside ``queue.overlap()``), then ``i``'s input pass queues its own."""
    pairs = list(zip(x.chunk(MICROBATCHES), target.chunk(MICROBATCHES)))
    for i, (xm, tm) in enumerate(pairs):
        hiding = queue.overlap() if overlap else contextlib.nullcontext()
        with hiding, queue.microbatch(0, i), timer.action("F", 0, i):
            loss = moe_ep.loss_fn(model(xm), tm) / MICROBATCHES
        with timer.action("I", 0, i):
            queue.backward(loss)
    for key in queue.pending():
        with timer.action("W", *key):
            queue.run(*key)
    queue.finish()


def run_cases(cases: list[Case], out_path: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    own = [dist.new_group([r]) for r in range(world)]  # every group is made on every rank
    results = {c: run_case(c, own[rank]) for c in cases}
    everyone: list[dict[Case, Outcome] | None] = [None] * world
    dist.all_gather_object(everyone, results)
    if rank == 0:
        Path(out_path).write_bytes(pickle.dumps(everyone))
