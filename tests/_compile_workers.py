"""What ``tests/test_compile_mp.py`` runs on 2 processes: compiled blocks in torch's schedules.

The model, batch, loss and launcher are ``tests/_mp_workers``'s; here each block is compiled
with :func:`customgrad.compile` before the stages are built, and one warm-up step compiles
every region (forward and backward) before the counted step.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
from torch import nn

import customgrad as cg
import customgrad.pipelining as cgp
from customgrad._compile import regions
from tests import _mp_workers as w
from tests._mp_workers import Case, Outcome

SCHEDULES = (*w.ZERO_BUBBLE, w.FULL_BACKWARD)
STAGES = ("torch", "customgrad")
IMPLS = ("native", "customgrad")


def run_case(case: Case, device: torch.device) -> tuple[Outcome, dict[str, int]]:
    """One counted step of ``case``, and how often compiled graphs ran in it (all ranks)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    blocks = w.build_blocks(case.impl).to(device)
    for block in blocks:
        cg.compile(block, backend="aot_eager")
    mine = w._stage_indices(case.schedule, rank, world)
    per = w.BLOCKS // (2 * world)
    submods = {s: nn.Sequential(*blocks[s * per : (s + 1) * per]) for s in mine}
    timer = cgp.ActionTimer(device)
    cls = pipelining.PipelineStage if case.stage == "torch" else cgp.PipelineStage
    stages = [timer.stage_class(cls)(m, s, 2 * world, device) for s, m in submods.items()]
    schedule = getattr(pipelining, case.schedule)(stages, w.MICROBATCHES, loss_fn=w.loss_fn)
    x, target = w.batch(device)
    kwargs = {"target": target} if 2 * world - 1 in mine else {}
    args = [x] if 0 in mine else []
    schedule.step(*args, **kwargs)  # warm-up: compiles every region
    for p in blocks.parameters():
        p.grad = None
    before = _runs()
    with timer.step(count_flops=True):
        schedule.step(*args, **kwargs)
    after = _runs()
    runs = {k: after[k] - before[k] for k in after}
    all_runs: list[object] = [None] * world
    dist.all_gather_object(all_runs, runs)
    problems = w.grad_problems(rank, mine, per, blocks, w.reference(case.impl, device))
    everyone: list[object] = [None] * world
    dist.all_gather_object(everyone, problems)
    (timeline,) = timer.gather()
    actions = [a for r in timeline.ranks for a in r.actions]
    outcome = Outcome(
        mismatch="\n".join(p for ps in everyone for p in ps),  # type: ignore[attr-defined]
        flops={k: sum(a.flops or 0 for a in actions if a.kind == k) for k in "FIWB"},
        actions={k: sum(a.kind == k for a in actions) for k in "FIWB"},
        timeline=timeline,
    )
    return outcome, {k: sum(r[k] for r in all_runs) for k in runs}  # type: ignore[index]


def _runs() -> dict[str, int]:
    """How many times each kind of compiled backward graph ran, over every region here."""
    total = {"full": 0, "input": 0, "weight": 0}
    for region in regions():
        for k, n in region.runs.items():
            total[k] += n
    return total


def run_cases(cases: list[Case], out_path: str) -> None:
    outcomes = {case: run_case(case, torch.device("cpu")) for case in cases}
    if dist.get_rank() == 0:
        Path(out_path).write_bytes(pickle.dumps(outcomes))
