"""The pipeline timeline picture: one renderer for measured steps and replayed ones.

:meth:`StepTimeline.draw <customgrad.pipelining.StepTimeline.draw>` (what :class:`ActionTimer`
measured) and :meth:`Simulation.draw <customgrad.pipelining.Simulation.draw>` (what ``simulate``
replayed) both turn their actions into :class:`Bar` records and call :func:`draw_timeline`, so
both pictures share colours, legend, units and labelling. matplotlib is imported when a picture
is drawn, never before, and without pyplot (no global state).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "COLORS",
    "COMM_COLORS",
    "KIND_NAMES",
    "WAIT_COLOR",
    "Bar",
    "comm_bars",
    "draw_timeline",
    "seconds",
    "time_unit",
]

#: One colour per kind of action.
COLORS: dict[str, str] = {"F": "#4C72B0", "I": "#DD8452", "W": "#55A868", "B": "#C44E52"}
#: Time a rank waited for a tensor from its neighbour.
WAIT_COLOR = "#b8b8b8"
#: What each kind of action computes, as the legend says it.
KIND_NAMES: dict[str, str] = {
    "F": "F: forward",
    "I": "I: input gradient (what the previous stage waits for)",
    "W": "W: weight gradient (nobody waits for it)",
    "B": "B: full backward (I and W in one pass)",
}
#: An all-to-all in flight, as a thin band under its action: hidden behind weight work, or
#: exposed (the rank blocked, waiting for it).
COMM_COLORS: dict[str, str] = {"hidden": "#8172B3", "exposed": "#1a1a1a"}
COMM_NAMES: dict[str, str] = {
    "hidden": "all-to-all in flight, hidden behind W",
    "exposed": "all-to-all in flight, rank blocked",
}
SECOND_STAGE_ALPHA = 0.55
LABEL_FONTSIZE = 7.0
_MARGIN_PX = 1.5  # free space each side of a label inside its bar


@dataclasses.dataclass(frozen=True)
class Bar:
    """One bar of the picture.

    Attributes:
        kind: "F", "I", "W", "B", "wait", or an all-to-all's "hidden" / "exposed" part.
        row: the rank, counted from the top.
        start: seconds since the step started.
        duration: seconds.
        label: drawn inside the bar (the microbatch) when it fits, else dropped.
        second: the action belongs to the rank's second (or later) stage: drawn lighter.
        over: the action ran inside another (a W in its all-to-all wait): drawn over it, label
            included.
    """

    kind: str
    row: int
    start: float
    duration: float
    label: str = ""
    second: bool = False
    over: bool = False


class _Comm(Protocol):
    @property
    def rank(self) -> int: ...

    @property
    def start(self) -> float: ...

    @property
    def hidden(self) -> float: ...

    @property
    def exposed(self) -> float: ...

    @property
    def in_flight(self) -> float: ...


def comm_bars(comms: Sequence[_Comm], rows: dict[int, int]) -> list[Bar]:
    """The bands of ``comms`` (:class:`~customgrad.pipelining.CommWait`\\ s) on the rows of their
    ranks (``rows``: rank to row): the hidden part from the wait's start, then the exposed part
    up to the wait's end."""
    bars = []
    for c in comms:
        row = rows.get(c.rank)
        if row is None:
            continue
        if c.hidden > 0:
            bars.append(Bar("hidden", row, c.start, c.hidden))
        if c.exposed > 0:
            bars.append(Bar("exposed", row, c.start + c.in_flight - c.exposed, c.exposed))
    return bars


def time_unit(seconds: float) -> tuple[str, float]:
    """The unit to show ``seconds`` in, and the factor to multiply by."""
    if seconds >= 1.0 or seconds == 0:
        return "s", 1.0
    if seconds >= 1e-3:
        return "ms", 1e3
    return "µs", 1e6


def seconds(value: float) -> str:
    """``value`` seconds in a readable unit, e.g. ``"12.5 ms"``."""
    unit, scale = time_unit(value)
    return f"{value * scale:.4g} {unit}"


@functools.cache
def _bar_label_class() -> type[Any]:
    """A text that draws only when it fits inside its bar (checked at each draw, after the
    layout, so a narrow bar drops its label instead of letting it spill onto the next)."""
    from matplotlib.text import Text

    class BarLabel(Text):
        def __init__(self, bar: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.bar = bar
            self.drawn = False

        def draw(self, renderer: Any) -> None:
            text = self.get_window_extent(renderer)
            bar = self.bar.get_window_extent(renderer)
            self.drawn = self.get_visible() and text.width + 2 * _MARGIN_PX <= bar.width
            if self.drawn:
                super().draw(renderer)

    return BarLabel


def _free_part(bar: Bar, bars: Sequence[Bar]) -> tuple[float, float]:
    """The widest part of ``bar`` that no bar drawn over it covers: ``(start, duration)``."""
    end = bar.start + bar.duration
    covers = sorted((o.start, o.start + o.duration) for o in bars
                    if o.over and o.row == bar.row and bar.start <= o.start < end)  # fmt: skip
    best, at = (bar.start, 0.0), bar.start
    for lo, hi in [*covers, (end, end)]:
        if lo - at > best[1]:
            best = (at, lo - at)
        at = max(at, hi)
    return best


def draw_timeline(
    bars: Sequence[Bar],
    *,
    rows: Sequence[str],
    span: float,
    title: str,
    path: str | os.PathLike[str] | None = None,
    ax: Axes | None = None,
    notes: Sequence[str] = (),
) -> Figure:
    """Draw ``bars`` as a pipeline picture: one row per rank, time from left to right.

    The legend (below the plot) names each kind of action present, the waits, and the shades
    when a rank runs two stages; ``notes`` are added to it as text lines. A label is drawn only
    if it fits inside its bar once the figure is laid out: dropped, never squeezed.

    Args:
        bars: what to draw.
        rows: the row names, top first.
        span: seconds the x axis covers.
        title: the title.
        path: where to save the picture (by suffix: PNG, SVG, ...); None: don't save.
        ax: axes to draw into; None: a new figure, 8 inches wide (a README's width).
        notes: lines of explanation for the legend.

    Returns:
        The figure drawn on.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    n = len(rows)
    own = ax is None
    if ax is None:
        fig = Figure(figsize=(8.0, 1.6 + 0.42 * n + 0.2 * len(notes)))
        ax = fig.add_subplot()
    else:
        parent = ax.figure  # a Figure, or a SubFigure of one
        fig = parent if isinstance(parent, Figure) else parent.figure
    unit, scale = time_unit(span)
    label_class = _bar_label_class()
    for b in bars:
        if b.kind in COMM_COLORS:  # a band along the bottom of the row, over the actions
            ax.add_patch(Rectangle((b.start * scale, b.row + 0.22), b.duration * scale, 0.18,
                                   facecolor=COMM_COLORS[b.kind], linewidth=0, zorder=6))  # fmt: skip
            continue
        color = WAIT_COLOR if b.kind == "wait" else COLORS[b.kind]
        patch = Rectangle((b.start * scale, b.row - 0.4), b.duration * scale, 0.8,
                          facecolor=color, edgecolor="white", linewidth=0.4,
                          alpha=SECOND_STAGE_ALPHA if b.second else 1.0,
                          zorder=4 if b.over else 1)  # fmt: skip
        ax.add_patch(patch)
        if b.label and b.kind != "wait":
            start, width = (b.start, b.duration) if b.over else _free_part(b, bars)
            room = patch
            if (start, width) != (b.start, b.duration):  # the label sits beside what covers it
                room = Rectangle((start * scale, b.row - 0.4), width * scale, 0.8,
                                 transform=ax.transData)  # fmt: skip
            ax.add_artist(label_class(room, (start + width / 2) * scale, b.row, b.label,
                                      ha="center", va="center", fontsize=LABEL_FONTSIZE,
                                      color="white", zorder=5 if b.over else 3))  # fmt: skip
    ax.set_xlim(0, max(span, 1e-12) * scale)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_yticks(range(n), list(rows))
    ax.set_xlabel(f"time ({unit})", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.set_title(title, fontsize=9)

    kinds = sorted({b.kind for b in bars if b.kind in COLORS}, key="FIWB".index)
    handles = [Patch(color=COLORS[k], label=KIND_NAMES[k]) for k in kinds]
    handles += [Patch(color=COMM_COLORS[k], label=COMM_NAMES[k])
                for k in COMM_COLORS if any(b.kind == k for b in bars)]  # fmt: skip
    if any(b.kind == "wait" for b in bars):
        handles.append(Patch(color=WAIT_COLOR, label="waiting for a tensor from a neighbour"))
    if any(b.second for b in bars):
        shade = COLORS[kinds[0]]
        handles.append(Patch(color=shade, label="solid: the rank's first stage"))
        handles.append(
            Patch(color=shade, alpha=SECOND_STAGE_ALPHA, label="light: its second stage")
        )
    handles.extend(Patch(color="none", label=note) for note in notes)
    if any(b.label for b in bars if b.kind in COLORS):
        handles.append(Patch(color="none", label="numbers in bars: the microbatch"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.0, -0.32 if n < 3 else -0.2),
              ncols=2, fontsize=7, frameon=False, handlelength=1.2,
              borderaxespad=0.0)  # fmt: skip
    if own:
        fig.tight_layout()
    if path is not None:
        fig.savefig(os.fspath(path), dpi=150, bbox_inches="tight")
    return fig
