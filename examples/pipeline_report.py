"""What ``zero_bubble.py`` prints and draws after training: where the step's time went.

The measured steps (``customgrad.pipelining.ActionTimer``) give each stage's action times. The
same schedule replayed with those times and no waits (``customgrad.pipelining.simulate``) is
the step the schedule promises; the rest of the measured bubble is split into what the timer
saw: waiting for a neighbour, tensors in transit, and time between actions.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import customgrad.pipelining as cgp
from customgrad.pipelining import StageCosts, StepTimeline

WORDS = """\
Words used below: F is a stage's forward, I its input gradient (the backward that the previous \
stage waits for), W its weight gradient (which nobody waits for, so a zero-bubble schedule runs \
it later, in time that would otherwise be idle). The bubble is the share of the ranks' time in \
which no F, I or W runs. The replay is the same schedule run in customgrad's simulator with the \
measured F, I and W times and no waiting: what the schedule would give on an ideal machine."""

STAGE_0 = """\
Stage 0 has no I: nothing before it needs its input gradient, so its whole backward (input and \
weight work together) runs in one pass, counted as its W; the I timed for it is only the \
schedule's bookkeeping. Every zero-bubble schedule runs that stage's I and W back to back, so \
splitting it would only add a pass."""


def report(steps: list[StepTimeline], losses: list[float], schedule: Any, out: Path) -> None:
    """Print the loss, the timing table and where the bubble went; draw the pictures."""
    n_mb, n_stages = schedule._n_microbatches, len(steps[0].stage_ranks())
    print(
        f"\nloss: {losses[0]:.3f} at step 1, {statistics.mean(losses[-5:]):.3f} over the last"
        f" {min(5, len(losses))} steps"
    )
    timed = steps[2:] if len(steps) > 4 else steps[-1:]  # the first steps warm up
    costs = cgp.stage_costs(timed)
    no_wait = [dataclasses.replace(costs[s], send=0.0, overhead=0.0) for s in range(n_stages)]
    sim = cgp.simulate(type(schedule), n_stages, n_mb, no_wait)
    print(attribution(timed, no_wait, type(schedule), n_mb))
    out.mkdir(parents=True, exist_ok=True)
    try:
        draw(timed, sim, losses, out)
        print(f"\npictures: {out / 'zero_bubble.png'}, {out / 'loss.png'}")
    except ImportError as e:  # matplotlib is a dev dependency, not customgrad's
        print(f"\nno pictures ({e}); `pip install matplotlib` to get them")


def _wrap(text: str, width: int = 96) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))


def attribution(
    timed: Sequence[StepTimeline], costs: list[StageCosts], schedule_cls: type, n_mb: int
) -> str:
    """The report: each stage's action times, then where the step of median length went."""
    n_stages = len(costs)
    ms = 1e3
    lines = [
        "",
        _wrap(WORDS),
        "",
        f"Time per microbatch, median over {len(timed)} timed steps, in ms (CPU time in brackets):",
        f"{'stage':>5} {'rank':>4}  {'F':>14}  {'I':>14}  {'W':>14}",
    ]
    ranks = timed[0].stage_ranks()
    cpu: dict[tuple[int, str], list[float]] = {}
    for a in (a for st in timed for r in st.ranks for a in r.actions):
        cpu.setdefault((a.stage, a.kind), []).append(a.cpu)
    for s, c in enumerate(costs):
        walls = (c.forward, c.backward_input, c.backward_weight)
        cells = [
            f"{w * ms:7.2f} ({statistics.median(cpu.get((s, k), [0.0])) * ms:.2f})".ljust(14)
            for w, k in zip(walls, "FIW")
        ]
        note = "  <- no I: its whole backward is in W" if s == 0 else ""
        lines.append(f"{s:>5} {ranks[s]:>4}  " + "  ".join(cells) + note)
    lines += ["", _wrap(STAGE_0)]

    step = median_step(timed)
    parts = step.breakdown()
    total = statistics.mean(b.total for b in parts)

    def mean(values: Any) -> float:
        return statistics.mean(values)

    compute = mean(b.compute for b in parts)
    peer = mean(b.peer + b.tail for b in parts)
    transfer = mean(b.transfer for b in parts)
    other = mean(b.other for b in parts)
    other_cpu = mean(r.other_cpu for r in step.ranks)
    queued = mean(r.other_queued for r in step.ranks)
    busy_queued = mean(sum(a.queued for a in r.actions) for r in step.ranks)

    def replay(c: list[StageCosts]) -> Any:
        return cgp.simulate(schedule_cls, n_stages, n_mb, c)

    kinds = ("forward", "backward_input", "backward_weight")
    avg = StageCosts(*(mean(getattr(c, k) for c in costs) for k in kinds))
    balanced, replayed = replay([avg] * n_stages), replay(costs)
    busy = mean(replayed.busy)  # the replay's compute per rank
    causes = [
        (balanced.step_time - busy, "the schedule's own gaps: the replay with every stage "
         f"equally fast still idles {balanced.bubble:.1%} of the time"),
        (replayed.step_time - balanced.step_time, "unequal stages: with each stage's own times "
         f"the replay idles {replayed.bubble:.1%}, a rank waiting for a slower one"),
        (peer - (replayed.step_time - busy), "waiting for a neighbour still computing, beyond "
         "what the replay predicts (negative: less than predicted)"),
        (transfer, "tensors in transit: the neighbour had finished, its tensor had not "
         "arrived"),
        (other_cpu, "between actions, on the CPU: the schedule's own Python, posting sends and "
         "receives"),
        (other - other_cpu, "between actions, off the CPU: no core free (other processes had "
         f"it for {queued * ms:.1f} ms) or blocked in a send"),
    ]  # fmt: skip
    lines += [
        "",
        f"Where the time of the step of median length went ({step.duration * ms:.1f} ms; a "
        "mean over the ranks):",
        f"  {compute / total:6.1%}  {compute * ms:7.1f} ms  computing F, I and W",
        f"  {1 - compute / total:6.1%}  {(total - compute) * ms:7.1f} ms  the bubble, because of:",
        *(f"    {v / total:+6.1%}  {v * ms:7.1f} ms  {what}" for v, what in causes),
        f"Besides, other processes held the CPU for {busy_queued * ms:.1f} ms a rank while an "
        "action was running, which made the actions slower (counted in computing).",
        f"All {len(timed)} timed steps: median {statistics.median(t.duration for t in timed) * ms:.1f}"
        f" ms, mean {mean(t.duration for t in timed) * ms:.1f} ms, mean bubble "
        f"{mean(t.bubble for t in timed):.1%}.",
    ]
    return "\n".join(lines)


def median_step(timed: Sequence[StepTimeline]) -> StepTimeline:
    return sorted(timed, key=lambda s: s.duration)[len(timed) // 2]


NOTE_STAGE_0 = "stage 0 (rank 0, solid) has no I: its W is its whole backward"


def draw(timed: Sequence[StepTimeline], sim: Any, losses: list[float], out: Path) -> None:
    """``zero_bubble.png``: the measured step above its replay, on one time axis (8 inches wide,
    a README's width); ``loss.png``: the loss curve."""
    from matplotlib.figure import Figure

    median = median_step(timed)
    fig = Figure(figsize=(8.0, 5.6))
    top, bottom = fig.subplots(2, 1, sharex=True)
    median.draw(
        ax=top,
        title=f"measured: the step of median length, {median.duration * 1e3:.4g} ms, bubble "
        f"{median.bubble:.1%}",
        notes=[NOTE_STAGE_0],
    )
    sim.draw(
        ax=bottom,
        title=f"replayed: the measured F, I and W times without waiting: step "
        f"{sim.step_time * 1e3:.4g} ms, bubble {sim.bubble:.1%}",
    )
    bottom.set_xlim(0, median.duration * 1e3)
    top.set_xlabel("")
    # One legend for both (the measured step's: it has every entry), under the plots.
    legend = top.get_legend()
    handles, labels = legend.legend_handles, [t.get_text() for t in legend.get_texts()]
    legend.remove()
    bottom.get_legend().remove()
    fig.legend(handles, labels, loc="lower left", ncols=2, fontsize=7, frameon=False,
               handlelength=1.2, bbox_to_anchor=(0.02, 0.0))  # fmt: skip
    fig.suptitle(f"{sim.schedule}: {sim.n_stages} stages on {sim.n_ranks} ranks", fontsize=10)
    fig.tight_layout(rect=(0, 0.15, 1, 1))
    fig.savefig(out / "zero_bubble.png", dpi=150)
    fig = Figure(figsize=(8.0, 3.0))
    ax = fig.add_subplot()
    ax.plot(range(1, len(losses) + 1), losses, lw=1.2)
    ax.set(xlabel="step", ylabel="loss (nats per byte)", title="training loss (cross-entropy)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=150)
