"""The runtime of split backwards: which pass runs, and what it keeps for the later one.

Every backward customgrad splits into an input pass (I) and a weight pass (W) runs here, once
per call of a node's backward: a customgrad op's (its pass plan's runner), a traced single
backward's split program (:class:`customgrad._traced_split.TracedSplit`), a compiled region's
(:mod:`customgrad._compiled_backward`) and a plain ``autograd.Function``'s split in a stage
(:class:`customgrad.pipelining._function_split.FunctionSplit`). Those are adapters: they turn
their calling convention into a holder (the node's hand-off store,
:class:`customgrad._handoff.Holder`), the pass's output gradients and the slots it needs, and
hold no kept value themselves. This module

- says which of a node's edges the running pass needs (:func:`needed_edges`: the route a
  planned split gave the node, else the autograd engine's answer), the one rule for every node
  customgrad runs;
- decides, for a split program (:func:`run_program`), which pass runs: W from the values a
  matching I kept (the one ownership rule: same output gradients, unchanged), an input pass
  that keeps values for a later pass, or the full pass;
- is the only code that stores, fetches and frees what a pass keeps for a later one, through
  the hand-off store (:mod:`customgrad._handoff`): a split program's kept values, the shared
  work of a pair (``ctx.shared``), and the gradients a backward that cannot split computed in
  its first pass (the run-once rule); each with its version guard, checked when read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol

import torch

from customgrad._handoff import (
    NO_HANDOFF,
    Guard,
    HeldGradients,
    Holder,
    Kept,
    SharedWork,
    hand_over,
    handed_over,
    pending,
    release,
)
from customgrad._rules import Gradient
from customgrad._torch.engine import (
    ACCUMULATE_GRAD,
    EVERY_EDGE,
    captured_by_caller,
    edge_query,
    graph_task_id,
)

if TYPE_CHECKING:
    from customgrad._split_program import Pass, ProgramCut, SplitProgram

__all__ = [
    "CaptureMemo",
    "Ran",
    "free",
    "keep_gradients",
    "keep_shared",
    "needed_edges",
    "run_program",
    "shared_of",
    "take_gradients",
]

_ACCUMULATE = ACCUMULATE_GRAD
_EVERY_EDGE = EVERY_EDGE
_edge_query = edge_query
_graph_task_id = graph_task_id
_NOTHING: frozenset[int] = frozenset()


# --------------------------------------------------------------------------------------------
# Which edges the running pass needs


class CaptureMemo:
    """Which leaves the running ``torch.autograd.grad`` captures, remembered per graph task.

    The engine's query (``_will_engine_execute_node``) raises for a leaf that ``autograd.grad``
    captures, and each raise costs about as much as a small op's whole backward. The caller
    that started the pass knows its inputs: torch's own ``_engine_run_backward`` frame, below
    the node's backward on the calling thread (the engine runs CPU graph tasks there), holds
    them. :meth:`captured_now` reads them once per graph task; a captured leaf is then needed
    without asking the engine. Every other edge is still asked, so a frame that is missing or
    not what it seems costs only speed, never a gradient.
    """

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: tuple[int, frozenset[int]] = (-2, _NOTHING)

    def captured_now(self, above: int = 1) -> frozenset[int]:
        """The ``id`` of each leaf tensor the running ``autograd.grad`` captures (none when
        unknown; :data:`EVERY_EDGE` in a ``.backward()`` that runs every node it reaches).

        Args:
            above: Python frames between the caller and torch's ``_engine_run_backward``.
        """
        task = _graph_task_id()
        last = self._last  # one tuple, replaced whole: threads never see half an update
        if last[0] == task:
            return last[1]
        captured = captured_by_caller(2 + above)
        self._last = (task, captured)
        return captured


class HasEdges(Protocol):
    """A node, as :func:`needed_edges` reads it."""

    @property
    def next_functions(self) -> tuple[tuple[object, int], ...]: ...


def needed_edges(
    node: HasEdges,
    flags: Sequence[bool | None] | None,
    memo: CaptureMemo | None,
    above: int = 1,
) -> Sequence[bool] | None:
    """For each input edge of ``node`` (``next_functions``), whether the running pass uses the
    gradient sent along it; None: every edge (a ``.backward()`` without ``inputs=``).

    ``flags``: what a planned split told the node (its route), per edge (None: ask). Else the
    autograd engine is asked (any error, as for a leaf ``autograd.grad`` captures, means
    "needed"); ``memo`` (with ``above``, the frames between the caller and the node's
    ``apply``) names the leaves ``autograd.grad`` captures, which are needed without asking.
    """
    if flags is not None and None not in flags:
        return flags  # type: ignore[return-value]  # (the route says it all)
    captured = _NOTHING
    if memo is not None:
        captured = memo.captured_now(above + 1)
        if captured is _EVERY_EDGE:  # .backward() without inputs=: every edge it reaches
            return None if flags is None else [f is not False for f in flags]
    out: list[bool] = []
    for e, (fn, _) in enumerate(node.next_functions):
        need = None if flags is None else flags[e]
        if need is None:
            if fn is None:
                need = False
            elif captured and type(fn) is _ACCUMULATE and id(fn.variable) in captured:  # type: ignore[attr-defined]
                need = True
            else:
                try:
                    need = _edge_query(fn)
                except Exception:  # a leaf autograd.grad captures, or outside a backward
                    need = True
        out.append(need)
    return out


# --------------------------------------------------------------------------------------------
# A split program's passes


class Ran(NamedTuple):
    """What :func:`run_program` ran: ``mode`` (``"weight"``, ``"input"`` or ``"full"``; None
    when the pass needs nothing of the program), the pass, its outputs in the pass's slot order
    (``p.slots``), and for an input pass its cut and what it kept (None when nothing)."""

    mode: Literal["weight", "input", "full"] | None
    p: Pass | None
    outputs: Sequence[torch.Tensor | None]
    cut: ProgramCut | None = None
    kept: Kept | None = None


_NOTHING_RAN = Ran(None, None, ())

GuardOf = Callable[[Kept], Guard]
"""What guards a program's kept values for a holder: the versions of tensors W reads with them
that nothing else checks (a compiled region's saved tensors). A traced or a Function's split
needs none: what its kept values are computed from, W's saved tensors and output gradients, is
guarded by the work that holds them, and by torch's own check when the engine unpacks them."""


def run_program(
    holder: Holder,
    program: SplitProgram,
    grads: Sequence[object],
    args: list[object],
    needed: frozenset[int],
    requires: frozenset[int],
    keep: bool,
    guard_of: GuardOf | None = None,
    on_other: Callable[[], None] | None = None,
) -> Ran:
    """Run the pass of ``program`` that computes the slots ``needed`` of a node whose slots
    ``requires`` require grad, on ``args`` (the program's inputs; a boxed call empties them).

    - W: a pass of ``holder``'s node with the same output gradients ``grads`` kept values whose
      cut's weight pass computes ``needed``: that weight pass runs on them (their guard checked
      first), and they are freed;
    - an input pass: the pass leaves slots that require grad for a later one; the cut "these
      now, the rest later" runs its input pass, and with ``keep`` (a later pass can come)
      hands its kept values to ``holder`` (guarded by ``guard_of``);
    - the full pass otherwise (or where the program cannot cut: what the backend could not
      compile runs whole).

    ``on_other`` is called when kept values that would serve were made by a pass of other
    output gradients (another loss, or gradients changed in place: this pass computes for
    itself).
    """
    pattern = program.patterns.get((needed, requires))
    if pattern is None:  # the slots it computes and those it leaves for later
        live = program.live
        want = needed & live
        pattern = program.patterns[needed, requires] = (want, (requires & live) - want)
    want, later = pattern
    if not want:
        return _NOTHING_RAN
    if holder.handoff is not None:
        found = handed_over(holder, grads, "kept")
        if isinstance(found, Kept) and found.cut.serves(program, want):
            release(holder, grads)
            p = program.weight_pass(found.cut, want)
            args.extend(found.values)
            del found
            return Ran("weight", p, p.fn(args) if program.boxed else p.fn(*args))
        if on_other is not None and any(
            isinstance(h.value, Kept) and h.value.cut.serves(program, want) for h in pending(holder)
        ):
            on_other()
    cut = program.cut_or_none(later) if later else None
    if cut is None:
        p = program.whole()
        return Ran("full", p, p.fn(args) if program.boxed else p.fn(*args))
    p = cut.input_pass
    outs = p.fn(args) if program.boxed else p.fn(*args)
    n = len(p.slots)
    kept = None
    if keep:  # (nothing to keep still tells the later pass which cut it finishes)
        kept = Kept(cut, tuple(outs[n:]))
        hand_over(holder, grads, "kept", kept, None if guard_of is None else guard_of(kept))
    elif holder.handoff is not None:
        release(holder, grads)
    return Ran("input", p, outs[:n] if len(outs) > n else outs, cut, kept)


# --------------------------------------------------------------------------------------------
# A customgrad op's other hand-offs: shared work, and the run-once rule's gradients


def shared_of(holder: Holder, grads: Sequence[object]) -> object:
    """What ``register_backward_shared`` computed in an earlier pass of the node with output
    gradients ``grads`` (its guard checked), or :data:`NO_HANDOFF`."""
    if holder.handoff is None:
        return NO_HANDOFF
    found = handed_over(holder, grads, "shared")
    return found.value if isinstance(found, SharedWork) else NO_HANDOFF


def keep_shared(holder: Holder, grads: Sequence[object], value: object) -> None:
    """Keep the shared work ``value`` for the node's later pass (what it was computed from, the
    saved tensors and output gradients, is guarded by the deferred half that reads them, and
    by torch's check when the engine unpacks them)."""
    hand_over(holder, grads, "shared", SharedWork(value))


def take_gradients(
    holder: Holder, grads: Sequence[object], needed: frozenset[str]
) -> dict[str, Gradient] | None:
    """The gradients ``needed`` that the node's first pass computed for this one (the run-once
    rule), or None when it left none for a pass with output gradients ``grads``. Freed once
    every gradient it left was taken."""
    if holder.handoff is None:
        return None
    handed = handed_over(holder, grads, "gradients")
    if not isinstance(handed, dict):
        return None
    got = {n: handed.pop(n) for n in needed if n in handed}
    if not handed:
        release(holder, grads)
    return got


def keep_gradients(
    holder: Holder, grads: Sequence[object], every: HeldGradients, needed: frozenset[str]
) -> dict[str, Gradient]:
    """Of the gradients ``every`` a backward that cannot split computed at once, return those
    ``needed`` now and keep the others for the node's later pass."""
    got = {n: every.pop(n) for n in needed if n in every}
    hand_over(holder, grads, "gradients", every)
    return got


def free(holder: Holder, grads: Sequence[object]) -> None:
    """Free what the pass with output gradients ``grads`` kept (its later pass ran)."""
    if holder.handoff is not None:
        release(holder, grads)
