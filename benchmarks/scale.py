"""Predicted at scale: ZBV and DualPipeV against 1F1B for 2 to 64 pipeline ranks.

Measures one block of the demo's model (``examples/_pipeline.py``: RMSNorm, two linears, a
residual) on this CPU, action by action, once with customgrad ops and once with plain
``autograd.Function`` ops: F, I and W under the split each pipeline stage runs (customgrad's
for customgrad ops, torch's for plain Functions, which repeats their whole backward in I and in
W), and a full backward B. Then :func:`customgrad.pipelining.simulate` replays torch's own
schedules with those costs.

Every rank holds the same share of the model: two blocks. 1F1B puts them in one stage per
rank; ZBV and DualPipeV in two stages of one block (the V). Microbatches: m = 2p, the fewest
DualPipeV accepts (ZBV wants 2p - 1, 1F1B p). Speed-up is 1F1B's step time over the
schedule's, with the same ops; communication is free unless ``--send`` says otherwise.

Run: ``python benchmarks/scale.py [--dim 256] [--hidden 1024] [--rows 32] [--send 0]
[--out docs/img/scale.png]``; ``--costs FILE`` replays costs from a JSON file instead of
measuring (``{"customgrad": {"forward": s, "backward_input": s, "backward_weight": s,
"backward": s}, "function": {...}}``, seconds per block and microbatch).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining import _backward as torch_split

from customgrad import pipelining as cg_split
from customgrad.pipelining import Simulation, StageCosts, simulate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import _pipeline as pp  # noqa: E402

RANKS = (2, 4, 8, 16, 32, 64)
BLOCKS_PER_RANK = 2
SCHEDULES = {"ZBV": ScheduleZBVZeroBubble, "DualPipeV": ScheduleDualPipeV}
IMPLS = {"customgrad": "customgrad ops", "function": "plain Functions"}


def measure_blocks(
    dim: int, hidden: int, rows: int, reps: int
) -> dict[str, tuple[StageCosts, dict[str, float]]]:
    """Best seconds of F, I, W and B of one block, per kind of op, over ``reps`` rounds (the
    kinds take turns, so load from other processes falls on both), and the median's excess
    over the best (other processes only ever add time)."""
    x0 = torch.randn(rows, dim, generator=torch.Generator().manual_seed(1))
    g = torch.randn(rows, dim, generator=torch.Generator().manual_seed(2))
    blocks = {impl: pp.Block(dim, hidden, impl, torch.Generator().manual_seed(0)) for impl in IMPLS}
    times: dict[str, dict[str, list[float]]] = {impl: {k: [] for k in "FIWB"} for impl in IMPLS}

    def timed(impl: str, kind: str, fn: Callable[..., Any], *args: Any) -> Any:
        t = time.perf_counter()
        out = fn(*args)
        times[impl][kind].append(time.perf_counter() - t)
        return out

    for rep in range(reps + 2):  # two warm-up rounds, dropped
        for impl, block in blocks.items():
            # customgrad ops under customgrad's split, plain Functions under torch's
            split: Any = cg_split if impl == "customgrad" else torch_split
            params = list(block.parameters())
            x = x0.clone().requires_grad_()
            out = timed(impl, "F", block, x)
            _, groups = timed(impl, "I", split.stage_backward_input, [out], [g], [x], params)
            timed(impl, "W", split.stage_backward_weight, params, groups)
            x = x0.clone().requires_grad_()
            timed(impl, "B", block(x).backward, g)
            block.zero_grad(set_to_none=True)
        if rep < 2:
            for kinds in times.values():
                for v in kinds.values():
                    v.clear()
    out = {}
    for impl, kinds in times.items():
        best = {k: min(v) for k, v in kinds.items()}
        spread = {k: statistics.median(v) / best[k] - 1 for k, v in kinds.items()}
        out[impl] = StageCosts(best["F"], best["I"], best["W"], backward=best["B"]), spread
    return out


def stage_costs(block: StageCosts, blocks: int, send: float) -> StageCosts:
    """Costs of a stage made of ``blocks`` blocks."""
    return StageCosts(
        forward=block.forward * blocks,
        backward_input=block.backward_input * blocks,
        backward_weight=block.backward_weight * blocks,
        backward=block.full_backward * blocks,
        send=send,
    )


def predict(blocks: dict[str, StageCosts], send: float) -> dict[tuple[int, str, str], Simulation]:
    """``{(p, schedule, impl): Simulation}`` for every rank count, schedule and op kind."""
    out = {}
    for p in RANKS:
        m = 2 * p
        for impl, block in blocks.items():
            one = stage_costs(block, BLOCKS_PER_RANK, send)
            out[p, "1F1B", impl] = simulate(Schedule1F1B, p, m, one)
            half = stage_costs(block, BLOCKS_PER_RANK // 2, send)
            for name, cls in SCHEDULES.items():
                out[p, name, impl] = simulate(cls, 2 * p, m, half)
    return out


def table(sims: dict[tuple[int, str, str], Simulation]) -> str:
    head = ["p", "m", "1F1B bubble"]
    for name in SCHEDULES:
        for impl in IMPLS:
            head += [f"{name} {impl} bubble", "speed-up"]
    rows = [head]
    for p in RANKS:
        row = [str(p), str(2 * p), f"{sims[p, '1F1B', 'customgrad'].bubble:.1%}"]
        for name in SCHEDULES:
            for impl in IMPLS:
                sim, base = sims[p, name, impl], sims[p, "1F1B", impl]
                row += [f"{sim.bubble:.1%}", f"{base.step_time / sim.step_time:.2f}x"]
        rows.append(row)
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("---:" for _ in head) + "|")
    return "\n".join(lines)


def draw(
    sims: dict[tuple[int, str, str], Simulation], blocks: dict[str, StageCosts], path: Path
) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    bubble_ax, speed_ax = fig.subplots(1, 2)
    styles = {"customgrad": "-", "function": "--"}
    colors = {"1F1B": "#777777", "ZBV": "#4C72B0", "DualPipeV": "#C44E52"}
    for impl, label in IMPLS.items():
        for name in ("1F1B", *SCHEDULES):
            if name == "1F1B" and impl == "function":
                continue  # 1F1B runs full backwards: the same for both kinds of op
            bubbles = [sims[p, name, impl].bubble * 100 for p in RANKS]
            who = name if name == "1F1B" else f"{name}, {label}"
            bubble_ax.plot(RANKS, bubbles, styles[impl], marker="o", color=colors[name], label=who)
            if name != "1F1B":
                speed = [
                    sims[p, "1F1B", impl].step_time / sims[p, name, impl].step_time for p in RANKS
                ]
                speed_ax.plot(RANKS, speed, styles[impl], marker="o", color=colors[name], label=who)
    speed_ax.axhline(1.0, color="#777777", linewidth=1)
    for ax in (bubble_ax, speed_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(RANKS, [str(p) for p in RANKS])
        ax.set_xlabel("pipeline ranks p (m = 2p microbatches, 2 blocks per rank)")
        ax.grid(alpha=0.3)
    bubble_ax.set_ylabel("bubble (% of rank time idle)")
    bubble_ax.set_title("Predicted bubble", fontsize=10)
    speed_ax.set_ylabel("step-time speed-up over 1F1B")
    speed_ax.set_title("Predicted speed-up over 1F1B (same ops)", fontsize=10)
    bubble_ax.legend(fontsize=8)
    cg, fn = blocks["customgrad"], blocks["function"]
    fig.suptitle(
        f"One block per stage: customgrad F/I/W/B = {cg.forward * 1e3:.2f}/"
        f"{cg.backward_input * 1e3:.2f}/{cg.backward_weight * 1e3:.2f}/"
        f"{cg.full_backward * 1e3:.2f} ms; plain Functions {fn.forward * 1e3:.2f}/"
        f"{fn.backward_input * 1e3:.2f}/{fn.backward_weight * 1e3:.2f}/"
        f"{fn.full_backward * 1e3:.2f} ms (measured on this CPU)",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=32, help="rows per microbatch")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--send", type=float, default=0.0, help="seconds per hand-over")
    parser.add_argument("--costs", type=Path, help="JSON of per-block costs (skip measuring)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "scale.png")
    args = parser.parse_args()

    torch.set_num_threads(1)  # one core per pipeline rank, as in the 2-process demo
    if args.costs is not None:
        raw = json.loads(args.costs.read_text())
        blocks = {impl: StageCosts(**raw[impl]) for impl in IMPLS}
        print(f"per-block costs from {args.costs}")
    else:
        blocks = {}
        print(
            f"measuring one block (dim {args.dim}, hidden {args.hidden}, {args.rows} rows per "
            f"microbatch, 1 thread, best of {args.reps}):"
        )
        measured = measure_blocks(args.dim, args.hidden, args.rows, args.reps)
        for impl, label in IMPLS.items():
            blocks[impl], spread = measured[impl]
            c = blocks[impl]
            print(
                f"  {label:>15}: F {c.forward * 1e3:.3f}  I {c.backward_input * 1e3:.3f}  "
                f"W {c.backward_weight * 1e3:.3f}  B {c.full_backward * 1e3:.3f} ms"
                f"  (median over best: "
                + " ".join(f"{k} +{v:.0%}" for k, v in spread.items())
                + ")"
            )
    t = time.perf_counter()
    sims = predict(blocks, args.send)
    print(f"\npredicted ({len(sims)} simulations, {time.perf_counter() - t:.1f} s):\n")
    print(table(sims))
    draw(sims, blocks, args.out)
    print(f"\nwrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
