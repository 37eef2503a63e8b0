"""Workers for ``tests/test_pipeline_mp.py``.

They live in their own module, importable by name, so that spawned processes can unpickle
them. The model, stages and launcher are the zero-bubble demo's (``examples/_pipeline.py``).
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import _pipeline as pp  # noqa: E402

# Tiny and in float64: the pipeline's gradients must equal the reference's to rounding.
CFG = pp.ModelConfig(dim=16, hidden=32, blocks=4, batch=16, microbatches=4, dtype=torch.float64)
FULL_BACKWARD = "ScheduleInterleaved1F1B"
SCHEDULES = (*pp.ZERO_BUBBLE, FULL_BACKWARD)


@dataclass(frozen=True)
class Case:
    schedule: str
    impl: str  # "customgrad" or "function" (plain autograd.Function ops)
    stage: str  # one of pp.STAGE_KINDS

    @property
    def id(self) -> str:
        return f"{self.schedule.removeprefix('Schedule')}-{self.impl}-{self.stage}"


@dataclass
class Outcome:
    mismatch: str  # empty when the gradients equal the reference's
    flops: int  # whole step, all ranks, all actions
    flops_by_kind: dict[str, int]
    actions: dict[str, int]  # action kind -> count, all ranks


def run_cases(device: torch.device, cases: list[Case], out_path: str) -> None:
    """One training step per case on one process group; rank 0 pickles the outcomes."""
    outcomes: dict[Case, Outcome] = {}
    for case in cases:
        pipe = pp.build_pipeline(CFG, case.schedule, case.impl, case.stage, device)
        x, target = pp.make_batch(CFG, 0, device)
        dist.barrier()
        pipe.recorder.start_step(count_flops=True)
        pipe.step(x, target)
        got = pipe.named_grads()
        want = pp.reference_grads(CFG, case.impl, 0, device)
        report = pp.compare_grads(got, want, rtol=1e-9, atol=1e-12)
        missing = [
            f"{i}.{name}: no gradient"
            for i, block in pipe.modules.items()
            for name, _ in block.named_parameters()
            if f"{i}.{name}" not in got
        ]
        outcomes[case] = Outcome(
            mismatch="\n".join(filter(None, [report, *missing])),
            flops=sum(pipe.recorder.flops.values()),
            flops_by_kind=dict(pipe.recorder.flops),
            actions={k: n for k, (n, _) in pp.summarize(pipe.recorder.events).items()},
        )
    gathered = pp.gather_to_rank0(outcomes)
    if gathered is None:
        return
    merged = {}
    for case in cases:
        per_rank = [g[case] for g in gathered]
        kinds = {k for o in per_rank for k in (*o.flops_by_kind, *o.actions)}
        merged[case] = Outcome(
            mismatch="\n".join(
                f"rank {r}: {o.mismatch}" for r, o in enumerate(per_rank) if o.mismatch
            ),
            flops=sum(o.flops for o in per_rank),
            flops_by_kind={k: sum(o.flops_by_kind.get(k, 0) for o in per_rank) for k in kinds},
            actions={k: sum(o.actions.get(k, 0) for o in per_rank) for k in kinds},
        )
    Path(out_path).write_bytes(pickle.dumps(merged))


def reference_step_flops() -> int:
    """FLOPs of one single-process forward + full backward of the whole batch."""
    counter = pp.FlopCounter()
    pp.reference_grads(CFG, "customgrad", 0, torch.device("cpu"), flop_counter=counter)
    return counter.total


def fail_on_rank(device: torch.device, failing_rank: int, pid_dir: str) -> None:
    """Record this process's pid; one rank raises, the other waits in a collective."""
    Path(pid_dir, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    if dist.get_rank() == failing_rank:
        raise ValueError("deliberate failure")
    dist.barrier()


def hang(device: torch.device, pid_dir: str) -> None:
    Path(pid_dir, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    time.sleep(3600)
