"""Worker for ``tests/test_simulate_mp.py`` and ``benchmarks/simulate_accuracy.py``: time real
pipeline steps, action by action, and the stage costs the simulator replays them from.

Lives in its own module, importable by name, so spawned processes can unpickle it. The model is
residual MLP blocks of a customgrad linear op, big enough that an action (a few ms on one core)
dwarfs the schedule's Python around it; the stages are customgrad's ``PipelineStage`` timed by
:class:`customgrad.pipelining.ActionTimer`. Launch with ``tests._mp_workers.spawn``.
"""

from __future__ import annotations

import pickle
import statistics
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
from torch import Tensor, nn

import customgrad.pipelining as cgp
from customgrad.pipelining import StageCosts, StepTimeline
from tests.conftest import linear_op

DIM, HIDDEN, ROWS, MICROBATCHES, BLOCKS = 384, 1536, 512, 8, 4

linear = linear_op("simulate_mp::linear")


class Block(nn.Module):
    """``x + w2 @ relu(w1 @ x)`` with customgrad linear ops."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(HIDDEN, DIM, generator=generator) / DIM**0.5)
        self.w2 = nn.Parameter(torch.randn(DIM, HIDDEN, generator=generator) / HIDDEN**0.5)

    def forward(self, x: Tensor) -> Tensor:
        return x + linear(torch.relu(linear(x, self.w1)), self.w2)


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return ((output - target) ** 2).mean()


def stage_indices(schedule: str, rank: int, world: int) -> list[int]:
    """The stages ``rank`` runs: one for 1F1B, the V's two (``rank``, ``2 world - 1 - rank``)."""
    return [rank] if schedule == "Schedule1F1B" else [rank, 2 * world - 1 - rank]


def time_steps(schedules: list[str], steps: int, out_path: str) -> None:
    """Run ``steps`` timed training steps per schedule (after one untimed); rank 0 pickles
    ``{schedule: [StepTimeline, ...]}`` to ``out_path``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    blocks = nn.ModuleList(Block(gen) for _ in range(BLOCKS))
    x = torch.randn(ROWS, DIM, generator=gen)
    target = torch.tanh(x.flip(-1))
    results = {}
    for schedule in schedules:
        mine = stage_indices(schedule, rank, world)
        n_stages = world * len(mine)
        per_stage = BLOCKS // n_stages
        timer = cgp.ActionTimer(device)
        stage_cls = timer.stage_class(cgp.PipelineStage)
        stages = [
            stage_cls(
                nn.Sequential(*blocks[s * per_stage : (s + 1) * per_stage]), s, n_stages, device
            )
            for s in mine
        ]
        cls = getattr(pipelining, schedule)
        loss = timer.time_loss(loss_fn)
        sched = (
            cls(stages[0], MICROBATCHES, loss_fn=loss)
            if len(stages) == 1
            else cls(stages, MICROBATCHES, loss_fn=loss)
        )
        args = (x,) if 0 in mine else ()
        kwargs = {"target": target} if n_stages - 1 in mine else {}
        for step in range(steps + 1):
            dist.barrier()  # every rank's clock starts together
            if step == 0:
                sched.step(*args, **kwargs)  # warm-up: allocations, first-call paths
            else:
                with timer.step():
                    sched.step(*args, **kwargs)
            blocks.zero_grad(set_to_none=True)
        results[schedule] = timer.gather()
    if rank == 0:
        Path(out_path).write_bytes(pickle.dumps(results))


def measured_costs(steps: list[StepTimeline]) -> list[StageCosts]:
    """Each stage's mean action times, the mean hand-over between ranks (``send``: the part of a
    wait after the peer's action ended) and the runtime's own time per action (``overhead``:
    what a rank spent neither in actions nor waiting for a receive).

    Means, not :func:`~customgrad.pipelining.stage_costs`' medians: a step is a sum of actions,
    and on a shared CPU action times have a long right tail, which the median leaves out."""
    times: dict[tuple[int, str], list[float]] = defaultdict(list)
    transfer = waits = other = actions = 0.0
    for step in steps:
        for rank, part in zip(step.ranks, step.breakdown()):
            for a in rank.actions:
                times[a.stage, a.kind].append(a.duration)
            transfer += part.transfer
            waits += len(rank.waits)
            other += rank.duration - rank.busy - sum(wt.duration for wt in rank.waits)
            actions += len(rank.actions)

    def mean(stage: int, kind: str) -> float:
        return statistics.mean(times[stage, kind]) if (stage, kind) in times else 0.0

    return [
        StageCosts(
            forward=mean(s, "F"),
            backward_input=mean(s, "I"),
            backward_weight=mean(s, "W"),
            backward=mean(s, "B") if (s, "B") in times else None,
            send=transfer / waits if waits else 0.0,
            overhead=other / actions,
        )
        for s in sorted({s for s, _ in times})
    ]
