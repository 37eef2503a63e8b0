"""What customgrad knows of each compiled region's backward: split or not, what runs where.

A :class:`CompiledRegion` is made per graph :func:`customgrad.compile`'s backend compiles; the
compiled backward (:mod:`customgrad._compiled_backward`) fills it in and ``explain_split`` and
``summary()`` read it. Each autograd node of the region has a :class:`RegionNode`: its hand-offs
(the one hand-off store, :mod:`customgrad._handoff`; the region only counts them) and the route
a planned backward gives it, as a customgrad node's record has (the split planner,
:mod:`customgrad._split_plan`, routes both alike).
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from customgrad._handoff import check_pass, pending
from customgrad._origin import ValueOrigin
from customgrad._origin import summary as origin_summary

if TYPE_CHECKING:
    import torch

    from customgrad._handoff import HandOff, HandOffValue
    from customgrad._routing import Route

__all__ = [
    "LOCK",
    "CompiledRegion",
    "GraphInfo",
    "RegionNode",
    "region_node",
    "register",
    "regions",
]

log = logging.getLogger("customgrad")

MSG_FALLBACK = (
    "customgrad.compile: compiled region %s runs its full backward in each pass (no "
    "input/weight split): %s"
)
MSG_REPEAT = (
    "customgrad.compile: compiled region %s runs its full backward in a pass where it would "
    "split: %s"
)


@dataclass
class GraphInfo:
    """One piece of a split backward: which gradients it computes and what it keeps for W."""

    computes: tuple[str, ...]
    """The gradients the graph outputs, by the region's input names."""
    nodes: int
    """Number of operations in the graph."""


@dataclass(eq=False)
class CompiledRegion:
    """One compiled backward customgrad has seen: split (I and W graphs) or fallen back (why)."""

    name: str
    """A readable label: the compiled module's class and the graph's number."""
    status: str = "split"
    """``"split"``, or ``"fallback"`` (the full backward runs in each pass that reaches it)."""
    reason: str | None = None
    """Why the region fell back, or None."""
    input_pass: GraphInfo | None = None
    """The graph run in I (input gradients and the hand-off)."""
    weight_pass: GraphInfo | None = None
    """The graph run in W (weight gradients)."""
    handoff: tuple[str, ...] = ()
    """The values I keeps for W (one set per microbatch between its I and its W), by FX name."""
    recomputed: tuple[str, ...] = ()
    """The values W recomputes (no FLOPs) rather than keeping them from I, by FX name."""
    kept: tuple[ValueOrigin, ...] = ()
    """:attr:`handoff` with where the user's code made each value (module, source line)."""
    recomputed_origins: tuple[ValueOrigin, ...] = ()
    """:attr:`recomputed` with where the user's code made each value."""
    handoff_bytes: int = 0
    """Bytes the last I pass kept for W."""
    runs: dict[str, int] = field(default_factory=lambda: {"full": 0, "input": 0, "weight": 0})
    """How many times each graph ran."""
    repeated: str | None = None
    """Why some pass computed again what an earlier pass through the same node computed (the
    split ran, but not as one I and one W), or None."""
    input_names: tuple[str, ...] = field(default=(), repr=False)
    """The region's inputs by name (``fc1.weight``), one per gradient slot."""
    edge_slots: tuple[int, ...] = field(default=(), repr=False)
    """The slot (region input) of each edge of the region's autograd nodes."""
    reaches: dict[int, frozenset[int]] = field(default_factory=dict, repr=False)
    """Per output of the region's autograd node whose gradient the backward graph takes (by its
    position among the node's outputs), the slots that gradient reaches in the backward graph;
    empty until the backward is compiled (at its first run), or where AOTAutograd's metadata
    does not tell which output each gradient is."""
    nodes: weakref.WeakSet[RegionNode] = field(default_factory=weakref.WeakSet, repr=False)
    """The live autograd nodes of the region (their hand-offs are on them)."""
    _logged: bool = field(default=False, repr=False)
    _logged_repeat: bool = field(default=False, repr=False)

    def pending(self) -> int:
        """Number of microbatches whose I ran and whose W has not yet (hand-offs held)."""
        with LOCK:
            nodes = list(self.nodes)
        return sum(1 for n in nodes for _ in pending(n))

    def fall_back(self, reason: str) -> None:
        """Mark the region as running its full backward, logging why once."""
        with LOCK:
            self.status, self.reason = "fallback", reason
            first, self._logged = not self._logged, True
        if first:
            log.warning(MSG_FALLBACK, self.name, reason)

    def note_repeat(self, reason: str) -> None:
        """Record (and log once) that a pass recomputes work of an earlier pass, and why."""
        with LOCK:
            self.repeated = reason
            first, self._logged_repeat = not self._logged_repeat, True
        if first:
            log.warning(MSG_REPEAT, self.name, reason)

    def describe(self) -> str:
        """One line: what runs in I and in W and what is kept, or why it fell back."""
        if self.status == "fallback":
            return f"fell back to its full backward in each pass: {self.reason}"
        if self.input_pass is None or self.weight_pass is None:
            return "split, not compiled yet (its backward has not run)"
        kept = "nothing"
        if self.kept:
            kept = f"{len(self.kept)} value{'s' if len(self.kept) > 1 else ''}"
        text = (
            f"split: I runs a graph of {self.input_pass.nodes} ops for "
            f"{', '.join(self.input_pass.computes) or 'no input'}; W runs a graph of "
            f"{self.weight_pass.nodes} ops for {', '.join(self.weight_pass.computes) or 'no weight'}; "
            f"I keeps {kept} for W ({self.handoff_bytes} bytes per microbatch)"
        )
        if self.kept:
            text += f": {origin_summary(self.kept)}"
        recomputed = self.recomputed_origins
        if recomputed:
            n = len(recomputed)
            text += (
                f"; W recomputes {n} value{'s' if n > 1 else ''} ({origin_summary(recomputed)}; "
                "no FLOPs)"
            )
        if self.repeated:
            text += f"; some pass ran the full backward: {self.repeated}"
        return text


LOCK = threading.Lock()
_REGIONS: list[weakref.ref[CompiledRegion]] = []


def register(region: CompiledRegion) -> None:
    with LOCK:
        _REGIONS[:] = [r for r in _REGIONS if r() is not None]
        _REGIONS.append(weakref.ref(region))


def regions() -> list[CompiledRegion]:
    """Every compiled backward still alive that a :func:`compile`\\ d module produced."""
    with LOCK:
        live = [r() for r in _REGIONS]
    return [r for r in live if r is not None]


ATTR = "_cg_region"
"""The attribute of a compiled region's autograd node that holds its :class:`RegionNode`."""


class RegionNode:
    """A compiled region's autograd node as customgrad sees it (set on the node as :data:`ATTR`).

    It is the node's hand-off :class:`customgrad._handoff.Holder` and takes the route a planned
    backward gives it, as a customgrad node's record does; as the node's pre-hook it records the
    output gradients the engine passes to the node just before its backward runs (the pass the
    backward belongs to). It holds nothing of the node: no reference cycle.

    Attributes:
        region: the region.
        handoff: the hand-offs of passes whose weight pass has not run yet.
        route: what a planned backward tells the node (see :mod:`customgrad._routing`).
        grads: the output gradients of the backward about to run, or None.
        loose: the outputs whose gradient reaches only the region's weight side
            (:attr:`CompiledRegion.reaches`) and comes in W, not in I: a split Function's weight
            pass sends it (see :func:`customgrad._split_plan.weights_into_regions`). W's pass
            is the pass of I's kept values whatever it brings there: those values do not depend
            on it, and the weight pass reads it from its own arguments.
        differentiable: per output, whether the pass that made a hand-off is told by its
            gradient (all, None, unless some are :attr:`loose`).
    """

    __slots__ = ("__weakref__", "differentiable", "grads", "handoff", "loose", "region", "route")

    def __init__(self, region: CompiledRegion) -> None:
        self.region = region
        self.handoff: HandOff[HandOffValue] | None = None
        self.route: Route | None = None
        self.grads: tuple[torch.Tensor | None, ...] | None = None
        self.loose: frozenset[int] = frozenset()
        self.differentiable: tuple[bool, ...] | None = None

    @property
    def label(self) -> str:
        """What errors call the node."""
        return f"compiled region {self.region.name}"

    def __call__(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        self.grads = grads
        loose = self.loose
        if loose:
            self.differentiable = tuple(i not in loose for i in range(len(grads)))
        if self.handoff is not None:  # before AOTAutograd unpacks its saved tensors
            check_pass(self, grads)


def region_node(node: object) -> RegionNode | None:
    """The :class:`RegionNode` of a compiled region's autograd node, else None."""
    found = getattr(node, ATTR, None)
    return found if isinstance(found, RegionNode) else None
