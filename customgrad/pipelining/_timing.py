"""Time what pipeline stages do: every F / I / W / B action and every wait for a peer.

A zero-bubble schedule only pays off when the times it assumes hold: I and W each about as long
as F, no rank waiting for another. :class:`ActionTimer` measures them on a real run, for torch's
``PipelineStage`` and customgrad's, without patching torch: :meth:`ActionTimer.stage_class`
returns a subclass of the stage class that times the methods the schedules call per microbatch
(``forward_one_chunk``, ``backward_one_chunk``, ``backward_weight_one_chunk``) and notes when a
stage posts a receive (``get_fwd_recv_ops``, ``get_bwd_recv_ops``). torch offers no hook for
these (``register_custom_function`` replaces an action, and only on some schedules), so that
subclass lives alone in :mod:`customgrad.pipelining._timed_stage`, which checks the methods'
signatures on the torch it runs with.

Waits are read off the host clock: the schedule waits for a received tensor right before the
action that uses it, so the time between the rank's previous event and that action is the wait.
Time between events that no receive explains is the schedule's own (Python, posting sends,
waiting for sends): *other*. On CUDA every action is bracketed by ``torch.cuda.synchronize``,
so an action's time is its kernels' time.

Collectives waited for inside an action (an expert-parallel all-to-all) are recorded when the
wait goes through :meth:`WeightGradQueue.run_while
<customgrad.pipelining.WeightGradQueue.run_while>` (:class:`CommWait`: how long the collective
was in flight, how much of it weight work hid, how long the rank was blocked); a W run inside
such a wait is an action of its own, nested in the one that waited.

:meth:`ActionTimer.gather` brings every rank's steps together (:class:`StepTimeline`), whose
:meth:`~StepTimeline.breakdown` splits each rank's time into compute, waiting for the peer to
finish the action it depends on, transfer, and other; :func:`stage_costs` turns measured steps
into per-stage :class:`~customgrad.pipelining.StageCosts`, what the schedule simulator
replays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ParamSpec, TypeVar

import torch
import torch.distributed as dist

from customgrad._errors import ArgumentTypeError, ArgumentValueError
from customgrad._flops import FlopCounter
from customgrad._torch.pipelining import stage_base
from customgrad.pipelining._draw import Bar, comm_bars, draw_timeline
from customgrad.pipelining._errors import PipeliningError
from customgrad.pipelining._queue import RECORDER
from customgrad.pipelining._simulate import CommWait, StageCosts
from customgrad.pipelining._timed_stage import timed_stage_class

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "ActionEvent",
    "ActionTimer",
    "ActionTimerError",
    "RankBreakdown",
    "RankStep",
    "StepTimeline",
    "WaitEvent",
    "stage_costs",
]

KINDS = ("F", "I", "W", "B")
"""Action kinds: forward, input-gradient backward, weight-gradient backward, full backward."""

_S = TypeVar("_S", bound=type)
"""A pipeline stage class (a subclass of torch's private ``_PipelineStageBase``)."""
_P = ParamSpec("_P")
_R = TypeVar("_R")

MSG_NESTED_STEP = """\
ActionTimer.step: a step is already being timed on this timer. Time one schedule step at a \
time:

    for batch in batches:
        with timer.step():
            schedule.step(...)
"""


class ActionTimerError(PipeliningError):
    """An :class:`ActionTimer` was used out of order (e.g. a step inside a step)."""


@dataclass(frozen=True)
class ActionEvent:
    """One action of one stage on one microbatch; times in seconds since the step started.

    ``nested`` is the time of other actions run inside this one (W run in its all-to-all waits,
    recorded as actions of their own), ``comm`` the time it was blocked waiting for collectives
    (:class:`CommWait`\\ s' exposed parts); ``flops``, ``cpu`` and ``queued`` leave nested actions
    out. ``flops`` is counted with torch's formulas when the step was timed with
    ``count_flops=True`` (``None`` otherwise). ``cpu`` is the CPU time of the thread that ran
    the action, ``queued`` the time that thread was ready to run but waited for a core (other
    processes had it; Linux only, else 0): on a CPU run with one intra-op thread, ``duration -
    cpu - queued`` is time it blocked (e.g. in a CUDA synchronize).
    """

    kind: str
    stage: int
    microbatch: int
    start: float
    end: float
    flops: int | None = None
    cpu: float = 0.0
    queued: float = 0.0
    nested: float = 0.0
    comm: float = 0.0

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def own(self) -> float:
        """Seconds of the action itself: its duration less the actions nested in it."""
        return self.duration - self.nested

    @property
    def compute(self) -> float:
        """Seconds it computed: :attr:`own` less the time blocked in collectives."""
        return self.own - self.comm


@dataclass(frozen=True)
class WaitEvent:
    """Time a rank waited for a received tensor before the action ``kind`` that needs it."""

    kind: str  # the action that waited: "F" for an activation, "I" or "B" for a gradient
    stage: int
    microbatch: int
    start: float
    end: float
    cpu: float = 0.0  # of which, the thread ran (e.g. polling)
    queued: float = 0.0  # of which, ready to run but waiting for a core (Linux only, else 0)

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class RankStep:
    """What one rank did in one step."""

    rank: int
    duration: float  # from the step's start to its end on this rank
    actions: tuple[ActionEvent, ...]
    waits: tuple[WaitEvent, ...]
    cpu: float = 0.0  # CPU time of the thread that ran the step
    queued: float = 0.0  # time that thread was ready to run but waited for a core
    comms: tuple[CommWait, ...] = ()  # collectives waited for inside actions

    @property
    def hidden(self) -> float:
        """Seconds of collectives in flight that weight work hid."""
        return sum(c.hidden for c in self.comms)

    @property
    def exposed(self) -> float:
        """Seconds blocked waiting for collectives inside actions."""
        return sum(c.exposed for c in self.comms)

    @property
    def other_cpu(self) -> float:
        """CPU seconds the step's thread spent outside actions and waits: the schedule's own
        work (Python, posting sends and receives)."""
        return self.cpu - self.busy_cpu - sum(w.cpu for w in self.waits)

    @property
    def other_queued(self) -> float:
        """Seconds outside actions and waits the step's thread waited for a core."""
        return self.queued - sum(a.queued for a in self.actions) - sum(w.queued for w in self.waits)

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(sorted({a.stage for a in self.actions}))

    @property
    def busy(self) -> float:
        """Seconds spent in actions (an action nested in another counted once)."""
        return sum(a.own for a in self.actions)

    @property
    def busy_cpu(self) -> float:
        """CPU seconds of the threads that ran the actions (see :attr:`ActionEvent.cpu`)."""
        return sum(a.cpu for a in self.actions)

    def time_in(self, kind: str) -> float:
        """Seconds spent in actions of ``kind`` ("F", "I", "W" or "B"), nested ones apart."""
        return sum(a.own for a in self.actions if a.kind == kind)

    def flops(self, kind: str | None = None) -> int:
        """FLOPs counted in actions (of ``kind``); 0 when FLOPs were not counted."""
        return sum(a.flops or 0 for a in self.actions if kind is None or a.kind == kind)


@dataclass(frozen=True)
class RankBreakdown:
    """Where one rank's step went, in seconds; the six parts add up to the step's time.

    ``compute``: in actions, computing. ``comm``: in actions, blocked waiting for a collective
    (an all-to-all: :class:`CommWait`). ``peer``: waiting for a received tensor while the peer was still
    running the action that makes it (its forward, or its I or B); ``transfer``: waiting for it
    after that action ended (the peer's send, the network, waking up). ``tail``: the step's end
    after this rank's own (a slower rank). ``other``: the rest, time no action and no receive
    explains (the schedule's Python, posting sends and receives, waiting for sends).
    """

    rank: int
    compute: float
    peer: float
    transfer: float
    other: float
    tail: float
    comm: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.comm + self.peer + self.transfer + self.other + self.tail


@dataclass(frozen=True)
class StepTimeline:
    """One step as every rank measured it (clocks start at a common barrier)."""

    ranks: tuple[RankStep, ...]  # by rank

    @property
    def duration(self) -> float:
        """The step's time: its slowest rank's."""
        return max(r.duration for r in self.ranks)

    @property
    def bubble(self) -> float:
        """Share of ranks x step time in which no action ran."""
        return 1.0 - sum(r.busy for r in self.ranks) / (self.duration * len(self.ranks))

    @property
    def hidden(self) -> float:
        """Seconds of collectives in flight that weight work hid, over all ranks."""
        return sum(r.hidden for r in self.ranks)

    @property
    def exposed(self) -> float:
        """Seconds ranks were blocked waiting for collectives inside actions, over all ranks."""
        return sum(r.exposed for r in self.ranks)

    def stage_ranks(self) -> dict[int, int]:
        """Which rank ran each stage."""
        return {s: r.rank for r in self.ranks for s in r.stages}

    def breakdown(self) -> list[RankBreakdown]:
        """Each rank's step split into compute, collectives (comm), waits (peer / transfer),
        tail and other.

        A wait before stage ``s``'s forward depends on stage ``s - 1``'s forward of the same
        microbatch; before its I or B, on stage ``s + 1``'s I or B. The part of the wait before
        that action ended on its rank is ``peer``, the rest ``transfer``. The step is as long as
        its slowest rank: a rank that finished early has the difference in ``tail``.
        """
        waits = _split_waits(self)
        out = []
        for r in self.ranks:
            peer = sum(p for rank, p, _ in waits if rank == r.rank)
            transfer = sum(t or 0.0 for rank, _, t in waits if rank == r.rank)
            tail = self.duration - r.duration
            other = r.duration - r.busy - peer - transfer
            comm = sum(a.comm for a in r.actions)
            out.append(RankBreakdown(r.rank, r.busy - comm, peer, transfer, other, tail, comm))
        return out

    def summary(self) -> str:
        """One line: ranks, step time and bubble (and collectives hidden / exposed)."""
        comm = (
            f", all-to-all {1e3 * self.hidden:.4g} ms hidden / {1e3 * self.exposed:.4g} ms exposed"
            if any(r.comms for r in self.ranks)
            else ""
        )
        return (
            f"measured: {len(self.stage_ranks())} stages on {len(self.ranks)} ranks, step "
            f"{1e3 * self.duration:.4g} ms, bubble {self.bubble:.1%}{comm}"
        )

    def draw(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        ax: Axes | None = None,
        title: str | None = None,
        notes: Sequence[str] = (),
        span: float | None = None,
    ) -> Figure:
        """Draw the step as :meth:`Simulation.draw <customgrad.pipelining.Simulation.draw>`
        draws a replayed one (ranks as rows, one bar per action, the same colours and legend),
        with the waits for received tensors as grey bars, collectives as a band under their
        action and a W run inside one drawn over the action it ran in.

        Args:
            path: where to save the picture (by suffix: PNG, SVG, ...); None: don't save.
            ax: axes to draw into; None: a new figure.
            title: the title; None: :meth:`summary`.
            notes: lines of explanation added to the legend.
            span: seconds the time axis covers; None: the step's. Give two steps the same to
                compare them on one scale.

        Returns:
            The figure drawn on.
        """
        bars: list[Bar] = []
        for y, r in enumerate(self.ranks):
            first = min(r.stages, default=0)
            bars.extend(Bar("wait", y, w.start, w.duration) for w in r.waits)
            bars.extend(
                Bar(
                    a.kind,
                    y,
                    a.start,
                    a.duration,
                    str(a.microbatch),
                    second=a.stage != first,
                    over=_nested_in(a, r.actions),
                )
                for a in r.actions
            )
        bars.extend(comm_bars([c for r in self.ranks for c in r.comms],
                              {r.rank: y for y, r in enumerate(self.ranks)}))  # fmt: skip
        return draw_timeline(
            bars,
            rows=[f"rank {r.rank}" for r in self.ranks],
            span=self.duration if span is None else span,
            title=self.summary() if title is None else title,
            path=path,
            ax=ax,
            notes=notes,
        )


def _nested_in(action: ActionEvent, actions: Sequence[ActionEvent]) -> bool:
    """Whether ``action`` ran inside another of ``actions`` (drawn over it)."""
    return any(o.nested and o.start <= action.start and action.end <= o.end and o is not action
               for o in actions)  # fmt: skip


def _split_waits(step: StepTimeline) -> list[tuple[int, float, float | None]]:
    """``(rank, peer, transfer)`` for every wait of ``step`` (see :meth:`StepTimeline.breakdown`).

    When the action waited for is not in ``step`` (ranks missing from it), the whole wait is
    ``peer`` and ``transfer`` is ``None``.
    """
    ends: dict[tuple[str, int, int], float] = {}
    for r in step.ranks:
        for a in r.actions:
            if a.kind != "W":  # what a peer waits for: a forward, or an I or B
                ends["F" if a.kind == "F" else "IB", a.stage, a.microbatch] = a.end
    out: list[tuple[int, float, float | None]] = []
    for r in step.ranks:
        for w in r.waits:
            if w.kind == "F":
                done = ends.get(("F", w.stage - 1, w.microbatch))
            else:
                done = ends.get(("IB", w.stage + 1, w.microbatch))
            if done is None:
                out.append((r.rank, w.duration, None))
                continue
            until = min(max(done, w.start), w.end)
            out.append((r.rank, until - w.start, w.end - until))
    return out


def stage_costs(
    steps: Sequence[StepTimeline],
    statistic: Callable[[Sequence[float]], float] = statistics.median,
) -> dict[int, StageCosts]:
    """Each stage's action times over ``steps``, as ``StageCosts`` for ``simulate``.

    ``forward``, ``backward_input``, ``backward_weight`` (and ``backward`` for a stage that ran
    full backwards): ``statistic`` of that stage's actions of every microbatch of every step,
    their compute (:attr:`ActionEvent.compute`: without nested actions and time blocked in
    collectives). ``dispatch`` and ``combine``: ``statistic`` of the time in flight of the
    stage's collectives labelled so (:class:`CommWait`), in all its actions.
    For all stages alike: ``send``, of the transfer parts of all waits (see
    :meth:`StepTimeline.breakdown`: from the end of the action that made a tensor to the start
    of the one that used it); ``overhead``, of each rank's time per action in neither an action
    nor a wait (the schedule runtime's own).

    Args:
        steps: measured steps (:meth:`ActionTimer.gather`).
        statistic: ``statistics.median`` (default) for typical costs; ``statistics.mean`` to
            predict a step's time, a sum in which occasional slow actions count.

    Raises:
        ArgumentValueError: ``steps`` is empty or recorded no action.
    """
    times: dict[tuple[int, str], list[float]] = defaultdict(list)
    transfers: list[float] = []
    overheads: list[float] = []
    for step in steps:
        for r in step.ranks:
            for a in r.actions:
                times[a.stage, a.kind].append(a.compute)
            for c in r.comms:
                times[c.stage, c.label].append(c.in_flight)
            if r.actions:
                idle = r.duration - r.busy - sum(w.duration for w in r.waits)
                overheads.append(idle / len(r.actions))
        transfers.extend(t for _, _, t in _split_waits(step) if t is not None)
    if not times:
        raise ArgumentValueError(
            "stage_costs: the steps recorded no action. Time steps with ActionTimer.step() "
            "around schedule.step(...), on stages built from ActionTimer.stage_class(...)."
        )

    def of(stage: int, kind: str) -> float:
        values = times.get((stage, kind))
        return statistic(values) if values else 0.0

    send = statistic(transfers) if transfers else 0.0
    overhead = max(0.0, statistic(overheads))
    return {
        stage: StageCosts(
            forward=of(stage, "F"),
            backward_input=of(stage, "I"),
            backward_weight=of(stage, "W"),
            backward=of(stage, "B") if (stage, "B") in times else None,
            send=send,
            overhead=overhead,
            dispatch=of(stage, "dispatch"),
            combine=of(stage, "combine"),
        )
        for stage in sorted({s for s, k in times if k in KINDS})
    }


_SCHEDSTAT_PATH = "/proc/thread-self/schedstat"
_HAS_SCHEDSTAT = os.path.exists(_SCHEDSTAT_PATH)


def _thread_clocks() -> tuple[float, float]:
    """This thread's CPU time and the time it waited for a core, in seconds.

    The wait is the second field of Linux's ``/proc/thread-self/schedstat`` (nanoseconds
    runnable on a run queue; exact when read by the running thread itself, 0 elsewhere). Its
    first field, time on the CPU, lags by up to a scheduler tick: ``time.thread_time()`` is
    exact. The file is opened and closed on each read: a descriptor kept per thread would
    outlive the thread (the path names the thread that opens it).
    """
    queued = 0.0
    if _HAS_SCHEDSTAT:
        try:
            fd = os.open(_SCHEDSTAT_PATH, os.O_RDONLY)
        except OSError:
            pass
        else:
            try:
                queued = int(os.pread(fd, 128, 0).split()[1]) * 1e-9
            finally:
                os.close(fd)
    return time.thread_time(), queued


@dataclass
class _Open:
    """An action being recorded, and what the actions nested in it took (left out of its own)."""

    kind: str
    stage: int
    microbatch: int
    seconds: float = 0.0
    cpu: float = 0.0
    queued: float = 0.0
    flops: int = 0
    comm: float = 0.0


@dataclass
class _Recording:
    t0: float
    count_flops: bool
    actions: list[ActionEvent] = field(default_factory=list)
    waits: list[WaitEvent] = field(default_factory=list)
    comms: list[CommWait] = field(default_factory=list)
    open: list[_Open] = field(default_factory=list)  # the actions running, outermost first
    last_end: float = 0.0  # end of the rank's latest event (action or posted receive)
    last_cpu: float = 0.0  # the thread's CPU time, then
    last_queued: float = 0.0  # the thread's time waiting for a core, then
    posted: set[tuple[str, int, int]] = field(default_factory=set)  # ("F"|"B", stage, mb)


class ActionTimer:
    """Records the actions of a rank's pipeline stages, step by step.

    Args:
        device: the stages' device; on CUDA each action is synchronized before and after.
        group: the pipeline's process group (default: the default group), for the rank
            number and :meth:`gather`.

    Example:
        Time torch's (or customgrad's) stages under any torch schedule::

            timer = ActionTimer(device)
            Stage = timer.stage_class(customgrad.pipelining.PipelineStage)
            stages = [Stage(chunk, i, num_stages, device) for i, chunk in mine]
            schedule = ScheduleZBVZeroBubble(stages, n_microbatches, loss_fn=loss_fn)
            for x, y in batches:
                with timer.step():
                    schedule.step(x, target=y)
            steps = timer.gather()            # every rank's steps, on every rank
            print(steps[-1].bubble, stage_costs(steps[1:]))

        Actions run outside ``timer.step()`` are not recorded.
    """

    def __init__(
        self, device: torch.device | str | None = None, group: dist.ProcessGroup | None = None
    ) -> None:
        self.device = torch.device(device if device is not None else "cpu")
        self.group = group
        self.steps: list[RankStep] = []
        self._rec: _Recording | None = None

    def stage_class(self, base: _S) -> _S:
        """A subclass of the pipeline stage class ``base`` whose actions this timer records.

        ``base`` is torch's ``PipelineStage``, customgrad's, or a subclass of either; the
        subclass takes the same arguments.

        Raises:
            ArgumentTypeError: ``base`` is not a pipeline stage class.
            UnsupportedError: this torch's stage no longer has the methods the timer wraps.
        """
        if not (isinstance(base, type) and issubclass(base, stage_base())):
            raise ArgumentTypeError(
                f"ActionTimer.stage_class: expected a pipeline stage class (a subclass of "
                f"torch.distributed.pipelining.PipelineStage), got {base!r}. Pass the class, "
                f"not a stage: timer.stage_class(PipelineStage)(module, stage_index, ...)."
            )
        return timed_stage_class(base, self)  # type: ignore[return-value]

    @contextlib.contextmanager
    def step(self, *, count_flops: bool = False) -> Iterator[None]:
        """Record the actions run inside the block as one step (appended to :attr:`steps`).

        Args:
            count_flops: also count each action's FLOPs (torch's formulas; slower).

        Raises:
            ActionTimerError: a step is already being recorded.
        """
        if self._rec is not None:
            raise ActionTimerError(MSG_NESTED_STEP)
        self._sync()
        rec = self._rec = _Recording(time.perf_counter(), count_flops)
        cpu, queued = _thread_clocks()
        rec.last_cpu, rec.last_queued = cpu, queued
        token = RECORDER.set(self)
        try:
            yield
            self._sync()
            duration = time.perf_counter() - rec.t0
            cpu_end, queued_end = _thread_clocks()
        finally:
            RECORDER.reset(token)
            self._rec = None
        rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        actions = tuple(sorted(rec.actions, key=lambda a: a.start))  # nested ones end first
        comms = tuple(dataclasses.replace(c, rank=rank) for c in rec.comms)
        self.steps.append(RankStep(rank, duration, actions, tuple(rec.waits),
                                   cpu_end - cpu, queued_end - queued, comms))  # fmt: skip

    @contextlib.contextmanager
    def action(self, kind: str, stage: int, microbatch: int) -> Iterator[None]:
        """Record the block as action ``kind`` of ``stage`` on ``microbatch`` (in a step).

        The timed stages call this; a hand-written pipeline loop can too.

        Raises:
            ArgumentValueError: ``kind`` is not one of "F", "I", "W", "B".
        """
        if kind not in KINDS:
            raise ArgumentValueError(
                f"ActionTimer.action: kind must be one of {KINDS}, got {kind!r}."
            )
        rec = self._rec
        if rec is None:
            yield
            return
        # A W nested in another action's all-to-all wait is not synchronized: a device sync
        # would wait for the all-to-all too. On CUDA its time is the host's, in the outer one's.
        nested = bool(rec.open)
        if not nested:
            self._sync()
        start = time.perf_counter() - rec.t0
        cpu, queued = _thread_clocks()
        recv = ("F" if kind == "F" else "B", stage, microbatch)
        if kind != "W" and recv in rec.posted:
            rec.posted.discard(recv)
            rec.waits.append(WaitEvent(kind, stage, microbatch, rec.last_end, start,
                                       cpu - rec.last_cpu, queued - rec.last_queued))  # fmt: skip
        counter = FlopCounter() if rec.count_flops else None
        inner = _Open(kind, stage, microbatch)
        rec.open.append(inner)
        try:
            with counter if counter is not None else contextlib.nullcontext():
                yield
        finally:
            rec.open.pop()
        if not nested:
            self._sync()
        end = time.perf_counter() - rec.t0
        cpu_end, queued_end = _thread_clocks()
        flops = counter.total - inner.flops if counter is not None else None
        cpu, queued = cpu_end - cpu - inner.cpu, queued_end - queued - inner.queued
        rec.actions.append(ActionEvent(kind, stage, microbatch, start, end, flops, cpu, queued,
                                       inner.seconds, inner.comm))  # fmt: skip
        if rec.open:  # nested in a running action (a W in its all-to-all wait)
            outer = rec.open[-1]
            outer.seconds += end - start
            outer.cpu += cpu + inner.cpu
            outer.queued += queued + inner.queued
            outer.flops += (flops or 0) + inner.flops
        rec.last_end, rec.last_cpu, rec.last_queued = end, cpu_end, queued_end

    def record_wait(
        self, label: str, start: float, end: float, overlapped: float, hidden: float
    ) -> None:
        """Record a collective the running action waited for (times from ``time.perf_counter``).

        :meth:`WeightGradQueue.run_while <customgrad.pipelining.WeightGradQueue.run_while>`
        calls this; a wait outside a recorded action is not recorded.

        Args:
            label: what the collective was (``"dispatch"``, ``"combine"``, ...).
            start: when the wait began, the collective in flight.
            end: when it returned.
            overlapped: seconds of W run inside the wait (recorded as nested actions).
            hidden: of the collective's time in flight, the seconds that W covered.
        """
        rec = self._rec
        if rec is None or not rec.open:
            return
        action = rec.open[-1]
        wait = CommWait(label, action.kind, action.stage, action.microbatch, start - rec.t0,
                        end - rec.t0, overlapped, hidden)  # fmt: skip
        action.comm += wait.exposed
        rec.comms.append(wait)

    def time_loss(self, loss_fn: Callable[_P, _R]) -> Callable[_P, _R]:
        """``loss_fn``, timed as part of the last stage's forward it follows.

        Schedules compute the loss after the last stage's ``forward_one_chunk``, outside it;
        pass ``loss_fn=timer.time_loss(loss_fn)`` to count it in that stage's forward time.
        """

        def timed_loss(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            rec = self._rec
            last = rec.actions[-1] if rec is not None and rec.actions else None
            if rec is None or last is None or last.kind != "F":
                return loss_fn(*args, **kwargs)
            counter = FlopCounter() if rec.count_flops else None
            cpu, queued = _thread_clocks()
            with counter if counter is not None else contextlib.nullcontext():
                out = loss_fn(*args, **kwargs)
            self._sync()
            end = time.perf_counter() - rec.t0
            cpu_end, queued_end = _thread_clocks()
            flops = None if last.flops is None or counter is None else last.flops + counter.total
            rec.actions[-1] = dataclasses.replace(
                last, end=end, flops=flops, cpu=last.cpu + cpu_end - cpu,
                queued=last.queued + queued_end - queued,
            )  # fmt: skip
            rec.last_end, rec.last_cpu, rec.last_queued = end, cpu_end, queued_end
            return out

        return timed_loss

    def posted_receive(self, direction: str, stage: int, microbatch: int) -> None:
        """Note that ``stage`` posted a receive for ``microbatch``'s activation
        (``direction="F"``) or gradient (``"B"``); the action that uses it records the wait."""
        rec = self._rec
        if rec is not None:
            rec.posted.add((direction, stage, microbatch))
            rec.last_end = time.perf_counter() - rec.t0
            rec.last_cpu, rec.last_queued = _thread_clocks()

    def gather(self) -> list[StepTimeline]:
        """Every rank's recorded steps, on every rank (a collective: call it on all ranks).

        Step ``i`` of the result holds each rank's ``i``-th step; every rank must have
        recorded the same number of steps.
        """
        if not dist.is_initialized():
            return [StepTimeline((s,)) for s in self.steps]
        world = dist.get_world_size(self.group)
        everyone: list[list[RankStep] | None] = [None] * world
        dist.all_gather_object(everyone, self.steps, group=self.group)
        per_rank = [steps for steps in everyone if steps is not None]
        counts = {len(s) for s in per_rank}
        if len(counts) != 1:
            raise ActionTimerError(
                f"ActionTimer.gather: ranks recorded different numbers of steps "
                f"({sorted(len(s) for s in per_rank)}). Time the same steps on every rank."
            )
        return [
            StepTimeline(tuple(sorted(steps, key=lambda r: r.rank))) for steps in zip(*per_rank)
        ]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
