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

The MoE block row (without ``--compile``): one expert-parallel mixture-of-experts block
(``examples/moe_ep.py``: a dense MLP, then top-2 of 8 experts split over 2 processes, every
weight a customgrad op's), measured on 2 processes (gloo), F / I / W / B compute and the
dispatch and combine all-to-alls apart (``ActionTimer``, best of ``--reps``); then 1F1B, ZBV and
DualPipeV at 2 to 64 pipeline ranks, each without and with W hiding the all-to-alls
(``simulate(..., overlap=True)``, what ``overlap_forward_backward`` runs). ``--no-moe`` skips it;
``--dispatch S --combine S`` replace the measured all-to-alls by given seconds (per block and
microbatch: this machine's loopback is far faster, relative to compute, than a network between
nodes).

Run from the repository's root: ``python -m benchmarks.scale [--compile] [--rows 2] [--send 0] [--out PNG]``;
``--costs FILE`` replays per-block costs from a JSON file instead of measuring
(``{"forward": s, "backward_input": s, "backward_weight": s, "backward": s}``, seconds per
block and microbatch with customgrad ops).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleZBVZeroBubble,
)

import customgrad
from customgrad import pipelining as cg_split
from customgrad.pipelining import Simulation, StageCosts, simulate
from examples import moe_ep
from examples import zero_bubble as demo
from tests._mp_workers import spawn

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


# --- the MoE block row ----------------------------------------------------------------------

MOE = moe_ep.Config(dim=256, hidden=512, n_experts=8, top_k=2, dtype=torch.float32)
MOE_ROWS = 256  # tokens per microbatch and process


def time_moe_block(reps: int, out_path: str) -> None:
    """On each of 2 processes (experts split between them): ``reps`` rounds (after two) of one
    MoE block's F, I and W (customgrad's split) and F and B, timed by ``ActionTimer``, its
    all-to-all waits recorded; rank 0 writes the steps' costs, best of ``reps``, as JSON."""
    timer = cg_split.ActionTimer()
    queue = cg_split.WeightGradQueue()
    block = moe_ep.MoEBlock(MOE, 0, dist.group.WORLD, queue)
    params = list(block.parameters())
    gen = torch.Generator().manual_seed(dist.get_rank())
    x0 = torch.randn(MOE_ROWS, MOE.dim, generator=gen)
    g = torch.randn(MOE_ROWS, MOE.dim, generator=gen)
    for rep in range(reps + 2):
        with timer.step():
            x = x0.clone().requires_grad_()
            with timer.action("F", 0, 0):
                out = block(x)
            with timer.action("I", 0, 0):
                _, groups = cg_split.stage_backward_input([out], [g], [x], params)
            with timer.action("W", 0, 0):
                cg_split.stage_backward_weight(params, groups)
            x = x0.clone().requires_grad_()
            with timer.action("F", 0, 1):
                out = block(x)
            with timer.action("B", 0, 1):
                out.backward(g)
        block.zero_grad(set_to_none=True)
        if rep < 2:
            timer.steps.clear()
    steps = timer.gather()
    if dist.get_rank() == 0:
        (costs,) = cg_split.stage_costs(steps, statistic=min).values()
        fields = ("forward", "backward_input", "backward_weight", "backward", "dispatch", "combine")
        Path(out_path).write_text(json.dumps({f: getattr(costs, f) for f in fields}))


def measure_moe_block(reps: int) -> StageCosts:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "moe.json"
        spawn(time_moe_block, (reps, str(out)), world=2, timeout=600)
        return StageCosts(**json.loads(out.read_text()))


def moe_stage(block: StageCosts, blocks: int, send: float) -> StageCosts:
    """Costs of a stage of ``blocks`` MoE blocks: compute and all-to-alls add up."""
    one = stage_costs(block, blocks, send)
    return dataclasses.replace(
        one, dispatch=block.dispatch * blocks, combine=block.combine * blocks
    )


MOE_SCHEDULES = {"1F1B": Schedule1F1B, **SCHEDULES}


def predict_moe(block: StageCosts, send: float) -> dict[tuple[int, str, bool], Simulation]:
    """``{(p, schedule, overlap): Simulation}`` for the MoE block, as :func:`predict` lays it
    out (2 blocks per rank, m = 2p)."""
    out = {}
    for p in RANKS:
        m = 2 * p
        for overlap in (False, True):
            one = moe_stage(block, BLOCKS_PER_RANK, send)
            out[p, "1F1B", overlap] = simulate(Schedule1F1B, p, m, one, overlap=overlap)
            half = moe_stage(block, BLOCKS_PER_RANK // 2, send)
            for name, cls in SCHEDULES.items():
                out[p, name, overlap] = simulate(cls, 2 * p, m, half, overlap=overlap)
    return out


def moe_table(sims: dict[tuple[int, str, bool], Simulation]) -> str:
    head = ["p", "m"]
    for name in MOE_SCHEDULES:
        head += [f"{name}: step", "overlapped", "all-to-all hidden"]
    rows = [head]
    for p in RANKS:
        row = [str(p), str(2 * p)]
        for name in MOE_SCHEDULES:
            plain, hidden = sims[p, name, False], sims[p, name, True]
            share = hidden.hidden / (hidden.hidden + hidden.exposed)
            row += [_ms(plain.step_time), f"{plain.step_time / hidden.step_time:.3f}x",
                    f"{share:.0%}"]  # fmt: skip
        rows.append(row)
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("---:" for _ in head) + "|")
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g} ms"


def moe_row(reps: int, send: float, dispatch: float | None, combine: float | None) -> None:
    print(
        f"\nMoE block (examples/moe_ep.py: dim {MOE.dim}, {MOE.n_experts} experts of width "
        f"{MOE.hidden}, top-{MOE.top_k}, {MOE_ROWS} tokens per microbatch, experts over 2 "
        f"processes, gloo, 1 thread each, best of {reps}):"
    )
    c = measure_moe_block(reps)
    print(
        f"  F {c.forward * 1e3:.3f}  I {c.backward_input * 1e3:.3f}  W {c.backward_weight * 1e3:.3f}"
        f"  B {c.full_backward * 1e3:.3f} ms compute; all-to-all dispatch {c.dispatch * 1e3:.3f}, "
        f"combine {c.combine * 1e3:.3f} ms (each F and each I or B waits for both)"
    )
    if dispatch is not None or combine is not None:
        c = dataclasses.replace(
            c,
            dispatch=c.dispatch if dispatch is None else dispatch,
            combine=c.combine if combine is None else combine,
        )
        print(f"  given: dispatch {c.dispatch * 1e3:.3f}, combine {c.combine * 1e3:.3f} ms")
    t = time.perf_counter()
    sims = predict_moe(c, send)
    print(
        f"\npredicted ({len(sims)} simulations, {time.perf_counter() - t:.1f} s): the step "
        f"without the overlap, its ratio to the step with W hiding the all-to-alls, and the "
        f"share of all-to-all time hidden:\n"
    )
    print(moe_table(sims))


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
    parser.add_argument("--no-moe", action="store_true", help="skip the MoE block row")
    parser.add_argument("--dispatch", type=float, help="MoE row: seconds per dispatch (given)")
    parser.add_argument("--combine", type=float, help="MoE row: seconds per combine (given)")
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
    if not (args.compile or args.no_moe or args.costs is not None):
        moe_row(min(args.reps, 20), args.send, args.dispatch, args.combine)


if __name__ == "__main__":
    main()
