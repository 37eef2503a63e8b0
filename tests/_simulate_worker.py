"""Worker for ``tests/test_simulate_mp.py``: time real pipeline steps, action by action.

Lives in its own module, importable by name, so spawned processes can unpickle it. The model
and launcher are the demo's (``examples/_pipeline.py``); the stages are customgrad's
``PipelineStage`` timed by :class:`customgrad.pipelining.ActionTimer`.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import _pipeline as pp  # noqa: E402

import customgrad.pipelining as cgp  # noqa: E402

# Big enough that an action (a few ms on one core) dwarfs the schedule's Python around it.
CFG = pp.ModelConfig(dim=384, hidden=1536, blocks=4, batch=512, microbatches=8)


def time_steps(device: torch.device, schedules: list[str], steps: int, out_path: str) -> None:
    """Run ``steps`` timed training steps per schedule (after one untimed); rank 0 pickles
    ``{schedule: [StepTimeline, ...]}`` to ``out_path``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for schedule in schedules:
        n_stages = pp.num_stages(schedule, world)
        blocks = pp.build_blocks(CFG, "customgrad").to(device)
        timer = cgp.ActionTimer(device)
        stage_cls = timer.stage_class(cgp.PipelineStage)
        mine = pp.stages_of_rank(schedule, rank, world)
        stages = [
            stage_cls(
                nn.Sequential(*(blocks[i] for i in pp.stage_blocks(CFG, s, n_stages))),
                s,
                n_stages,
                device,
            )
            for s in mine
        ]
        cls = pp.SCHEDULES[schedule]
        loss_fn = timer.time_loss(pp.loss_fn)
        sched = (
            cls(stages[0], CFG.microbatches, loss_fn=loss_fn)
            if len(stages) == 1
            else cls(stages, CFG.microbatches, loss_fn=loss_fn)
        )
        x, target = pp.make_batch(CFG, 0, device)
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
