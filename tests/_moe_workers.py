"""What ``tests/test_moe_stages.py`` runs on 2 processes (gloo): torchtitan's MoE models
(:mod:`tests._torchtitan`), cut into 4 stages the torchtitan way, trained 2 steps through a
V-shaped schedule on torch's ``PipelineStage`` or customgrad's, eager or with each block
compiled (``block.compile()``, as torchtitan's ``apply_compile``; customgrad's stage recompiles
them into split regions), against the same model on one process.

Each case records the first step's largest gradient difference from one process's (the
microbatches' mean loss, as the schedule computes it), and, for the second step (after an
AdamW step and torchtitan's load-balancing hook, so the routing has changed), the FLOPs of
every action by stage and kind (``F``, ``I``, ``W``, ``B``). One spawn runs every case;
references are computed once per model and kernel. ``python -m tests._moe_workers`` prints the
cases as a table.
"""

from __future__ import annotations

import functools
import math
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
import torch.nn.functional as F
from torch import Tensor, nn

import customgrad.pipelining as cgp
from customgrad._flops import FlopCounter
from tests import _torchtitan as tt

MICROBATCHES, ROWS = 4, 4
V_SCHEDULES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
STAGES = ("customgrad", "torch")


@dataclass(frozen=True)
class Case:
    model: str  # one of tt.MODELS
    schedule: str  # one of V_SCHEDULES
    kernel: str  # a key of tt.KERNELS
    stage: str  # one of STAGES
    compiled: bool  # each block compiled with block.compile(backend="aot_eager")

    @property
    def id(self) -> str:
        how = "compiled" if self.compiled else "eager"
        return f"{self.model}-{self.schedule.removeprefix('Schedule')}-{self.kernel}-{self.stage}-{how}"


@dataclass
class Outcome:
    worst: float
    """The first step's largest relative gradient difference from one process's."""
    flops: dict[tuple[int, str], int]
    """The second step's FLOPs by (stage, action kind), over both ranks."""
    actions: dict[str, int]
    """The second step's actions by kind, over both ranks."""
    reference_flops: int
    """One process's forward and full backward of the same microbatches."""

    @property
    def total(self) -> int:
        return sum(self.flops.values())

    def of(self, kind: str, stage: int | None = None) -> int:
        """FLOPs of ``kind`` actions, on ``stage`` or every stage."""
        return sum(f for (s, k), f in self.flops.items() if k == kind and stage in (None, s))


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch() -> tuple[Tensor, Tensor]:
    """Random tokens, the same on every rank: inputs and next tokens."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(tt.VOCAB, (ROWS, tt.SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


@functools.cache
def reference(model: str, kernel: str) -> tuple[dict[str, Tensor], int]:
    """One process's gradients of the first step (by parameter name) and the FLOPs of its
    forward and full backward (counted apart: under a dispatch mode some bfloat16 kernels round
    otherwise, silu's backward by one unit)."""
    x, y = batch()

    def step(whole: nn.Module) -> None:
        losses = [
            loss_fn(whole(xm), ym) for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES))
        ]
        torch.stack(losses).mean().backward()

    whole = tt.model(model, kernel)
    step(whole)
    grads = {n: p.grad for n, p in whole.named_parameters() if p.grad is not None}
    with FlopCounter() as counter:
        step(tt.model(model, kernel))
    return grads, counter.total


def _stages(
    case: Case, timer: cgp.ActionTimer, submods: dict[int, nn.Module]
) -> list[pipelining.PipelineStage]:
    n = 2 * dist.get_world_size()
    device = torch.device("cpu")
    base = cgp.PipelineStage if case.stage == "customgrad" else pipelining.PipelineStage
    cls = timer.stage_class(base)
    return [cls(m, s, n, device) for s, m in submods.items()]


def _worst(submods: dict[int, nn.Module], want: dict[str, Tensor]) -> float:
    worst = 0.0
    for m in submods.values():
        for name, p in m.named_parameters():
            w = want.get(name)
            if p.grad is None or w is None:
                if p.grad is not None or w is not None:
                    worst = math.inf
                continue
            worst = max(worst, ((p.grad - w).abs().max() / w.abs().max().clamp_min(1e-30)).item())
    out = torch.tensor([worst], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return float(out.item())


@functools.cache
def _stage_modules(model: str, kernel: str, compiled: bool) -> dict[int, nn.Module]:
    """This rank's stage modules (the same for both V schedules), blocks compiled or not: made
    once, so that cases with other schedules reuse the compiled blocks."""
    whole = tt.model(model, kernel)
    submods = tt.stages(whole, V_SCHEDULES[0], dist.get_rank(), dist.get_world_size())
    if compiled:
        for m in submods.values():
            for block in m.layers.values():  # type: ignore[union-attr, operator]
                block.compile(backend="aot_eager")  # torchtitan's apply_compile
    return submods


@functools.cache
def _initial_state(model: str, kernel: str) -> dict[str, Tensor]:
    """The model's initial parameters and buffers (the load-balancing counts among them)."""
    whole = tt.model(model, kernel)
    return {k: v.detach().clone() for k, v in [*whole.named_parameters(), *whole.named_buffers()]}


def _fresh(model: str, kernel: str, compiled: bool) -> dict[int, nn.Module]:
    """The stage modules with the model's initial parameters and buffers, no gradients."""
    submods = _stage_modules(model, kernel, compiled)
    state = _initial_state(model, kernel)
    with torch.no_grad():
        for m in submods.values():
            for name, t in [*m.named_parameters(), *m.named_buffers()]:
                if name in state:
                    t.copy_(state[name])
            m.zero_grad(set_to_none=True)
    return submods


def run_case(case: Case) -> Outcome:
    """``case`` on this rank; every rank returns the same merged outcome."""
    world = dist.get_world_size()
    want, reference_flops = reference(case.model, case.kernel)
    submods = _fresh(case.model, case.kernel, case.compiled)
    assert set(submods) == set(tt.stage_ids(case.schedule, dist.get_rank(), world))
    timer = cgp.ActionTimer("cpu")
    stages = _stages(case, timer, submods)
    schedule = getattr(pipelining, case.schedule)(stages, MICROBATCHES, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW([p for m in submods.values() for p in m.parameters()], lr=1e-2)
    tt.load_balancing_hook(optimizer, list(submods.values()), world)
    x, y = batch()
    first, last = 0 in submods, 2 * world - 1 in submods

    def step() -> None:
        schedule.step(*([x] if first else []), **({"target": y} if last else {}))

    step()
    worst = _worst(submods, want)
    optimizer.step()  # the hook moves the expert biases: a new routing
    optimizer.zero_grad(set_to_none=True)
    with timer.step(count_flops=True):
        step()
    (timeline,) = timer.gather()
    actions = [a for r in timeline.ranks for a in r.actions]
    flops: dict[tuple[int, str], int] = {}
    for a in actions:
        flops[a.stage, a.kind] = flops.get((a.stage, a.kind), 0) + (a.flops or 0)
    return Outcome(
        worst=worst,
        flops=flops,
        actions={k: sum(a.kind == k for a in actions) for k in "FIWB"},
        reference_flops=reference_flops,
    )


def run_cases(cases: list[Case], out_path: str) -> None:
    """Every case on one process group; rank 0 pickles the outcomes to ``out_path``.

    Compiled cases of one model and kernel share their blocks (give them one after the other);
    before the next model or kernel, dynamo's caches are cleared, as in a run of one model (the
    kernels' code objects are shared: a plain Function's graph breaks would leave frames
    compiled that another kernel's blocks then run in)."""
    outcomes, last = {}, None
    for case in cases:
        key = (case.model, case.kernel)
        if case.compiled and key != last:
            torch._dynamo.reset()
            last = key
        outcomes[case] = run_case(case)
    if dist.get_rank() == 0:
        Path(out_path).write_bytes(pickle.dumps(outcomes))


def table(outcomes: dict[Case, Outcome]) -> str:
    """The FLOPs of each case's second step, in MFLOPs: each MoE stage's I / W / B, and the
    step against one process's forward and full backward."""
    header = "model        schedule       kernel        stage       blocks    "
    header += "stage 1 I / W / B      stage 2 I / W / B      step / one process"
    lines = [header]
    for case, o in outcomes.items():
        cells = [
            f"{o.of('I', s) / 1e6:5.2f} / {o.of('W', s) / 1e6:4.2f} / {o.of('B', s) / 1e6:4.2f}"
            for s in (1, 2)
        ]
        lines.append(
            f"{case.model:12} {case.schedule.removeprefix('Schedule'):14} "
            f"{case.kernel:13} {case.stage:11} {'compiled' if case.compiled else 'eager':9} "
            f"{cells[0]:22} {cells[1]:22} {o.total / o.reference_flops:.3f}"
        )
    return "\n".join(lines)


def main() -> None:
    """``python -m tests._moe_workers [--triton]``: every case of ``tests/test_moe_stages.py``
    (and the Triton kernel's, in Triton's interpreter: slow) on 2 local processes, as a table."""
    import argparse
    import os
    import tempfile

    from tests import _mp_workers
    from tests.test_moe_stages import CASES

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--triton", action="store_true", help="the Triton kernel's cases too")
    args = p.parse_args()
    cases = list(CASES)
    if args.triton:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the workers import triton
        cases += [Case("qwen3", s, "triton", "customgrad", False) for s in V_SCHEDULES]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "outcomes.pkl"
        _mp_workers.spawn(run_cases, (cases, str(out)), world=2, timeout=1800)
        print(table(pickle.loads(out.read_bytes())))


if __name__ == "__main__":
    main()
