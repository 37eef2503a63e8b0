"""What ``zero_bubble.py`` prints and draws after training: where the step's time went.

The measured steps (``customgrad.pipelining.ActionTimer``) give each stage's action times; the
same schedule replayed with those times and no waits (``customgrad.pipelining.simulate``) is
the step the schedule promises. The difference is split into what the timer saw: waiting while
a peer still computed, transfers, and the schedule's own time (Python, posting sends).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import customgrad.pipelining as cgp
from customgrad.pipelining import StageCosts, StepTimeline


def report(steps: list[StepTimeline], losses: list[float], schedule: Any, out: Path) -> None:
    """Print the loss, the timing table and the bubble's attribution; draw the pictures."""
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


def attribution(
    timed: Sequence[StepTimeline], costs: list[StageCosts], schedule_cls: type, n_mb: int
) -> str:
    """The table: each stage's action times, each rank's step split up, and the bubble's causes."""
    n_stages = len(costs)
    ms = 1e3
    lines = [
        f"\nper stage, median ms per microbatch over {len(timed)} timed steps (wall | CPU):",
        f"{'stage':>5} {'rank':>4} {'F':>13} {'I':>13} {'W':>13}",
    ]
    ranks = timed[0].stage_ranks()
    cpu: dict[tuple[int, str], list[float]] = {}
    for a in (a for st in timed for r in st.ranks for a in r.actions):
        cpu.setdefault((a.stage, a.kind), []).append(a.cpu)
    for s, c in enumerate(costs):
        walls = (c.forward, c.backward_input, c.backward_weight)
        cells = [
            f"{w * ms:6.2f}|{statistics.median(cpu.get((s, k), [0.0])) * ms:<6.2f}"
            for w, k in zip(walls, "FIW")
        ]
        lines.append(f"{s:>5} {ranks[s]:>4} " + " ".join(cells))
    step = median_step(timed)
    parts = step.breakdown()
    fields = ("compute", "peer", "transfer", "other", "tail", "total")
    lines += ["", "the step of median length, ms: " + " | ".join(fields)]
    for b in parts:
        lines.append(
            f"  rank {b.rank}: " + " | ".join(f"{getattr(b, f) * ms:6.1f}" for f in fields)
        )
    mean = {f: statistics.mean(getattr(b, f) for b in parts) for f in fields}  # over ranks
    mean["other_cpu"] = statistics.mean(r.other_cpu for r in step.ranks)
    mean["other_queued"] = statistics.mean(r.other_queued for r in step.ranks)
    mean["waits_queued"] = statistics.mean(sum(w.queued for w in r.waits) for r in step.ranks)
    mean["busy_queued"] = statistics.mean(sum(a.queued for a in r.actions) for r in step.ranks)
    total = mean["total"]

    def replay(c: list[StageCosts]) -> Any:
        return cgp.simulate(schedule_cls, n_stages, n_mb, c)

    kinds = ("forward", "backward_input", "backward_weight")
    avg = StageCosts(*(statistics.mean(getattr(c, k) for c in costs) for k in kinds))
    balanced, replayed = replay([avg] * n_stages), replay(costs)
    busy = statistics.mean(replayed.busy)  # the replay's compute per rank
    shares = [
        (balanced.step_time - busy, "the schedule itself (replayed with every stage at the mean"
         f" action times and no waits: bubble {balanced.bubble:.1%})"),
        (replayed.step_time - balanced.step_time, "unequal stages (replayed with each stage's"
         f" own times: bubble {replayed.bubble:.1%})"),
        (mean["peer"] + mean["tail"] - (replayed.step_time - busy), "waiting for a peer longer"
         " than in the replay (it was held up by what follows; < 0: shorter)"),
        (mean["transfer"], "transfers: the peer's action had ended, its tensor was not here yet"),
        (mean["other_cpu"], "between actions: the schedule's own CPU work (Python, posting)"),
        (mean["other"] - mean["other_cpu"], "between actions: off the CPU (waiting for a core:"
         f" {mean['other_queued'] * ms:.1f} ms; blocked in sends)"),
    ]  # fmt: skip
    lines += [
        "",
        f"its bubble: {step.bubble:.1%} of {total * ms:.1f} ms; as shares of the step (mean of"
        " the ranks), it comes from:",
        *(f"  {v / total:+6.1%}  {what}" for v, what in shares),
        f"waiting for a core also delayed the actions by {mean['busy_queued'] * ms:.1f} ms and"
        f" the end of waits by {mean['waits_queued'] * ms:.1f} ms a rank (in the lines above)",
        f"all {len(timed)} timed steps: median {statistics.median(t.duration for t in timed) * ms:.1f}"
        f" ms, mean {statistics.mean(t.duration for t in timed) * ms:.1f} ms, mean bubble"
        f" {statistics.mean(t.bubble for t in timed):.1%} (the longest steps lost their cores"
        " most)",
    ]
    return "\n".join(lines)


def median_step(timed: Sequence[StepTimeline]) -> StepTimeline:
    return sorted(timed, key=lambda s: s.duration)[len(timed) // 2]


def draw(timed: Sequence[StepTimeline], sim: Any, losses: list[float], out: Path) -> None:
    from matplotlib.figure import Figure

    median = median_step(timed)
    fig = Figure(figsize=(14, 4.6))
    top, bottom = fig.subplots(2, 1, sharex=True)
    median.draw(ax=top, title=f"{sim.schedule}, {median.summary()} (the step of median length)")
    sim.draw(
        ax=bottom,
        title=f"the same schedule replayed with the measured action times and no"
        f" waits: step {sim.step_time * 1e3:.4g} ms, bubble {sim.bubble:.1%}",
    )
    top.set_xlabel("")
    bottom.set_xlim(0, median.duration * 1e3)
    fig.tight_layout()
    fig.savefig(out / "zero_bubble.png", dpi=120)
    fig = Figure(figsize=(6, 3.5))
    ax = fig.add_subplot()
    ax.plot(range(1, len(losses) + 1), losses, lw=1)
    ax.set(xlabel="step", ylabel="loss (cross-entropy, nats per byte)", title="training loss")
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
