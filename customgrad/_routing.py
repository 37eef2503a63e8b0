"""Routing: what a planned backward tells customgrad nodes, and what a forward tags them with.

A split backward (``customgrad.pipelining``) plans a pass before the engine runs it: which of a
customgrad node's input edges the pass needs (so the node asks the engine nothing), and where
the node's weight half goes when the pass leaves it for later. :func:`routing` installs such a
plan on the nodes' records for the duration of one backward and removes it after; a plan made
inside a running backward (from a node pre-hook) is installed with :func:`install_for_task` and
holds for that graph task only. Nothing is global: a route lives on the record of the node it
is for, so backwards running on several threads (or on the engine's device threads) never see
each other's plans.

:func:`tagging` marks the customgrad nodes a forward creates (a context variable, read when a
node is created), e.g. with the weight-gradient queue's ``(stage, microbatch)`` key.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from customgrad._errors import UnsupportedError
from customgrad._torch.engine import graph_task_id

if TYPE_CHECKING:
    from torch.autograd.graph import GradientEdge, Node

__all__ = [
    "DeferTarget",
    "WeightWork",
    "Route",
    "Routed",
    "current_tag",
    "install_for_task",
    "route_for",
    "routing",
    "tagging",
]

_graph_task_id = graph_task_id


class Routed(Protocol):
    """What takes a route: a customgrad node's record, or a compiled region's node
    (:class:`customgrad._compiled_region.RegionNode`)."""

    route: Route | None

    @property
    def label(self) -> str:
        """What errors call the node."""


_R = TypeVar("_R", bound=Routed)


class WeightWork(Protocol):
    """A piece of weight work, as the weight pass runs it: a customgrad node's deferred weight
    half (``customgrad._autograd.DeferredWork``), a plain Function's split weight pass or the
    gradients its backward returned in I, gradients I recorded for W to send again."""

    @property
    def device(self) -> torch.device:
        """The device whose current stream the work is queued on."""

    def owner(self) -> Node | None:
        """The node whose work it is, when W runs it outside the engine (for tools that count
        it to its node), else None."""

    def gradients(self) -> tuple[list[GradientEdge], list[torch.Tensor]]:
        """Compute the weight gradients (once); return ``(edges, gradients)`` to send through
        autograd."""


class DeferTarget(Protocol):
    """Where a customgrad node's weight half goes when the pass leaves it for later."""

    def defer(self, record: Routed, work: WeightWork) -> None:
        """Keep ``work`` (the weight half of the node whose record is ``record``) for W."""


@dataclasses.dataclass(frozen=True)
class Route:
    """What one planned backward tells one customgrad node.

    Attributes:
        needed: per input edge of the node (``next_functions`` order), whether the pass uses its
            gradient (None for an edge, or for all, to ask the autograd engine).
        defer: where the weight half goes for weights that require grad but that this pass does
            not compute; None to leave them (a later pass through the node computes them).
        task: the graph task the route was planned for; None for a route installed by
            :func:`routing`, which holds while its context is open.
    """

    needed: tuple[bool | None, ...] | None = None
    defer: DeferTarget | None = None
    task: int | None = None


def route_for(record: Routed) -> Route | None:
    """The route of the running backward for this node, or None when it was not planned."""
    route = record.route
    if route is None or (route.task is not None and route.task != _graph_task_id()):
        return None
    return route


@contextlib.contextmanager
def routing(routes: Mapping[_R, Route]) -> Iterator[None]:
    """Install ``routes`` on their nodes' records for the duration of the block.

    Raises:
        UnsupportedError: a node already has a route from another open ``routing`` block (two
            planned backwards through one graph at the same time).
    """
    installed: list[tuple[Routed, Route]] = []
    try:
        for record, route in routes.items():
            current = record.route
            if current is not None and current.task is None:
                raise UnsupportedError(
                    f"{record.label}: two planned backwards run through the same autograd "
                    f"node at once (another thread's split of the same graph?). Run one "
                    f"backward per graph at a time."
                )
            record.route = route
            installed.append((record, route))
        yield
    finally:
        for holder, route in installed:
            if holder.route is route:
                holder.route = None


def install_for_task(routes: Mapping[_R, Route]) -> None:
    """Install ``routes`` for the graph task running now (call from inside a backward)."""
    task = _graph_task_id()
    for record, route in routes.items():
        current = record.route
        if current is None or current.task is not None:
            record.route = dataclasses.replace(route, task=task)


_TAG: contextvars.ContextVar[Any] = contextvars.ContextVar("customgrad_forward_tag", default=None)


@contextlib.contextmanager
def tagging(tag: object) -> Iterator[None]:
    """Tag the customgrad nodes that forwards inside the block create with ``tag``."""
    token = _TAG.set(tag)
    try:
        yield
    finally:
        _TAG.reset(token)


current_tag: Callable[[], Any] = _TAG.get
"""What a customgrad node created now is tagged with (None outside :func:`tagging`)."""
