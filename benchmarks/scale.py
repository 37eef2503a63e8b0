"""Predicted at scale: ZBV and DualPipeV against 1F1B for 2 to 64 pipeline ranks.

Measures one transformer block of the demo's language model (``examples/zero_bubble.py``:
RMSNorm, causal attention, SwiGLU MLP, every op a customgrad op from ``examples/lm_ops.py``) on
this CPU, action by action: forward F, then I and W under customgrad's split (what
``customgrad.pipelining.PipelineStage`` runs), and a full backward B. The same block made of
plain ``autograd.Function``\\ s would run its whole backward in I and again in W under torch's
split: those costs are :meth:`StageCosts.repeating_backward` of the measured F and B. Then
:func:`customgrad.pipelining.simulate` replays torch's own schedules with both.

Every rank holds the same share of the model: two blocks (the demo's 4 layers on 2 ranks).
1F1B puts them in one stage per rank; ZBV and DualPipeV in two stages of one block (the V).
Microbatches: m = 2p, the fewest DualPipeV accepts (ZBV wants 2p - 1, 1F1B p). Speed-up is
1F1B's step time over the schedule's, with the same ops; communication is free unless
``--send`` says otherwise.

With ``--compile`` the block is compiled first with ``customgrad.compile`` (inductor; one region
per block, its backward cut into an I graph and a W graph): the prediction for compiled stages.
Its comparison is the same block compiled by ``torch.compile`` (``nn.Module.compile``), which
under torch's split runs its whole compiled backward in I and again in W (with
``donated_buffer=False``; it fails otherwise): again :meth:`StageCosts.repeating_backward`.

Run from the repository's root: ``python -m benchmarks.scale [--compile] [--rows 2] [--send 0] [--out PNG]``;
``--costs FILE`` replays per-block costs from a JSON file instead of measuring
(``{"forward": s, "backward_input": s, "backward_weight": s, "backward": s}``, seconds per
block and microbatch with customgrad ops).
"""

from __future__ import annotations

import argparse
import json
import statistics
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

import customgrad
from customgrad import pipelining as cg_split
from customgrad.pipelining import Simulation, StageCosts, simulate
from examples import zero_bubble as demo

ROOT = Path(__file__).resolve().parents[1]

RANKS = (2, 4, 8, 16, 32, 64)
BLOCKS_PER_RANK = 2
SCHEDULES = {"ZBV": ScheduleZBVZeroBubble, "DualPipeV": ScheduleDualPipeV}
IMPLS = {"customgrad": "customgrad ops", "function": "plain Functions"}
COMPILED_IMPLS = {"customgrad": "customgrad.compile", "function": "torch.compile (I = W = B)"}
# Not measured: customgrad's halves rescaled so that I + W cost what its B does (what the
# split would give with no per-pass overhead), to show what that overhead costs.
EVEN = "customgrad, I + W = B"


def measure_block(
    cfg: Any, rows: int, reps: int, compile: bool = False
) -> tuple[StageCosts, dict[str, float]]:
    """Best seconds of F, I, W and B of one demo block over ``reps`` rounds (other processes
    only ever add time), and the median's excess over the best. ``compile``: the block
    compiled by ``customgrad.compile`` (inductor), compiled during the warm-up rounds."""
    torch.manual_seed(0)
    block = demo.Block(cfg)
    if compile:
        customgrad.compile(block)
    params = list(block.parameters())
    x0 = torch.randn(rows, cfg.seq, cfg.dim)
    g = torch.randn(rows, cfg.seq, cfg.dim)
    times: dict[str, list[float]] = {k: [] for k in "FIWB"}

    def timed(kind: str, fn: Callable[..., Any], *args: Any) -> Any:
        t = time.perf_counter()
        out = fn(*args)
        times[kind].append(time.perf_counter() - t)
        return out

    for rep in range(reps + 2):  # two warm-up rounds, dropped
        x = x0.clone().requires_grad_()
        out = timed("F", block, x)
        _, groups = timed("I", cg_split.stage_backward_input, [out], [g], [x], params)
        timed("W", cg_split.stage_backward_weight, params, groups)
        x = x0.clone().requires_grad_()
        timed("B", block(x).backward, g)
        block.zero_grad(set_to_none=True)
        if rep < 2:
            for v in times.values():
                v.clear()
    best = {k: min(v) for k, v in times.items()}
    spread = {k: statistics.median(v) / best[k] - 1 for k, v in times.items()}
    return StageCosts(best["F"], best["I"], best["W"], backward=best["B"]), spread


def stage_costs(block: StageCosts, blocks: int, send: float) -> StageCosts:
    """Costs of a stage made of ``blocks`` blocks."""
    return StageCosts(
        forward=block.forward * blocks,
        backward_input=block.backward_input * blocks,
        backward_weight=block.backward_weight * blocks,
        backward=block.full_backward * blocks,
        send=send,
    )


def even_split(c: StageCosts) -> StageCosts:
    """``c`` with I and W scaled to add up to B."""
    scale = c.full_backward / (c.backward_input + c.backward_weight)
    return StageCosts(c.forward, c.backward_input * scale, c.backward_weight * scale, c.backward)


def predict(blocks: dict[str, StageCosts], send: float) -> dict[tuple[int, str, str], Simulation]:
    """``{(p, schedule, impl): Simulation}`` for every rank count, schedule and op kind."""
    blocks = {**blocks, EVEN: even_split(blocks["customgrad"])}
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


def table(sims: dict[tuple[int, str, str], Simulation], impls: dict[str, str] = IMPLS) -> str:
    head = ["p", "m", "1F1B bubble"]
    for name in SCHEDULES:
        for impl in IMPLS:
            head += [f"{name}, {impls[impl]}: bubble", "speed-up"]
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
    sims: dict[tuple[int, str, str], Simulation],
    blocks: dict[str, StageCosts],
    path: Path,
    compiled: bool = False,
) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 5.0))  # a README's width
    bubble_ax, speed_ax = fig.subplots(1, 2)
    styles = {"customgrad": "-", "function": "--", EVEN: ":"}
    colors = {"1F1B": "#777777", "ZBV": "#4C72B0", "DualPipeV": "#C44E52"}
    impls = COMPILED_IMPLS if compiled else IMPLS
    even = f"{impls['customgrad']}, I + W = B"
    for impl, label in {**impls, EVEN: even}.items():
        for name in ("1F1B", *SCHEDULES):
            if name == "1F1B" and impl != "customgrad":
                continue  # 1F1B runs full backwards: the same for every kind of op
            bubbles = [sims[p, name, impl].bubble * 100 for p in RANKS]
            who = name if name == "1F1B" else f"{name}, {label.removeprefix('customgrad, ')}"
            bubble_ax.plot(RANKS, bubbles, styles[impl], marker="o", markersize=4, color=colors[name],
                           label=who)  # fmt: skip
            if name != "1F1B":
                speed = [
                    sims[p, "1F1B", impl].step_time / sims[p, name, impl].step_time for p in RANKS
                ]
                speed_ax.plot(RANKS, speed, styles[impl], marker="o", markersize=4,
                              color=colors[name], label=who)  # fmt: skip
    speed_ax.axhline(1.0, color="#777777", linewidth=1)
    for ax in (bubble_ax, speed_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(RANKS, [str(p) for p in RANKS])
        ax.set_xlabel("pipeline ranks p (m = 2p microbatches)", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    bubble_ax.set_ylabel("bubble (% of rank time idle)", fontsize=8)
    bubble_ax.set_title("Predicted bubble", fontsize=9)
    speed_ax.set_ylabel("step-time speed-up over 1F1B", fontsize=8)
    speed_ax.set_title("Predicted speed-up over 1F1B (same ops)", fontsize=9)
    handles, labels = bubble_ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=7.5, frameon=False)
    cg = blocks["customgrad"]
    what = "compiled by customgrad.compile (inductor)" if compiled else "with customgrad ops"
    other = "torch.compile" if compiled else "plain Functions"
    fig.suptitle(
        f"One demo block per stage (2 per rank), measured on this CPU: F {cg.forward * 1e3:.2f}, "
        f"I {cg.backward_input * 1e3:.2f}, W {cg.backward_weight * 1e3:.2f},\n"
        f"B {cg.full_backward * 1e3:.2f} ms {what}; {other}: I = W = B",
        fontsize=8.5,
    )
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2, help="sequences per microbatch")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--send", type=float, default=0.0, help="seconds per hand-over")
    parser.add_argument("--costs", type=Path, help="JSON of per-block costs (skip measuring)")
    parser.add_argument(
        "--compile", action="store_true", help="compile the block with customgrad.compile"
    )
    parser.add_argument("--out", type=Path, help="the picture (docs/img/scale[_compiled].png)")
    args = parser.parse_args()
    if args.out is None:
        args.out = ROOT / "docs" / "img" / ("scale_compiled.png" if args.compile else "scale.png")
    impls = COMPILED_IMPLS if args.compile else IMPLS

    torch.set_num_threads(1)  # one core per pipeline rank, as in the 2-process demo
    cfg = demo.Config()
    if args.costs is not None:
        block = StageCosts(**json.loads(args.costs.read_text()))
        print(f"per-block costs from {args.costs}")
    else:
        how = ", compiled by customgrad.compile (inductor)" if args.compile else ""
        print(
            f"measuring one block of the demo's model{how} (dim {cfg.dim}, {cfg.heads} heads, "
            f"SwiGLU {cfg.hidden}, {args.rows} x {cfg.seq} tokens per microbatch, 1 thread, "
            f"best of {args.reps}):"
        )
        block, spread = measure_block(cfg, args.rows, args.reps, args.compile)
        print("  median over best: " + ", ".join(f"{k} +{v:.0%}" for k, v in spread.items()))
    blocks = {
        "customgrad": block,
        "function": StageCosts.repeating_backward(block.forward, block.full_backward),
    }
    for impl, label in impls.items():
        c = blocks[impl]
        print(
            f"  {label:>18}: F {c.forward * 1e3:.3f}  I {c.backward_input * 1e3:.3f}  "
            f"W {c.backward_weight * 1e3:.3f}  B {c.full_backward * 1e3:.3f} ms"
            + ("  (I = W = B: repeating_backward)" if impl == "function" else "")
        )
    c = blocks["customgrad"]
    print(
        f"  (I + W) / B = {(c.backward_input + c.backward_weight) / c.full_backward:.3f}, "
        f"W / B = {c.backward_weight / c.full_backward:.3f}, B / F = "
        f"{c.full_backward / c.forward:.3f}"
    )
    t = time.perf_counter()
    sims = predict(blocks, args.send)
    print(f"\npredicted ({len(sims)} simulations, {time.perf_counter() - t:.1f} s):\n")
    print(table(sims, impls))
    p = RANKS[-1]
    print(
        f"\nif customgrad's I + W cost what its B does (no per-pass overhead), at p = {p}: "
        + ", ".join(
            f"{name} {sims[p, name, EVEN].bubble:.1%} bubble, "
            f"{sims[p, '1F1B', EVEN].step_time / sims[p, name, EVEN].step_time:.2f}x"
            for name in SCHEDULES
        )
    )
    draw(sims, blocks, args.out, args.compile)
    print(f"\nwrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
