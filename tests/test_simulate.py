"""The schedule simulator: hand-computed timelines, torch's own pictures, dependencies, errors.

Timelines of small cases are written out by hand from the schedules' definitions; ZBV's is
torch's own picture (its ``pipeline_order`` step numbers) when F = I = W; every action of every
schedule is checked against its data dependencies over random costs (hypothesis).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

import customgrad
from customgrad.pipelining import Simulation, StageCosts, TimedAction, simulate
from customgrad.pipelining._simulate import _StandInStage

UNIT = StageCosts(forward=1.0, backward_input=1.0, backward_weight=1.0)
SINGLE = (Schedule1F1B, ScheduleGPipe)
MULTI = (
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    ScheduleDualPipeV,
)


def spans(sim: Simulation, rank: int) -> list[tuple[str, int, float, float]]:
    return [(f"{a.stage}{a.kind}", a.microbatch, a.start, a.end) for a in sim.actions(rank)]


# --- hand-computed timelines ---------------------------------------------------------------


def test_1f1b_two_ranks_four_microbatches_by_hand() -> None:
    # F = 1, B = I + W = 2, no communication. Rank 0 runs F0 F1 B0 F2 B1 F3 B2 B3 (two
    # forwards of warm-up), rank 1 (the last stage) F0 B0 F1 B1 F2 B2 F3 B3.
    sim = simulate(Schedule1F1B, 2, 4, StageCosts(1.0, 1.5, 0.5))
    assert spans(sim, 0) == [
        ("0F", 0, 0, 1), ("0F", 1, 1, 2), ("0B", 0, 4, 6), ("0F", 2, 6, 7),
        ("0B", 1, 7, 9), ("0F", 3, 9, 10), ("0B", 2, 10, 12), ("0B", 3, 13, 15),
    ]  # fmt: skip
    assert spans(sim, 1) == [
        ("1F", 0, 1, 2), ("1B", 0, 2, 4), ("1F", 1, 4, 5), ("1B", 1, 5, 7),
        ("1F", 2, 7, 8), ("1B", 2, 8, 10), ("1F", 3, 10, 11), ("1B", 3, 11, 13),
    ]  # fmt: skip
    m, p, f, b = 4, 2, 1.0, 2.0
    assert sim.step_time == (m + p - 1) * (f + b) == 15
    assert sim.busy == (12.0, 12.0)
    assert sim.bubble == pytest.approx(1 - 24 / 30)
    assert sim.stage_to_rank == (0, 1)


def test_1f1b_with_send_cost_by_hand() -> None:
    # As above with 0.5 s per hand-over: every cross-rank edge is 0.5 s later.
    sim = simulate(Schedule1F1B, 2, 4, StageCosts(1.0, 1.0, 1.0, send=0.5))
    assert spans(sim, 0) == [
        ("0F", 0, 0, 1), ("0F", 1, 1, 2), ("0B", 0, 5, 7), ("0F", 2, 7, 8),
        ("0B", 1, 8, 10), ("0F", 3, 10, 11), ("0B", 2, 12, 14), ("0B", 3, 15, 17),
    ]  # fmt: skip
    assert spans(sim, 1) == [
        ("1F", 0, 1.5, 2.5), ("1B", 0, 2.5, 4.5), ("1F", 1, 4.5, 5.5), ("1B", 1, 5.5, 7.5),
        ("1F", 2, 8.5, 9.5), ("1B", 2, 9.5, 11.5), ("1F", 3, 11.5, 12.5), ("1B", 3, 12.5, 14.5),
    ]  # fmt: skip
    assert sim.step_time == 17


def test_overhead_by_hand() -> None:
    # 0.5 s of the runtime's own work before each action: the rank is not free for it, but it
    # overlaps a wait for inputs (rank 1's F0, rank 0's B0), and it is not busy time.
    sim = simulate(Schedule1F1B, 2, 2, StageCosts(1.0, 1.0, 1.0, overhead=0.5))
    assert spans(sim, 0) == [
        ("0F", 0, 0.5, 1.5),
        ("0F", 1, 2, 3),
        ("0B", 0, 5, 7),
        ("0B", 1, 9, 11),
    ]
    assert spans(sim, 1) == [
        ("1F", 0, 1.5, 2.5),
        ("1B", 0, 3, 5),
        ("1F", 1, 5.5, 6.5),
        ("1B", 1, 7, 9),
    ]
    assert sim.step_time == 11
    assert sim.busy == (6.0, 6.0)


def test_gpipe_two_ranks_by_hand() -> None:
    # All forwards, then all backwards; B waits for the next stage's B of the same microbatch.
    sim = simulate(ScheduleGPipe, 2, 4, StageCosts(1.0, 1.0, 1.0, backward=2.0))
    assert spans(sim, 0) == [
        ("0F", 0, 0, 1), ("0F", 1, 1, 2), ("0F", 2, 2, 3), ("0F", 3, 3, 4),
        ("0B", 0, 7, 9), ("0B", 1, 9, 11), ("0B", 2, 11, 13), ("0B", 3, 13, 15),
    ]  # fmt: skip
    assert spans(sim, 1) == [
        ("1F", 0, 1, 2), ("1F", 1, 2, 3), ("1F", 2, 3, 4), ("1F", 3, 4, 5),
        ("1B", 0, 5, 7), ("1B", 1, 7, 9), ("1B", 2, 9, 11), ("1B", 3, 11, 13),
    ]  # fmt: skip
    assert sim.step_time == 15


@pytest.mark.parametrize("schedule", SINGLE)
@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 2), (3, 8), (4, 8), (8, 16)])
def test_single_stage_schedules_step_time_formula(schedule: type, p: int, m: int) -> None:
    # (m + p - 1) (F + B) without communication, for GPipe and 1F1B alike.
    sim = simulate(schedule, p, m, StageCosts(0.25, 0.5, 0.25))
    assert sim.step_time == pytest.approx((m + p - 1) * 1.0)
    assert sim.bubble == pytest.approx((p - 1) / (m + p - 1))


def test_1f1b_runs_microbatches_in_order_on_the_last_rank() -> None:
    # torch 2.13's Schedule1F1B.pipeline_order numbers the last rank's forwards from 1 (its
    # runtime counts them from 0): the simulator counts them as the runtime does.
    sim = simulate(Schedule1F1B, 3, 4, UNIT)
    assert [(a.kind, a.microbatch) for a in sim.actions(2)] == [
        ("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)
    ]  # fmt: skip


@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 3), (2, 8), (3, 5), (4, 8), (4, 9), (8, 16)])
def test_zbv_uniform_costs_is_torchs_picture(p: int, m: int) -> None:
    # With F = I = W = 1 every action starts at its step in torch's own ZBV action list
    # (which has its idle steps as None): the simulated timeline is the schedule's picture.
    # Each rank computes 2 stages x m x 3 actions = 6m; the last rank waits p - 1 forwards for
    # its first input and rank 0 the same at the end: step 6m + p - 1, bubble (p-1)/(6m+p-1).
    assert m >= 2 * p - 1  # below that, torch's picture leaves holes the runtime closes
    sim = simulate(ScheduleZBVZeroBubble, 2 * p, m, UNIT)
    stages = [_StandInStage(0, 2 * p, p, 0), _StandInStage(p, 2 * p, p, 0)]
    order = ScheduleZBVZeroBubble(stages, m).pipeline_order  # type: ignore[arg-type]
    for rank in range(p):
        picture = {
            (a.stage_index, a.computation_type.value, a.microbatch_index): float(step)
            for step, a in enumerate(order[rank])
            if a is not None
        }
        assert {(a.stage, a.kind, a.microbatch): a.start for a in sim.actions(rank)} == picture
    assert sim.step_time == 6 * m + p - 1
    assert sim.busy == (6.0 * m,) * p
    assert sim.bubble == pytest.approx((p - 1) / (6 * m + p - 1))


def test_zbv_two_ranks_by_hand() -> None:
    # The V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2; stage 1 -> 2 is local.
    sim = simulate(ScheduleZBVZeroBubble, 4, 8, UNIT)
    assert sim.stage_to_rank == (0, 1, 1, 0)
    assert spans(sim, 1)[:6] == [
        ("1F", 0, 1, 2), ("2F", 0, 2, 3), ("1F", 1, 3, 4), ("2F", 1, 4, 5),
        ("2I", 0, 5, 6), ("2W", 0, 6, 7),
    ]  # fmt: skip
    assert sim.step_time == 49
    assert sim.bubble == pytest.approx(1 / 49)


def test_local_hand_off_is_free() -> None:
    # A large send cost delays every cross-rank edge but not the V's bottom (stages 1 -> 2).
    sim = simulate(ScheduleZBVZeroBubble, 4, 4, StageCosts(1.0, 1.0, 1.0, send=10.0))
    first = {(a.stage, a.kind, a.microbatch): a for a in sim.timeline}
    assert first[1, "F", 0].start == first[0, "F", 0].end + 10
    assert first[2, "F", 0].start == first[1, "F", 0].end
    assert first[2, "I", 0].start == first[3, "I", 0].end + 10
    rank1 = list(sim.actions(1))
    i = rank1.index(first[1, "I", 0])
    assert first[1, "I", 0].start == max(rank1[i - 1].end, first[2, "I", 0].end)


def test_dual_pipe_v_overlapped_actions_run_one_after_the_other() -> None:
    # DualPipeV's OVERLAP_F_B actions hold an F and a B; torch runs them in turn.
    sim = simulate(ScheduleDualPipeV, 4, 8, UNIT)
    for rank in range(2):
        kinds = [a.kind for a in sim.actions(rank)]
        assert kinds.count("F") == 16
        assert kinds.count("B") + kinds.count("I") == 16
        assert kinds.count("I") == kinds.count("W") > 0
        assert kinds.count("B") > 0
        ends = [a.end for a in sim.actions(rank)]
        starts = [a.start for a in sim.actions(rank)]
        assert all(s >= e for s, e in zip(starts[1:], ends))
    assert sim.busy == (48.0, 48.0)
    assert sim.step_time == 49


@pytest.mark.parametrize("p", [2, 4])
def test_interleaved_schedules(p: int) -> None:
    # Interleaved 1F1B leaves (p - 1)(F + B) idle per rank, with per-stage F and B; the
    # zero-bubble interleaved schedule fills it with W but for p - 1 forwards.
    m = 2 * p
    one = simulate(ScheduleInterleaved1F1B, 2 * p, m, UNIT)
    zero = simulate(ScheduleInterleavedZeroBubble, 2 * p, m, UNIT)
    assert one.stage_to_rank == tuple(s % p for s in range(2 * p))
    assert one.step_time == 6 * m + (p - 1) * 3
    assert zero.step_time == 6 * m + p - 1


def test_plain_functions_repeat_their_backward() -> None:
    # customgrad ops: I + W == B; plain Functions under torch's split: I == W == B.
    cg_costs = StageCosts(forward=1.0, backward_input=1.0, backward_weight=1.0)
    plain = StageCosts.repeating_backward(forward=1.0, backward=2.0)
    assert (plain.backward_input, plain.backward_weight, plain.full_backward) == (2.0, 2.0, 2.0)
    m = 8
    zb_cg = simulate(ScheduleZBVZeroBubble, 4, m, cg_costs)
    zb_plain = simulate(ScheduleZBVZeroBubble, 4, m, plain)
    assert zb_cg.busy == (2 * m * 3.0,) * 2
    assert zb_plain.busy == (2 * m * 5.0,) * 2  # F + I + W = 1 + 2 + 2 per stage, mb
    # 1F1B does full backwards only: the same for both.
    assert (
        simulate(Schedule1F1B, 2, m, plain).step_time
        == simulate(Schedule1F1B, 2, m, cg_costs).step_time
    )


def test_per_stage_costs() -> None:
    # A slow last stage sets 1F1B's pace: its 4 F + B run back to back, after rank 0's first
    # F and before rank 0's last B.
    fast, slow = StageCosts(1.0, 1.0, 1.0), StageCosts(2.0, 2.0, 2.0)
    sim = simulate(Schedule1F1B, 2, 4, [fast, slow])
    assert sim.busy == (12.0, 24.0)
    assert sim.step_time == 1 + 4 * 6 + 2  # rank 0's first F, rank 1's 4 F+B, rank 0's last B
    assert [a.duration for a in sim.actions(1)] == [2.0, 4.0] * 4


def test_zero_costs() -> None:
    sim = simulate(ScheduleZBVZeroBubble, 4, 4, StageCosts(0.0, 0.0, 0.0))
    assert sim.step_time == 0
    assert sim.bubble == 0


def test_schedule_by_torchs_name() -> None:
    assert simulate("ZBVZeroBubble", 4, 8, UNIT) == simulate(ScheduleZBVZeroBubble, 4, 8, UNIT)
    assert simulate("1f1b", 2, 4, UNIT).schedule == "Schedule1F1B"


def test_summary_and_actions() -> None:
    sim = simulate(Schedule1F1B, 2, 4, StageCosts(1e-3, 1e-3, 1e-3))
    assert sim.summary() == (
        "Schedule1F1B: 2 stages on 2 ranks, 4 microbatches: step 15 ms, bubble 20.0%"
    )
    assert all(isinstance(a, TimedAction) and a.rank == 1 for a in sim.actions(1))


def test_draw(tmp_path: Path) -> None:
    from matplotlib.figure import Figure

    sim = simulate(ScheduleDualPipeV, 4, 8, UNIT)
    fig = sim.draw(tmp_path / "dpv.png", title="DualPipeV")
    assert (tmp_path / "dpv.png").stat().st_size > 1000
    (ax,) = fig.axes
    assert len(ax.patches) == len(sim.timeline)
    assert ax.get_title() == "DualPipeV"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == [
        "F: forward",
        "I: input gradient (what the previous stage waits for)",
        "W: weight gradient (nobody waits for it)",
        "B: full backward (I and W in one pass)",
        "solid: the rank's first stage",
        "light: its second stage",
        "numbers in bars: the microbatch",
    ]
    other = Figure()
    ax2 = other.add_subplot()
    assert sim.draw(ax=ax2) is other
    assert ax2.get_title() == sim.summary()


def test_draw_notes_and_no_shade_entries_for_one_stage_per_rank() -> None:
    sim = simulate(Schedule1F1B, 2, 4, UNIT)
    fig = sim.draw(notes=["stage 0: no I"])
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == [
        "F: forward",
        "B: full backward (I and W in one pass)",
        "stage 0: no I",
        "numbers in bars: the microbatch",
    ]


@pytest.mark.parametrize("n_microbatches", [8, 64])
def test_draw_labels_sit_inside_their_bars_or_are_dropped(n_microbatches: int) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    sim = simulate(ScheduleZBVZeroBubble, 4, n_microbatches, UNIT)
    for own, fig in ((True, sim.draw()), (False, Figure(figsize=(5, 3)))):
        if not own:  # drawn into the caller's axes, laid out after
            sim.draw(ax=fig.add_subplot(2, 1, 1))
            fig.tight_layout()
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        renderer = canvas.get_renderer()
        ax = fig.axes[0]
        labels = [a for a in ax.texts if hasattr(a, "drawn")]
        assert len(labels) == len(sim.timeline)
        drawn = [a for a in labels if a.drawn]
        if own:  # 8 inches wide: labels fit at 8 microbatches, not all at 64
            assert drawn if n_microbatches == 8 else len(drawn) < len(labels)
        for label in drawn:  # within its own bar: labels of different bars never touch
            t, b = label.get_window_extent(renderer), label.bar.get_window_extent(renderer)
            assert b.x0 <= t.x0 and t.x1 <= b.x1, label.get_text()


# --- every action respects its dependencies -------------------------------------------------

costs_st = st.builds(
    StageCosts,
    forward=st.floats(0, 5),
    backward_input=st.floats(0, 5),
    backward_weight=st.floats(0, 5),
    backward=st.none() | st.floats(0, 10),
    send=st.floats(0, 3),
    overhead=st.floats(0, 1),
)


@st.composite
def cases(draw: st.DrawFn) -> tuple[type, int, int, int, list[StageCosts]]:
    schedule = draw(st.sampled_from(SINGLE + MULTI))
    p = draw(st.integers(1, 5))
    per_rank = 1 if schedule in SINGLE else 2
    if schedule in (ScheduleInterleaved1F1B, ScheduleLoopedBFS, ScheduleInterleavedZeroBubble):
        per_rank = draw(st.integers(1, 3))
    n_stages = p * per_rank
    low = n_stages if schedule in (Schedule1F1B, ScheduleDualPipeV) else 1
    m = draw(st.integers(low, max(low, 3 * p)))
    costs = draw(st.lists(costs_st, min_size=n_stages, max_size=n_stages))
    return schedule, n_stages, p, m, costs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(cases())
def test_every_action_respects_its_dependencies(
    case: tuple[type, int, int, int, list[StageCosts]],
) -> None:
    schedule, n_stages, p, m, costs = case
    try:
        sim = simulate(schedule, n_stages, m, costs, n_ranks=p)
    except customgrad.ArgumentValueError as e:  # shapes torch's schedule refuses
        assume("cannot run" not in str(e))
        raise
    rank_of = sim.stage_to_rank
    by_key = {(a.stage, a.kind, a.microbatch): a for a in sim.timeline}
    assert len(by_key) == len(sim.timeline)  # no action twice

    def handoff(src: int, dst: int) -> float:
        return 0.0 if rank_of[src] == rank_of[dst] else costs[src].send

    for s in range(n_stages):
        for mb in range(m):
            # every microbatch goes forward once and backward once (B, or I and W)
            assert (s, "F", mb) in by_key
            full = (s, "B", mb) in by_key
            assert full != ((s, "I", mb) in by_key)
            assert ((s, "I", mb) in by_key) == ((s, "W", mb) in by_key)
    for a in sim.timeline:
        assert a.rank == rank_of[a.stage]
        assert a.duration == pytest.approx(costs[a.stage].cost(a.kind), abs=1e-9)
        needs: list[float] = []
        if a.kind == "F" and a.stage > 0:
            needs.append(by_key[a.stage - 1, "F", a.microbatch].end + handoff(a.stage - 1, a.stage))
        if a.kind in ("I", "B"):
            needs.append(by_key[a.stage, "F", a.microbatch].end)
            if a.stage < n_stages - 1:
                nxt = (
                    by_key.get((a.stage + 1, "I", a.microbatch))
                    or by_key[a.stage + 1, "B", a.microbatch]
                )
                needs.append(nxt.end + handoff(a.stage + 1, a.stage))
        if a.kind == "W":
            needs.append(by_key[a.stage, "I", a.microbatch].end)
        assert all(a.start >= t - 1e-9 for t in needs)
    for rank in range(p):
        actions = sim.actions(rank)
        # in the order of torch's list for the rank, one at a time, starting as soon as the
        # rank is free and the inputs are there (no idle time the dependencies don't explain)
        prev_end = 0.0
        for a in actions:
            assert a.start >= prev_end + costs[a.stage].overhead - 1e-9
            prev_end = a.end
        assert sim.busy[rank] == pytest.approx(sum(a.duration for a in actions))
    assert sim.step_time == pytest.approx(max((a.end for a in sim.timeline), default=0.0))
    if sim.step_time > 0:  # all-zero costs give a zero step, whose bubble is undefined
        assert 0.0 <= sim.bubble <= 1.0
        # fully idle only when nothing computes (the runtime's overhead is not busy time); a
        # busy share below float resolution next to 1 rounds the bubble to 1
        if sum(sim.busy) == 0:
            assert sim.bubble == 1.0
        if sum(sim.busy) > 1e-9 * sim.n_ranks * sim.step_time:
            assert sim.bubble < 1.0


@settings(max_examples=80, deadline=None)
@given(cases())
def test_actions_start_as_soon_as_they_can(
    case: tuple[type, int, int, int, list[StageCosts]],
) -> None:
    # Every start is the rank's previous end (+ the runtime's overhead) or the end (+ hand-over)
    # of something it needs.
    schedule, n_stages, p, m, costs = case
    try:
        sim = simulate(schedule, n_stages, m, costs, n_ranks=p)
    except customgrad.ArgumentValueError as e:
        assume("cannot run" not in str(e))
        raise
    by_key = {(a.stage, a.kind, a.microbatch): a for a in sim.timeline}
    rank_of = sim.stage_to_rank

    def ready(stage: int, kind: str, mb: int, src: int) -> float:
        a = by_key.get((stage, kind, mb))
        if a is None:
            return -math.inf
        return a.end + (0.0 if rank_of[stage] == rank_of[src] else costs[stage].send)

    for rank in range(p):
        prev = 0.0
        for a in sim.actions(rank):
            s, mb = a.stage, a.microbatch
            candidates = [prev + costs[s].overhead]
            if a.kind == "F" and s > 0:
                candidates.append(ready(s - 1, "F", mb, s))
            if a.kind in ("I", "B"):
                candidates.append(ready(s, "F", mb, s))
                candidates += [ready(s + 1, "I", mb, s), ready(s + 1, "B", mb, s)]
            if a.kind == "W":
                candidates.append(ready(s, "I", mb, s))
            assert a.start == pytest.approx(max(candidates), abs=1e-9)
            prev = a.end


@settings(max_examples=40, deadline=None)
@given(
    f=st.floats(0.01, 5),
    b=st.floats(0.01, 5),
    send=st.floats(0, 2),
    m=st.integers(16, 32),
)
def test_1f1b_bubble_grows_with_the_number_of_stages(
    f: float, b: float, send: float, m: int
) -> None:
    costs = StageCosts(f, b / 2, b / 2, send=send)
    bubbles = [simulate(Schedule1F1B, p, m, costs).bubble for p in range(1, 17)]
    assert bubbles[0] == pytest.approx(0.0)
    assert all(later > earlier for earlier, later in itertools.pairwise(bubbles))
    if send == 0:
        assert bubbles == pytest.approx([(p - 1) / (m + p - 1) for p in range(1, 17)])


def test_action_lists_come_from_torch() -> None:
    # The simulator replays the order torch's schedule gives each rank (Nones and
    # REDUCE_GRAD dropped, OVERLAP_F_B unfolded), never its own.
    for schedule in MULTI:
        sim = simulate(schedule, 4, 8, UNIT)
        built = schedule(
            [_StandInStage(0, 4, 2, 0), _StandInStage(2, 4, 2, 0)],  # type: ignore[list-item]
            8,
        )
        for rank in range(2):
            expected = []
            for a in built.pipeline_order[rank]:
                if a is None:
                    continue
                for part in a.sub_actions or (a,):
                    if part.computation_type.value in "FIWB":
                        kind = part.computation_type.value
                        expected.append((part.stage_index, kind, part.microbatch_index))
            got = [(a.stage, a.kind, a.microbatch) for a in sim.actions(rank)]
            assert sorted(got, key=expected.index) == expected
            assert sorted(got) == sorted(expected)


# --- the guide's example runs ---------------------------------------------------------------


def test_guide_example_runs_and_prints_what_it_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    page = Path(__file__).resolve().parents[1] / "docs" / "pipelines" / "timing-and-simulation.md"
    text = page.read_text()
    code = "\n".join(re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL))
    assert "simulate(" in code
    monkeypatch.chdir(tmp_path)
    scope: dict[str, object] = {"__name__": "guide"}
    exec(compile(code, str(page), "exec"), scope)
    assert len(scope["fig"].axes[0].patches) == len(scope["zbv"].timeline)  # type: ignore[attr-defined]
    assert not list(tmp_path.iterdir())  # the page writes no file when it runs
    printed = "".join(re.findall(r"prints\n\n```text\n(.*?)```", text, flags=re.DOTALL))
    assert capsys.readouterr().out == printed


# --- mixture of experts: all-to-all costs, and weight work hiding them ---------------------

MOE = StageCosts(1.0, 1.0, 1.0, dispatch=0.25, combine=0.5)


def close(got: list[tuple[object, ...]], want: list[tuple[object, ...]]) -> bool:
    """Equal, numbers to rounding (the replay splits an action's compute into thirds)."""
    return len(got) == len(want) and all(
        len(g) == len(w)
        and all(x == pytest.approx(y) if isinstance(y, float) else x == y for x, y in zip(g, w))
        for g, w in zip(got, want)
    )


def test_all_to_alls_add_to_forwards_and_input_gradients_by_hand() -> None:
    # 1F1B on one rank: every F and B waits 0.75 s for its two all-to-alls, with or without
    # the overlap (a full backward leaves no W to hide them).
    for overlap in (False, True):
        sim = simulate(Schedule1F1B, 1, 2, MOE, overlap=overlap)
        assert close(spans(sim, 0), [("0F", 0, 0.0, 1.75), ("0B", 0, 1.75, 4.5),
                                     ("0F", 1, 4.5, 6.25), ("0B", 1, 6.25, 9.0)])  # fmt: skip
        # a forward dispatches, then combines; a backward sends the gradients the other way
        assert close([(c.label, c.kind, c.start, c.end) for c in sim.comms[:4]], [
            ("dispatch", "F", 1 / 3, 1 / 3 + 0.25), ("combine", "F", 1 / 3 + 0.25 + 1 / 3, 1.75 - 1 / 3),
            ("combine", "B", 1.75 + 2 / 3, 1.75 + 2 / 3 + 0.5), ("dispatch", "B", 4.5 - 2 / 3 - 0.25, 4.5 - 2 / 3),
        ])  # fmt: skip
        assert sim.hidden == 0 and sim.exposed == pytest.approx(4 * 0.75)


def test_dual_pipe_v_overlap_runs_the_b_s_w_inside_the_f_s_dispatch_by_hand() -> None:
    plain = simulate(ScheduleDualPipeV, 2, 4, MOE, n_ranks=1)
    sim = simulate(ScheduleDualPipeV, 2, 4, MOE, n_ranks=1, overlap=True)
    # (1F1;0B0) becomes 0I0, then 1F1 with 0W0 in its dispatch wait: W (1 s) outlasts the
    # dispatch (0.25 s), which it hides whole; the combine stays exposed.
    i0 = next(a for a in sim.timeline if (a.stage, a.kind, a.microbatch) == (0, "I", 0))
    f1 = next(a for a in sim.timeline if (a.stage, a.kind, a.microbatch) == (1, "F", 1))
    w0 = next(a for a in sim.timeline if (a.stage, a.kind, a.microbatch) == (0, "W", 0))
    assert i0.end == pytest.approx(f1.start) and w0.in_wait
    assert w0.start == pytest.approx(f1.start + 1 / 3) and w0.duration == 1.0
    assert f1.duration == pytest.approx(1.0 + 1.0 + 0.5)  # compute, W over the dispatch, combine
    (dispatch,) = [c for c in sim.comms if c.start == w0.start]
    assert close([(dispatch.label, dispatch.overlapped, dispatch.hidden, dispatch.exposed)],
                 [("dispatch", 1.0, 0.25, 0.0)])  # fmt: skip
    # five overlapped pairs, each hiding one dispatch
    assert sim.hidden == pytest.approx(5 * 0.25)
    assert plain.step_time - sim.step_time == pytest.approx(5 * 0.25)
    assert sum(a.in_wait for a in sim.timeline) == 5


def test_zbv_overlap_defers_a_w_into_the_next_forward() -> None:
    sim = simulate(ScheduleZBVZeroBubble, 2, 4, MOE, n_ranks=1, overlap=True)
    order = [(f"{a.stage}{a.kind}{a.microbatch}", a.in_wait) for a in sim.actions(0)]
    # torch's 1I0 1W0 0F1: the W runs inside 0F1's dispatch wait
    assert order[2:5] == [("1I0", False), ("0F1", False), ("1W0", True)]
    assert simulate(ScheduleZBVZeroBubble, 2, 4, MOE, n_ranks=1).step_time - sim.step_time == (
        pytest.approx(sim.hidden))  # fmt: skip


def test_a_short_w_leaves_the_rest_of_the_all_to_all_exposed() -> None:
    costs = StageCosts(1.0, 1.0, 0.1, dispatch=0.25)
    sim = simulate(ScheduleDualPipeV, 2, 4, costs, n_ranks=1, overlap=True)
    carrying = [c for c in sim.comms if c.overlapped]
    assert carrying and all(c.hidden == pytest.approx(0.1) for c in carrying)
    assert all(c.exposed == pytest.approx(0.15) for c in carrying)


def test_without_all_to_all_costs_the_overlap_changes_nothing() -> None:
    for schedule in (ScheduleZBVZeroBubble, ScheduleDualPipeV):
        plain, hidden = simulate(schedule, 4, 8, UNIT), simulate(schedule, 4, 8, UNIT, overlap=True)
        assert hidden.step_time == plain.step_time and not hidden.comms and hidden.hidden == 0


moe_costs_st = st.builds(
    StageCosts,
    forward=st.floats(0, 5),
    backward_input=st.floats(0, 5),
    backward_weight=st.floats(0, 5),
    backward=st.none() | st.floats(0, 10),
    send=st.floats(0, 1),
    dispatch=st.floats(0, 3),
    combine=st.floats(0, 3),
)


@settings(max_examples=80, deadline=None)
@given(
    schedule=st.sampled_from(
        (Schedule1F1B, ScheduleZBVZeroBubble, ScheduleDualPipeV, ScheduleInterleavedZeroBubble)
    ),
    p=st.integers(1, 4),
    extra=st.integers(0, 4),
    overlap=st.booleans(),
    data=st.data(),
)
def test_every_all_to_all_is_waited_for_whole_and_every_w_runs_once(
    schedule: type, p: int, extra: int, overlap: bool, data: st.DataObject
) -> None:
    n_stages = p if schedule is Schedule1F1B else 2 * p
    m = n_stages + extra
    costs = data.draw(st.lists(moe_costs_st, min_size=n_stages, max_size=n_stages))
    try:
        sim = simulate(schedule, n_stages, m, costs, n_ranks=None if schedule is Schedule1F1B
                       else p, overlap=overlap)  # fmt: skip
    except customgrad.ArgumentValueError as e:
        assume("cannot run" not in str(e))
        raise
    keys = [(a.stage, a.kind, a.microbatch) for a in sim.timeline]
    assert len(set(keys)) == len(keys)  # every action once, a W inside a wait or in its slot
    for c in sim.comms:  # hidden + exposed is the whole all-to-all
        cost = getattr(costs[c.stage], c.label)
        assert c.in_flight == pytest.approx(cost, abs=1e-9)
        assert c.overlapped == 0 or (c.kind == "F" and overlap)
    for a in sim.timeline:  # compute, plus the waits: exposed, or filled by the W inside
        if a.in_wait:
            continue
        nested = sum(
            n.duration
            for n in sim.timeline
            if n.in_wait and n.rank == a.rank and a.start <= n.start and n.end <= a.end
        )
        waits = [
            w
            for w in sim.comms
            if (w.rank, w.stage, w.kind, w.microbatch) == (a.rank, a.stage, a.kind, a.microbatch)
        ]
        assert a.duration == pytest.approx(
            costs[a.stage].cost(a.kind) + sum(w.exposed for w in waits) + nested, abs=1e-9
        )  # fmt: skip
        assert nested == pytest.approx(sum(w.overlapped for w in waits), abs=1e-9)
    if p == 1 and schedule is not Schedule1F1B:
        # One rank: the overlap saves what it hides (where B costs I + W: an overlapped pair's
        # B runs as I, then W, with the overlap)
        costs = [dataclasses.replace(c, backward=None) for c in costs]
        plain = simulate(schedule, n_stages, m, costs, n_ranks=1)
        hidden = simulate(schedule, n_stages, m, costs, n_ranks=1, overlap=True)
        assert plain.step_time - hidden.step_time == pytest.approx(hidden.hidden, abs=1e-6)
