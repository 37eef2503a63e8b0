"""What a stage's input pass leaves for its weight pass, and the drop-ins' error classes.

:func:`customgrad.pipelining.stage_backward_input` returns its :class:`SplitState` inside the
``param_groups`` torch's signature gives it (one dict); :func:`customgrad.pipelining.
stage_backward_weight` takes it back (:func:`state_of`, once), and tools that watch W
(``explain_split``, ``summary()``) read it before W runs through its one seam
(:class:`customgrad._split_plan.StageSplit`). Errors leaving the drop-ins are
``RuntimeError``\\ s too, as torch's are (:func:`runtime_errors`).

W's work comes in three shapes, as the engine needs them: pieces of weight work that compute
their gradients and the edges they go along (:class:`~customgrad.pipelining._streams.WeightWork`:
a customgrad node's deferred weight half, a plain Function's split weight pass or the gradients
its backward returned in I, and the gradients I recorded for nodes W runs again,
:class:`Resend`), per engine call of W; the nodes W asks for their weight side itself; and the
Function nodes it runs again in engine calls of their own.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch.autograd.graph import GradientEdge, Node

from customgrad._routing import Routed, WeightWork
from customgrad._split_plan import InputPassPlan, Watch, stage_split
from customgrad.pipelining._errors import SplitStateError
from customgrad.pipelining._function_split import FunctionOnce, FunctionSplit

__all__ = ["Resend", "SplitState", "runtime_errors", "state_of"]

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


class Resend:
    """Gradients I recorded for edges W sends them along again: those that reached a node W
    runs again (an intermediate), or an output's gradient bound for the weights only."""

    __slots__ = ("_pairs",)
    device = torch.device("cpu")  # (never queued: the queue defers customgrad halves only)

    def __init__(self, pairs: list[tuple[GradientEdge, torch.Tensor]]) -> None:
        self._pairs = pairs

    @classmethod
    def of(cls, node: Node, grads: tuple[torch.Tensor | None, ...]) -> Resend:
        """The gradients ``grads`` that reached ``node`` in I, sent to it again."""
        return cls([(GradientEdge(node, i), g) for i, g in enumerate(grads) if g is not None])

    def owner(self) -> Node | None:
        return None  # the engine runs these nodes (their hooks count them)

    def gradients(self) -> tuple[list[GradientEdge], list[torch.Tensor]]:
        pairs, self._pairs = self._pairs, []
        return [e for e, _ in pairs], [g for _, g in pairs]


class SplitState:
    """What one microbatch's I leaves for its W (the defer target of its customgrad nodes),
    and the tools' seam to it (:class:`customgrad._split_plan.StageSplit`)."""

    __slots__ = (
        "asked_once",
        "captured",
        "deferred",
        "done",
        "keep",
        "once_ids",
        "plan",
        "ran",
        "skip",
        "split_ids",
        "splitting",
        "watching",
        "work",
    )  # fmt: skip

    def __init__(self) -> None:
        self.once_ids: frozenset[int] = frozenset()
        self.split_ids: frozenset[int] = frozenset()  # the Function nodes that split
        self.done = False
        # What runs around each piece of work W runs outside the engine (explain_split counts
        # its FLOPs to its node).
        self.watching: Watch | None = None
        self.clear()

    def defer(self, record: Routed, work: WeightWork) -> None:
        self.deferred[record] = work

    def clear(self) -> None:
        """Drop what W takes (all of it, after W); what the tools read stays."""
        # During I: the customgrad nodes' deferred weight halves (by node), the gradients that
        # reached the nodes W runs again, what each Function node that ran once or split left
        # (None: a weight-side gradient was missing), those that split until their post-hook.
        self.deferred: dict[Routed, WeightWork] = {}
        self.captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
        self.ran: dict[Node, FunctionOnce | FunctionSplit | None] = {}
        self.splitting: dict[Node, FunctionSplit] = {}
        # For W, per engine call: its pieces of weight work, the Function nodes it runs again
        # in calls of their own, and the Function nodes I ran that its engine call may reach
        # with no gradient (they compute nothing there: see _backward._skipped_below).
        self.work: dict[int, list[WeightWork]] = {}
        self.asked_once: dict[int, list[tuple[list[Node], list[Node]]]] = {}
        self.skip: dict[int, list[Node]] = {}
        self.plan = InputPassPlan()
        # On torch 2.11 and 2.12, what keeps the graph alive until W (see keep_graphs).
        self.keep: list[object] = []

    # -- the tools' seam (StageSplit) ------------------------------------------------------------
    def deferred_nodes(self) -> set[Node]:
        return set(self.plan.deferred)

    def split_functions(self) -> set[int]:
        return set(self.split_ids)

    def once_functions(self) -> set[int]:
        return set(self.once_ids)

    def watch(self, watch: Watch) -> None:
        self.watching = watch

    def __repr__(self) -> str:
        pieces = sum(len(w) for w in self.work.values())
        return (
            f"<customgrad split state: {pieces} pieces of weight work, "
            f"{len(self.captured)} nodes asked again{', used' if self.done else ''}>"
        )


def state_of(param_groups: object) -> SplitState:
    """The split state in ``param_groups``, for its one weight pass."""
    state = stage_split(param_groups)
    if not isinstance(state, SplitState):
        got = type(param_groups).__name__
        raise SplitStateError(MSG_FOREIGN_STATE.format(got=got)) from None
    if state.done:
        raise SplitStateError(MSG_REUSED_STATE)
    return state
