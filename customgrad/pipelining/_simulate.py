"""Predict a pipeline schedule's step time and bubble from per-action costs.

Renting a cluster to learn what a zero-bubble schedule gives at 64 stages is expensive; replaying
the schedule is not. ``simulate`` asks torch for the schedule's own action lists (each
rank's ``pipeline_order``, built by the schedule class itself from stand-in stages, so the
simulator never disagrees with the schedules it models) and replays them against per-stage costs:
every rank runs its list in order, and an action starts when its rank is free and its inputs
have arrived.

Two facts about the split backward make the prediction worth having. customgrad ops do each
backward matmul once, split between I and W; a plain ``torch.autograd.Function`` (or a
``torch.library.custom_op``) runs its whole backward in both I and W under torch's split, which
``StageCosts.repeating_backward`` expresses. The same schedule then predicts very different
step times for the two.

Mixture-of-experts stages add the expert all-to-alls (``StageCosts.dispatch`` and ``combine``):
paid in every forward and input-gradient backward, and, with ``overlap=True``, hidden in forwards
behind weight work already queued on the rank, as :meth:`WeightGradQueue.overlap
<customgrad.pipelining.WeightGradQueue.overlap>` and :func:`~customgrad.pipelining.
overlap_forward_backward` run it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

from customgrad._errors import ArgumentTypeError, ArgumentValueError
from customgrad.pipelining._draw import Bar, comm_bars, draw_timeline
from customgrad.pipelining._draw import seconds as _seconds

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
    )

__all__ = ["CommWait", "Simulation", "StageCosts", "TimedAction", "simulate"]

Kind = Literal["F", "I", "W", "B"]


MSG_SCHEDULE_CLASS = """\
simulate: expected one of torch.distributed.pipelining's schedule classes (or its name), got \
{got}. Pass the class itself, for example:

    from torch.distributed.pipelining import ScheduleZBVZeroBubble
    simulate(ScheduleZBVZeroBubble, 4, 8, costs)      # right
    simulate("ZBVZeroBubble", 4, 8, costs)            # right: torch's name for it
    simulate(ScheduleZBVZeroBubble(stages, 8), ...)   # wrong: an instance
"""

USE_A_SCHEDULE = (
    "Use a schedule that trains: Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, "
    "ScheduleLoopedBFS, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, "
    "ScheduleDualPipeV, or a subclass of one."
)


@dataclasses.dataclass(frozen=True)
class StageCosts:
    """Seconds one stage's actions take, per microbatch.

    ``send`` is paid on the way between ranks only, after the action whose output is handed
    over (an activation forward, an activation gradient backward) and before the receiving
    action may start; it does not keep either rank busy (torch posts its sends asynchronously).
    Two neighbouring stages on one rank (the bottom of a V) hand over locally, for free.
    ``dispatch`` and ``combine`` are a mixture-of-experts stage's all-to-alls under expert
    parallelism: a forward sends its tokens to their experts' ranks (dispatch) and the experts'
    outputs back (combine); its input-gradient backward (I, or B) sends their gradients the other
    way at the same cost; W has none. They add to ``forward``, ``backward_input`` and
    ``backward``, which are compute only; the replay waits for each once per action (a stage with
    several MoE layers gives their sums). ``overhead`` is the schedule runtime's own time on the rank before each of the stage's
    actions (its Python, posting sends and receives): the rank is not free for it, but it
    overlaps a wait for the action's inputs, and it is not counted as busy.

    Example:
        >>> StageCosts(forward=1.0, backward_input=1.0, backward_weight=1.0).full_backward
        2.0
        >>> StageCosts.repeating_backward(forward=1.0, backward=2.0).backward_weight
        2.0
        >>> StageCosts(1.0, 1.0, 1.0, dispatch=0.25, combine=0.25).comm("F")
        0.5
    """

    forward: float
    backward_input: float
    backward_weight: float
    backward: float | None = None  # a full backward (B); None: backward_input + backward_weight
    send: float = 0.0  # handing an activation or gradient to the next stage's rank
    overhead: float = 0.0  # the runtime's own time on the rank before each action
    dispatch: float = 0.0  # a forward's all-to-all of its tokens to their experts
    combine: float = 0.0  # a forward's all-to-all of the experts' outputs back

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None and field.name == "backward":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ArgumentTypeError(
                    f"StageCosts: {field.name} is a {type(value).__name__} ({value!r}), expected "
                    f"seconds as a float. Pass a number, e.g. {field.name}=0.004."
                )
            if not math.isfinite(value) or value < 0:
                raise ArgumentValueError(
                    f"StageCosts: {field.name} is {value!r} seconds, expected a finite number "
                    f">= 0. Pass the measured seconds per microbatch (0.0 for an action that "
                    f"costs nothing)."
                )

    @property
    def full_backward(self) -> float:
        """Seconds of a full backward (B): ``backward``, or ``backward_input + backward_weight``."""
        if self.backward is not None:
            return self.backward
        return self.backward_input + self.backward_weight

    @classmethod
    def repeating_backward(
        cls,
        forward: float,
        backward: float,
        *,
        send: float = 0.0,
        overhead: float = 0.0,
        dispatch: float = 0.0,
        combine: float = 0.0,
    ) -> StageCosts:
        """Costs of a stage whose backward runs whole in both I and W.

        That is what plain ``torch.autograd.Function``\\ s and ``torch.library.custom_op``\\ s do
        under torch's split backward (their ``needs_input_grad`` is fixed at forward time): I
        and W each cost a full backward, a full backward (B) costs one.

        Args:
            forward: seconds of the stage's forward.
            backward: seconds of the stage's full backward, done once.
            send: seconds to hand an activation or gradient to another rank.
            overhead: the runtime's own seconds before each action.
            dispatch: seconds of the stage's all-to-all to its experts, per action.
            combine: seconds of the all-to-all back, per action.

        Example:
            >>> c = StageCosts.repeating_backward(1.0, 2.0)
            >>> c.backward_input, c.backward_weight, c.full_backward
            (2.0, 2.0, 2.0)
        """
        return cls(forward, backward, backward, backward=backward, send=send, overhead=overhead,
                   dispatch=dispatch, combine=combine)  # fmt: skip

    def comm(self, kind: Kind) -> float:
        """Seconds of all-to-all one action of ``kind`` waits for (``dispatch + combine``; 0 for W)."""
        return 0.0 if kind == "W" else self.dispatch + self.combine

    def cost(self, kind: Kind) -> float:
        """Seconds one action of ``kind`` (``"F"``, ``"I"``, ``"W"`` or ``"B"``) computes."""
        if kind == "F":
            return self.forward
        if kind == "I":
            return self.backward_input
        if kind == "W":
            return self.backward_weight
        return self.full_backward


@dataclasses.dataclass(frozen=True)
class TimedAction:
    """One action of the replayed schedule: what ran where, and when (seconds from step start).

    ``in_wait``: a W that ran inside another action's all-to-all wait (see :class:`CommWait`).
    """

    rank: int
    stage: int
    microbatch: int
    kind: Kind
    start: float
    end: float
    in_wait: bool = False

    @property
    def duration(self) -> float:
        """``end - start``."""
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class CommWait:
    """One all-to-all an action waited for, and the weight work its rank ran meanwhile.

    Measured (:class:`~customgrad.pipelining.ActionTimer`, from each
    :meth:`WeightGradQueue.run_while <customgrad.pipelining.WeightGradQueue.run_while>` call) or
    replayed (:func:`simulate`); times in seconds from the step's start.

    Attributes:
        label: what the collective was, as its caller named it (``"dispatch"``, ``"combine"``).
        kind: the action it happened in: ``"F"``, ``"I"`` or ``"B"``.
        stage: that action's stage.
        microbatch: that action's microbatch.
        start: when the wait began, the collective in flight.
        end: when the wait returned.
        overlapped: seconds of W the rank ran inside the wait.
        hidden: of the collective's time in flight, the seconds that W covered (measured: up to
            the W that was running when the collective was first seen complete).
        rank: the rank that waited.
    """

    label: str
    kind: str
    stage: int
    microbatch: int
    start: float
    end: float
    overlapped: float = 0.0
    hidden: float = 0.0
    rank: int = 0

    @property
    def exposed(self) -> float:
        """Seconds the rank was blocked in the wait, with nothing to run."""
        return max(0.0, self.end - self.start - self.overlapped)

    @property
    def in_flight(self) -> float:
        """Seconds the collective took as the rank saw it: ``hidden + exposed``."""
        return self.hidden + self.exposed


@dataclasses.dataclass(frozen=True)
class Simulation:
    """A schedule replayed against costs: the timeline and what it adds up to.

    Attributes:
        schedule: the schedule class's name, e.g. ``"ScheduleZBVZeroBubble"``.
        n_stages: number of pipeline stages.
        n_ranks: number of pipeline ranks (torch's ``pp_group_size``).
        n_microbatches: microbatches per step.
        stage_to_rank: the rank of each stage, as the schedule placed them.
        timeline: every compute action, by rank then start time (a W run inside another
            action's all-to-all wait lies within that action's span, ``in_wait`` set).
        step_time: seconds from the step's start (every rank starts at 0) to the last action's
            end.
        busy: seconds each rank spends in actions (waits for all-to-alls inside them included).
        comms: every all-to-all wait, by rank then start time (none without all-to-all costs).
    """

    schedule: str
    n_stages: int
    n_ranks: int
    n_microbatches: int
    stage_to_rank: tuple[int, ...]
    timeline: tuple[TimedAction, ...]
    step_time: float
    busy: tuple[float, ...]
    comms: tuple[CommWait, ...] = ()

    @property
    def hidden(self) -> float:
        """Seconds of all-to-all that weight work hid, over all ranks."""
        return sum(c.hidden for c in self.comms)

    @property
    def exposed(self) -> float:
        """Seconds ranks were blocked waiting for all-to-alls, over all ranks."""
        return sum(c.exposed for c in self.comms)

    @property
    def bubble(self) -> float:
        """Idle fraction of rank-time over the step: ``1 - sum(busy) / (n_ranks * step_time)``."""
        if self.step_time <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.n_ranks * self.step_time)

    def actions(self, rank: int) -> tuple[TimedAction, ...]:
        """The actions ``rank`` runs, in order."""
        return tuple(a for a in self.timeline if a.rank == rank)

    def summary(self) -> str:
        """One line: schedule, shape, step time and bubble (and all-to-all hidden / exposed)."""
        comm = (
            f", all-to-all {_seconds(self.hidden)} hidden / {_seconds(self.exposed)} exposed"
            if self.comms
            else ""
        )
        return (
            f"{self.schedule}: {self.n_stages} stages on {self.n_ranks} ranks, "
            f"{self.n_microbatches} microbatches: step {_seconds(self.step_time)}, "
            f"bubble {self.bubble:.1%}{comm}"
        )

    def draw(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        ax: Axes | None = None,
        title: str | None = None,
        notes: Sequence[str] = (),
    ) -> Figure:
        """Draw the timeline like a pipeline picture: ranks as rows, one bar per action.

        F, I, W and B have their own colours; each bar is labelled with its microbatch when
        the number fits (else the label is dropped), and a rank's second stage (V and
        interleaved schedules) is drawn lighter; the legend says so. All-to-alls are a thin band
        under their action (hidden behind W, or exposed), and a W run inside one is drawn over
        the action it ran in. Uses matplotlib without
        pyplot (no global state).

        Args:
            path: where to save the picture (PNG, SVG, ... by suffix); None: don't save.
            ax: axes to draw into; None: a new figure.
            title: the title; None: ``summary``.
            notes: lines of explanation added to the legend.

        Returns:
            The figure drawn on.

        Example:
            >>> from torch.distributed.pipelining import Schedule1F1B
            >>> sim = simulate(Schedule1F1B, 2, 4, StageCosts(1.0, 1.0, 1.0))
            >>> fig = sim.draw()
            >>> len(fig.axes[0].patches) == len(sim.timeline)
            True
        """
        first_stage = {r: min(s for s, rr in enumerate(self.stage_to_rank) if rr == r)
                       for r in set(self.stage_to_rank)}  # fmt: skip
        bars = [
            Bar(
                a.kind,
                a.rank,
                a.start,
                a.duration,
                str(a.microbatch),
                second=a.stage != first_stage[a.rank],
                over=a.in_wait,
            )
            for a in self.timeline
        ]
        bars.extend(comm_bars(self.comms, {r: r for r in range(self.n_ranks)}))
        return draw_timeline(
            bars,
            rows=[f"rank {r}" for r in range(self.n_ranks)],
            span=self.step_time,
            title=self.summary() if title is None else title,
            path=path,
            ax=ax,
            notes=notes,
        )


def simulate(
    schedule_class: type[PipelineScheduleSingle] | type[PipelineScheduleMulti] | str,
    n_stages: int,
    n_microbatches: int,
    costs: StageCosts | Sequence[StageCosts],
    *,
    n_ranks: int | None = None,
    overlap: bool = False,
) -> Simulation:
    """Replay a torch pipeline schedule against per-stage costs; predict step time and bubble.

    The schedule class builds its own action lists from stand-in stages (no process group,
    no model), exactly as it would for a run. Each rank then runs its list in order: an action
    starts when its rank is free and its inputs are there. F of stage ``s`` needs F of stage
    ``s - 1``; I or B of stage ``s`` needs its own F and the input gradient from I or B of stage
    ``s + 1``; W needs the same stage's I. Handing over between ranks costs the sending stage's
    ``send``; between two stages on one rank (the bottom of a V) it is free. DualPipeV's
    overlapped F+B actions run their two halves one after the other, as torch's runtime does.

    Stages with all-to-all costs (``StageCosts.dispatch``, ``combine``) wait for them inside
    their forwards and input-gradient backwards. With ``overlap``, as
    :func:`~customgrad.pipelining.overlap_forward_backward` runs a schedule: a W that comes
    right before a forward on its rank is deferred into that forward, and DualPipeV's overlapped
    F+B actions run the B's I first, then the F with the B's W deferred into it. A forward's
    all-to-all waits run the W deferred into it (one at least, more while the all-to-all is in
    flight); what they leave runs right after the forward. A backward never runs W in its waits.

    Single-stage schedules (``Schedule1F1B``, ``ScheduleGPipe``) run microbatches in order,
    counting forwards and backwards per stage; their ``pipeline_order`` is taken for the order
    of F and B only (torch 2.13's ``Schedule1F1B`` numbers the last rank's forwards from 1).

    Args:
        schedule_class: a ``torch.distributed.pipelining`` schedule class, e.g.
            ``ScheduleZBVZeroBubble``, or torch's name for it (``"ZBVZeroBubble"``).
        n_stages: number of pipeline stages.
        n_microbatches: microbatches per step.
        costs: one ``StageCosts`` for every stage, or one per stage (by stage index).
        n_ranks: pipeline ranks. Default: one stage per rank for single-stage schedules, two
            for multi-stage ones (which ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``
            require).
        overlap: hide all-to-alls behind queued weight work, as described above.

    Returns:
        Simulation: the timeline, step time, bubble and busy time per rank.

    Raises:
        ArgumentTypeError: ``schedule_class`` is not a schedule class or name, or ``costs``
            are not ``StageCosts``.
        ArgumentValueError: an unknown schedule name, or stages, ranks and microbatches the
            schedule cannot run.

    Example:
        1F1B on 2 ranks with 4 microbatches takes ``(m + p - 1) * (F + B)``:

        >>> from torch.distributed.pipelining import Schedule1F1B, ScheduleZBVZeroBubble
        >>> simulate(Schedule1F1B, 2, 4, StageCosts(1.0, 1.0, 1.0)).step_time
        15.0
        >>> sim = simulate(ScheduleZBVZeroBubble, 4, 8, StageCosts(1.0, 1.0, 1.0))
        >>> sim.n_ranks, sim.step_time, round(sim.bubble, 3)
        (2, 49.0, 0.02)

        Two MoE stages on one rank (experts on other ranks), each forward and backward waiting
        0.5 s for its all-to-alls: with the overlap, each of DualPipeV's five overlapped F+B
        pairs hides its forward's dispatch (0.25 s) behind the B's W:

        >>> from torch.distributed.pipelining import ScheduleDualPipeV
        >>> moe = StageCosts(1.0, 1.0, 1.0, dispatch=0.25, combine=0.25)
        >>> plain = simulate(ScheduleDualPipeV, 2, 4, moe, n_ranks=1)
        >>> hidden = simulate(ScheduleDualPipeV, 2, 4, moe, n_ranks=1, overlap=True)
        >>> plain.step_time, round(hidden.step_time, 9), hidden.hidden
        (32.0, 30.75, 1.25)
    """
    cls = _schedule_class(schedule_class)
    single = _is_single(cls)
    n_ranks = _check_shape(cls, single, n_stages, n_microbatches, n_ranks)
    stage_costs = _stage_costs(costs, n_stages)
    key = cast("Hashable", cls)  # classes are hashable; the cache keys on them
    order, stage_to_rank = _action_lists(key, single, n_stages, n_microbatches, n_ranks)
    if overlap:
        order = _overlapped(order)
    replay = _Replay(order, stage_to_rank, stage_costs, overlap)
    replay.run(cls.__name__)
    return Simulation(
        schedule=cls.__name__,
        n_stages=n_stages,
        n_ranks=n_ranks,
        n_microbatches=n_microbatches,
        stage_to_rank=stage_to_rank,
        timeline=tuple(sorted(replay.timeline, key=lambda a: (a.rank, a.start, a.end))),
        step_time=max(replay.free, default=0.0),
        busy=tuple(replay.busy),
        comms=tuple(sorted(replay.comms, key=lambda c: (c.rank, c.start))),
    )


# --- building torch's action lists ---------------------------------------------------------


class _StandInStage:
    """What a schedule's constructor reads from a stage, without a model or a process group."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int, group_rank: int):
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}


def _schedule_class(schedule_class: object) -> type[Any]:
    from torch.distributed.pipelining import schedules

    if isinstance(schedule_class, str):
        try:
            found: type[Any] = schedules.get_schedule_class(schedule_class)
        except ValueError:
            names = ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                     "ZBVZeroBubble", "DualPipeV")  # fmt: skip
            raise ArgumentValueError(
                f"simulate: unknown schedule name {schedule_class!r}. torch's schedule names: "
                f"{', '.join(names)}; or pass a schedule class."
            ) from None
        return found
    bases = (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti)
    if not (isinstance(schedule_class, type) and issubclass(schedule_class, bases)):
        raise ArgumentTypeError(MSG_SCHEDULE_CLASS.format(got=repr(schedule_class)))
    if inspect.isabstract(schedule_class):
        raise ArgumentValueError(
            f"simulate: {schedule_class.__name__} is an abstract base class, with no action "
            f"list to replay. {USE_A_SCHEDULE}"
        )
    return schedule_class


def _is_single(cls: type[Any]) -> bool:
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    return issubclass(cls, PipelineScheduleSingle)


def _check_shape(
    cls: type[Any], single: bool, n_stages: int, n_microbatches: int, n_ranks: int | None
) -> int:
    for name, value in (("n_stages", n_stages), ("n_microbatches", n_microbatches),
                        ("n_ranks", n_ranks)):  # fmt: skip
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ArgumentTypeError(
                f"simulate: {name} is a {type(value).__name__} ({value!r}), expected an int."
            )
        if value < 1:
            raise ArgumentValueError(f"simulate: {name} is {value}, expected at least 1.")
    name = cls.__name__
    if single:
        if n_ranks is not None and n_ranks != n_stages:
            raise ArgumentValueError(
                f"simulate: {name} runs one stage per rank, so {n_stages} stages need "
                f"{n_stages} ranks, got n_ranks={n_ranks}. Leave n_ranks out, or use a "
                f"multi-stage schedule (ScheduleInterleaved1F1B, ScheduleZBVZeroBubble, ...)."
            )
        return n_stages
    if n_ranks is None:
        if n_stages % 2:
            raise ArgumentValueError(
                f"simulate: {name} places several stages on each rank, and {n_stages} stages "
                f"do not make 2 per rank. Pass n_ranks= (n_stages must be a multiple of it), "
                f"or an even n_stages."
            )
        return n_stages // 2
    if n_stages % n_ranks:
        raise ArgumentValueError(
            f"simulate: {name} places the same number of stages on each rank, so n_stages "
            f"({n_stages}) must be a multiple of n_ranks ({n_ranks}). Pass n_stages="
            f"{n_ranks * max(1, round(n_stages / n_ranks))}, or another n_ranks."
        )
    return n_ranks


Step = tuple[int, Kind, int, bool]
"""One compute action of a rank's list: stage, kind, microbatch, and whether it is half of an
overlapped F+B action (DualPipeV's ``OVERLAP_F_B``)."""
Order = tuple[tuple[Step, ...], ...]


@functools.lru_cache(maxsize=32)  # torch's lowering passes take seconds at 64 ranks
def _action_lists(
    cls: type[Any], single: bool, n_stages: int, n_microbatches: int, n_ranks: int
) -> tuple[Order, tuple[int, ...]]:
    """Each rank's compute actions (:data:`Step`), and each stage's rank."""
    per_rank = n_stages // n_ranks
    stages = [_StandInStage(k * n_ranks, n_stages, n_ranks, 0) for k in range(per_rank)]
    try:
        schedule = cls(stages[0], n_microbatches) if single else cls(stages, n_microbatches)
    except (ValueError, AssertionError, RuntimeError) as e:
        raise ArgumentValueError(
            f"simulate: torch's {cls.__name__} cannot run {n_stages} stages on {n_ranks} "
            f"ranks ({per_rank} per rank) with {n_microbatches} microbatches: {e} Change "
            f"n_stages, n_ranks or n_microbatches to what the schedule supports."
        ) from None
    pipeline_order = getattr(schedule, "pipeline_order", None)
    if not pipeline_order:
        raise ArgumentValueError(
            f"simulate: {cls.__name__} has no action list (pipeline_order) to replay. "
            f"{USE_A_SCHEDULE}"
        )
    if single:
        stage_to_rank = tuple(range(n_stages))
    else:
        mapping: dict[int, int] = dict(schedule.stage_index_to_group_rank)
        stage_to_rank = tuple(mapping[s] for s in range(n_stages))
    order: list[list[Step]] = []
    for rank in range(n_ranks):
        actions: list[Step] = []
        for action in pipeline_order.get(rank, ()):
            if action is None:
                continue
            parts = action.sub_actions if action.sub_actions is not None else (action,)
            for part in parts:
                kind = part.computation_type.value
                if kind in ("F", "I", "W", "B"):  # not UNSHARD, RESHARD, REDUCE_GRAD, comms
                    paired = action.sub_actions is not None
                    actions.append((part.stage_index, kind, part.microbatch_index, paired))
        order.append(actions)
    if single:
        # torch's single-stage runtime counts microbatches per stage (fwd_mb_index,
        # bwd_mb_index); its pipeline_order is a picture whose indices may be off.
        for actions in order:
            counts: dict[tuple[int, str], int] = {}
            for i, (stage, kind, _, paired) in enumerate(actions):
                k = counts.get((stage, kind), 0)
                counts[stage, kind] = k + 1
                actions[i] = (stage, kind, k, paired)
    return tuple(tuple(actions) for actions in order), stage_to_rank


# --- replaying them ------------------------------------------------------------------------


def _stage_costs(costs: object, n_stages: int) -> tuple[StageCosts, ...]:
    if isinstance(costs, StageCosts):
        return (costs,) * n_stages
    if isinstance(costs, Sequence) and not isinstance(costs, str):
        bad = [i for i, c in enumerate(costs) if not isinstance(c, StageCosts)]
        if bad:
            raise ArgumentTypeError(
                f"simulate: costs[{bad[0]}] is a {type(costs[bad[0]]).__name__}, expected "
                f"StageCosts. Pass StageCosts(forward=..., backward_input=..., "
                f"backward_weight=...) for each stage."
            )
        if len(costs) != n_stages:
            raise ArgumentValueError(
                f"simulate: {len(costs)} StageCosts for {n_stages} stages. Pass one per stage, "
                f"in stage order, or a single StageCosts for all of them."
            )
        return tuple(costs)
    raise ArgumentTypeError(
        f"simulate: costs is a {type(costs).__name__}, expected StageCosts or a sequence of "
        f"them (one per stage)."
    )


def _overlapped(order: Order) -> Order:
    """Every rank's list as :func:`~customgrad.pipelining.overlap_forward_backward` runs it: an
    overlapped F+B pair as the B's I, then the F with the B's W deferred into it; a W right
    before a forward deferred into that forward. A deferred W is marked (its last field)."""
    out = []
    for actions in order:
        steps: list[Step] = []
        i = 0
        while i < len(actions):
            pair = actions[i : i + 2]
            kinds = sorted(k for _, k, _, paired in pair if paired)
            if kinds == ["B", "F"]:
                (fs, _, fm, _), (bs, _, bm, _) = sorted(pair, key=lambda a: a[1] != "F")
                steps += [(bs, "I", bm, False), (bs, "W", bm, True), (fs, "F", fm, False)]
                i += 2
                continue
            stage, kind, mb, _ = actions[i]
            following = actions[i + 1][1] if i + 1 < len(actions) else None
            steps.append((stage, kind, mb, kind == "W" and following == "F"))
            i += 1
        out.append(tuple(steps))
    return tuple(out)


class _Replay:
    """Every rank's list run in order; an action waits for its rank and for its inputs.

    Event-driven: a rank runs until its next action needs something not yet computed, then
    waits on that one thing; finishing an action wakes the ranks waiting on it.
    """

    def __init__(
        self, order: Order, stage_to_rank: tuple[int, ...], costs: tuple[StageCosts, ...],
        overlap: bool,
    ) -> None:  # fmt: skip
        self.order, self.stage_to_rank, self.costs, self.overlap = (
            order,
            stage_to_rank,
            costs,
            overlap,
        )
        ranks = range(len(order))
        self.free = [0.0 for _ in ranks]
        self.busy = [0.0 for _ in ranks]
        self.timeline: list[TimedAction] = []
        self.comms: list[CommWait] = []
        # W deferred into the rank's next forward (see _overlapped), oldest first.
        self.queued: list[list[tuple[int, int]]] = [[] for _ in ranks]

    def run(self, name: str) -> None:
        order, stage_to_rank, costs = self.order, self.stage_to_rank, self.costs
        n_stages = len(stage_to_rank)
        # done[(what, stage, mb)] = time the result can be used on the stage's own rank;
        # "F": the forward output, "dx": the input gradient (from I or B).
        done: dict[tuple[str, int, int], float] = {}
        waiting: dict[tuple[str, int, int], list[int]] = {}
        pos = [0 for _ in order]

        def send(src: int, dst: int) -> float:
            return 0.0 if stage_to_rank[src] == stage_to_rank[dst] else costs[src].send

        ready = list(reversed(range(len(order))))
        while ready:
            rank = ready.pop()
            actions = order[rank]
            while pos[rank] < len(actions):
                stage, kind, mb, deferred = actions[pos[rank]]
                if self.overlap and deferred:
                    self.queued[rank].append((stage, mb))  # for the next forward's waits
                    pos[rank] += 1
                    continue
                needs: list[tuple[tuple[str, int, int], float]]
                if kind == "F":
                    needs = [(("F", stage - 1, mb), send(stage - 1, stage))] if stage else []
                elif kind == "W":
                    needs = [(("dx", stage, mb), 0.0)]
                else:
                    needs = [(("F", stage, mb), 0.0)]
                    if stage < n_stages - 1:
                        needs.append((("dx", stage + 1, mb), send(stage + 1, stage)))
                start = self.free[rank] + costs[stage].overhead
                missing = None
                for key, delay in needs:
                    if key not in done:
                        missing = key
                        break
                    start = max(start, done[key] + delay)
                if missing is not None:
                    waiting.setdefault(missing, []).append(rank)
                    break
                end = self._action(rank, stage, kind, mb, start)
                self.timeline.append(TimedAction(rank, stage, mb, kind, start, end))
                self.free[rank] = end
                self.busy[rank] += end - start
                pos[rank] += 1
                if kind == "F":  # deferred W its waits left: right after it
                    for ws, wm in self.queued[rank]:
                        t = self.free[rank]
                        w_end = t + costs[ws].cost("W")
                        self.timeline.append(TimedAction(rank, ws, wm, "W", t, w_end))
                        self.free[rank] = w_end
                        self.busy[rank] += w_end - t
                    self.queued[rank].clear()
                if kind != "W":
                    key = ("F" if kind == "F" else "dx", stage, mb)
                    done[key] = end
                    ready.extend(waiting.pop(key, ()))
        stuck = {r: order[r][pos[r]] for r in range(len(order)) if pos[r] < len(order[r])}
        if stuck:  # a malformed action list; torch's own schedules never get here
            what = ", ".join(f"rank {r}: {s}{k}{m}" for r, (s, k, m, _) in sorted(stuck.items()))
            raise ArgumentValueError(
                f"simulate: {name}'s action lists cannot finish: actions wait on work no rank "
                f"does ({what}). Check the schedule's pipeline_order."
            )

    def _action(self, rank: int, stage: int, kind: Kind, mb: int, start: float) -> float:
        """Run one action from ``start``; returns its end. Its compute is split evenly around its
        all-to-all waits (a forward's dispatch then combine, a backward's the other way round);
        with ``overlap``, a forward's waits run the W deferred into it (one at least, more while
        the all-to-all is in flight)."""
        c = self.costs[stage]
        waits = [] if kind == "W" else [("dispatch", c.dispatch), ("combine", c.combine)]
        waits = [(label, s) for label, s in waits if s > 0]
        if kind != "F":
            waits.reverse()
        piece = c.cost(kind) / (len(waits) + 1)
        t = start + piece
        for label, seconds in waits:
            overlapped = 0.0
            queued = self.queued[rank] if kind == "F" else []
            n = 0
            while queued and (n == 0 or overlapped < seconds):
                ws, wm = queued.pop(0)
                w = self.costs[ws].cost("W")
                at = t + overlapped
                self.timeline.append(TimedAction(rank, ws, wm, "W", at, at + w, in_wait=True))
                overlapped += w
                n += 1
            end = t + max(seconds, overlapped)
            self.comms.append(
                CommWait(label, kind, stage, mb, t, end, overlapped, min(overlapped, seconds), rank)
            )
            t = end + piece
        return t
