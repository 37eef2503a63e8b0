"""What a stage's input pass leaves for its weight pass, and the drop-ins' error classes.

:func:`customgrad.pipelining.stage_backward_input` returns its :class:`SplitState` inside the
``param_groups`` torch's signature gives it (one dict); :func:`customgrad.pipelining.
stage_backward_weight` takes it back (:func:`state_of`, once), and tools that watch W
(``explain_split``, ``summary()``) read it before W runs (:func:`found_state` and the readers
below). Errors leaving the drop-ins are ``RuntimeError``\\ s too, as torch's are
(:func:`runtime_errors`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeAlias

import torch
from torch.autograd.graph import Node

from customgrad._record import NodeRecord
from customgrad._split_plan import InputPassPlan
from customgrad.pipelining._errors import SplitStateError
from customgrad.pipelining._function_split import FunctionOnce, FunctionSplit
from customgrad.pipelining._streams import WeightWork

if TYPE_CHECKING:
    from customgrad._autograd import DeferredWork

__all__ = [
    "STATE_KEY",
    "SplitState",
    "Watch",
    "FunctionWork",
    "deferred_nodes",
    "deferred_work",
    "found_state",
    "ran_once",
    "runtime_errors",
    "split_functions_of",
    "state_of",
    "watch_direct_calls",
]

Watch: TypeAlias = Callable[[Node], contextlib.AbstractContextManager[object]]
"""What runs around each call W makes of a node itself (``explain_split`` counts its FLOPs)."""


FunctionWork: TypeAlias = FunctionSplit | FunctionOnce
"""What a plain Function node that ran in I leaves for W: the weight pass of its split backward,
or the weight-side gradients its backward returned (with the edges they go along)."""

STATE_KEY = "customgrad_split"

MSG_REUSED_STATE = """\
stage_backward_weight: these param_groups were already used by an earlier \
stage_backward_weight call; each stage_backward_input result runs W once. Call \
stage_backward_input again for a new microbatch:

    dinputs, param_groups = stage_backward_input(outputs, grads, inputs, weights)
    stage_backward_weight(weights, param_groups)      # once per param_groups
"""

MSG_FOREIGN_STATE = """\
stage_backward_weight: param_groups did not come from \
customgrad.pipelining.stage_backward_input (got {got}). Pass the second value that \
customgrad.pipelining.stage_backward_input returned; torch's own stage_backward_input \
results go to torch's stage_backward_weight.
"""


@functools.cache
def _with_runtime_error(cls: type[Exception]) -> type[Exception]:
    """``cls`` that is also a ``RuntimeError`` (what torch's drop-ins raise)."""
    return type(cls.__name__, (cls, RuntimeError), {"__module__": cls.__module__})


@contextlib.contextmanager
def runtime_errors() -> Iterator[None]:
    """Make every error leaving the block a ``RuntimeError`` too, keeping its own class."""
    try:
        yield
    except RuntimeError:
        raise
    except Exception as e:
        try:
            wrapped = _with_runtime_error(type(e))(*e.args)  # type: ignore[arg-type]
        except TypeError:  # a class that can't be combined with RuntimeError, or rebuilt
            raise RuntimeError(str(e)) from e
        raise wrapped.with_traceback(e.__traceback__) from e.__cause__


class SplitState:
    """What one microbatch's I leaves for its W (the defer target of its customgrad nodes)."""

    __slots__ = (
        "asked_once", "captured", "deferred", "direct", "done", "keep", "once", "once_ids", "plan",
        "ran", "skip", "split", "split_ids", "watch",
    )  # fmt: skip

    def __init__(self) -> None:
        self.once_ids: frozenset[int] = frozenset()
        self.split_ids: frozenset[int] = frozenset()  # the Function nodes that split
        self.done = False
        # What runs while W calls a node itself (explain_split counts its FLOPs to the node).
        self.watch: Watch | None = None
        self.clear()

    def defer(self, record: NodeRecord, work: DeferredWork) -> None:
        self.deferred[record] = work

    def clear(self) -> None:
        """Drop what W takes (all of it, after W); what the tools read stays."""
        self.deferred: dict[NodeRecord, WeightWork] = {}
        self.captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
        # Function nodes run once: what each left for W in I (None: a weight-side gradient was
        # missing), then, per W call, that work and the nodes W asks again.
        self.ran: dict[Node, FunctionWork | None] = {}
        # Function nodes whose backward split in I: what their weight pass needs, until their
        # post-hook moves it to ``ran``.
        self.split: dict[Node, FunctionSplit] = {}
        self.once: dict[int, list[FunctionWork]] = {}
        self.asked_once: dict[int, list[tuple[list[Node], list[Node]]]] = {}
        # Per W call: the Function nodes I ran that its engine calls may reach with no gradient
        # (below a node W runs again whose input edges lead to the call's weights): they
        # compute nothing there (see _skipped_below).
        self.skip: dict[int, list[Node]] = {}
        self.direct: dict[int, tuple[Node, int, torch.Tensor]] = {}
        self.plan = InputPassPlan()
        # On torch 2.11 and 2.12, what keeps the graph alive until W (see keep_graphs).
        self.keep: list[object] = []

    def __repr__(self) -> str:
        return (
            f"<customgrad split state: {len(self.deferred)} deferred customgrad weight halves, "
            f"{len(self.once)} Functions run once, "
            f"{len(self.captured)} native intermediates{', used' if self.done else ''}>"
        )


def found_state(param_groups: object) -> SplitState | None:
    """The split state :func:`stage_backward_input` left in its ``param_groups``, if it is one
    (None for anything else; :func:`state_of` raises)."""
    if isinstance(param_groups, list) and len(param_groups) == 1:
        first = param_groups[0]
        state = first.get(STATE_KEY) if isinstance(first, dict) else None
        if isinstance(state, SplitState):
            return state
    return None


def split_functions_of(param_groups: object) -> set[int]:
    """The ``id``\\ s of the plain Function nodes whose backward :func:`stage_backward_input`
    split (input work in I, weight work in W), read off its ``param_groups`` (empty for
    anything else)."""
    state = found_state(param_groups)
    return set(state.split_ids) if state is not None else set()


def ran_once(param_groups: object) -> set[int]:
    """The ``id``\\ s of the plain Function nodes that :func:`stage_backward_input` ran once,
    handing the weight gradients they returned to W, read off its ``param_groups`` before W runs
    (empty for anything else)."""
    state = found_state(param_groups)
    return set(state.once_ids) if state is not None else set()


def watch_direct_calls(param_groups: object, watch: Watch) -> None:
    """Have W run ``watch(node)`` around each call it makes of a node itself (outside the
    engine: no hook of the node fires), on :func:`stage_backward_input`'s ``param_groups``,
    before W runs (nothing for anything else). For tools that watch W."""
    state = found_state(param_groups)
    if state is not None:
        state.watch = watch


def deferred_nodes(param_groups: object) -> set[Node]:
    """The customgrad nodes whose weight half :func:`stage_backward_input` handed to W, read
    off its ``param_groups`` before W runs (empty for anything else, such as torch's)."""
    state = found_state(param_groups)
    return set(state.plan.deferred) if state is not None else set()


def deferred_work(param_groups: object) -> dict[NodeRecord, WeightWork]:
    """The weight halves :func:`stage_backward_input` deferred, by node record, read off its
    ``param_groups`` before W runs (W runs the values found here then; empty for anything
    else). For tools that watch W (``explain_split`` counts their FLOPs to their nodes)."""
    state = found_state(param_groups)
    return state.deferred if state is not None else {}


def state_of(param_groups: object) -> SplitState:
    """The split state in ``param_groups``, for its one weight pass."""
    state = found_state(param_groups)
    if state is None:
        got = type(param_groups).__name__
        raise SplitStateError(MSG_FOREIGN_STATE.format(got=got)) from None
    if state.done:
        raise SplitStateError(MSG_REUSED_STATE)
    return state
