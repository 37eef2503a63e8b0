"""The hand-off: what the earlier pass of a node's backward computed for its later pass.

One store and one type for every kind of hand-off between the input pass (I) and the weight pass
(W), on customgrad nodes and compiled regions' nodes alike (a :class:`Holder`: a customgrad node's
record, or the state :mod:`customgrad._compiled_backward` puts on a compiled region's node). What
is handed over (:data:`HandOffValue`) is one of: the work a pair's halves share
(``register_backward_shared``: :class:`SharedWork`); the values the input pass of a split program
keeps for its weight pass, a traced backward's or a compiled region's (:class:`Kept`); or the
weight gradients of a backward that is not split, run once in I (the run-once rule:
:data:`HeldGradients`). The same rules hold for each:

- it belongs to the pass that made it: only a pass with the same output gradients (the same
  tensors, not written to since) reads it, never a pass of another loss through the same node
  (:func:`record_pass` keeps weak references and version counters, so the record holds no
  gradient alive);
- it lives on the node's holder until the later pass takes it (:func:`release`), or the graph
  is freed with the node (nothing else refers to it:
  no reference cycle). A node keeps up to :data:`MAX_PENDING` of them, one per pass whose
  later pass has not run yet: two losses through one node, run in torch's order I(loss 1),
  I(loss 2), W(loss 1), W(loss 2), each find their own;
- an output the loss does not use gets fresh zeros from autograd in each pass: for a node with
  several differentiable outputs the record also keeps, per gradient, whether it had a nonzero
  (a 0-dim tensor, read only when the tensors differ), so zeros match zeros;
- torch's saved-tensor rule holds across the passes: what W reads of what I kept (the values
  themselves, and the saved tensors and output gradients they were computed from) carries a
  :class:`Guard`, the tensors' version counters as I left them, checked when W reads them
  (:meth:`Guard.check`); a tensor written in place in between raises
  :class:`~customgrad.ModifiedBetweenPassesError`, as torch's version counter does for a
  plain backward.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Generic, Literal, NamedTuple, Protocol, TypeAlias, TypeVar

import optree
import torch

from customgrad._errors import ModifiedBetweenPassesError
from customgrad._rules import Gradient

if TYPE_CHECKING:
    from customgrad._split_program import ProgramCut

__all__ = [
    "MSG_MODIFIED",
    "NO_HANDOFF",
    "Describe",
    "Guard",
    "HandOff",
    "HandOffKind",
    "HandOffValue",
    "HeldGradients",
    "Holder",
    "Kept",
    "PassRecord",
    "SharedWork",
    "describer",
    "guard",
    "check_pass",
    "edge_name",
    "checked",
    "hand_over",
    "handed_over",
    "nbytes",
    "pending",
    "record_pass",
    "release",
    "same_pass",
    "read_values",
    "tensors_of",
    "verify",
    "versions",
]

NO_HANDOFF: Any = object()
"""What :func:`handed_over` answers when nothing was handed over (a value handed over may be
None)."""

MAX_PENDING = 4
"""The hand-offs a node keeps at most, one per pass whose later pass has not run (the oldest
goes first: its later pass then computes for itself)."""

HandOffKind = Literal["shared", "kept", "gradients"]
"""Which value a hand-off holds: :class:`SharedWork`, :class:`Kept` or :data:`HeldGradients`."""


class Kept(NamedTuple):
    """What the input pass of a split program (a traced backward, a compiled region's backward)
    keeps for its weight pass: the cut whose input pass made them, and the values, in the order
    the cut's weight pass takes them."""

    cut: ProgramCut
    values: tuple[torch.Tensor, ...]


class SharedWork(NamedTuple):
    """What ``register_backward_shared`` returned (read as ``ctx.shared`` in both halves)."""

    value: object


HeldGradients: TypeAlias = dict[str, Gradient]
"""The gradients a run-once backward computed in its first pass for the later one, by name."""

HandOffValue: TypeAlias = Kept | SharedWork | HeldGradients
"""What a :class:`HandOff` holds."""


class Holder(Protocol):
    """What holds a node's hand-offs: a customgrad node's record, or a compiled region's node
    state. ``differentiable``: per output, whether it is differentiable (None: all are)."""

    handoff: HandOff[HandOffValue] | None

    @property
    def differentiable(self) -> Sequence[bool] | None: ...

    @property
    def label(self) -> str:
        """What errors call the node."""


MSG_MODIFIED = """\
{label}: {what}, which the weight pass (W) reads, was modified by an inplace operation after \
the input pass (I) used it: it is at version {now}; expected version {then} instead. W would \
compute gradients from the changed value (torch's autograd refuses a plain backward the same \
way: "one of the variables needed for gradient computation has been modified by an inplace \
operation"). Between the input and the weight pass (stage_backward_input and \
stage_backward_weight, a WeightGradQueue's backward and run), do not write in place into the \
tensors a backward saved or its output gradients: write out of place (h = h * 2, not \
h.mul_(2)), or clone the tensor and change the clone. ({where})"""

Describe = Callable[[int], tuple[str, str]]
"""The ``i``-th tensor a :class:`Guard` watches, in words: ``(what, where it was saved)``."""


class Guard:
    """The version counters of the tensors a later pass reads, as the earlier pass left them
    (:func:`versions`), checked when it reads them (:func:`verify`).

    ``values`` may hold other things besides tensors (they have no version and are not
    checked). ``weak``: the tensors are held by weak references (values the guard's holder does
    not keep for W itself, such as the saved tensors of a backward that ran once): a tensor
    nobody holds any more cannot be written to, and is not checked. ``describe(i)`` names the
    ``i``-th value in the error (called only then).
    """

    __slots__ = ("_describe", "_values", "_versions", "_weak")

    def __init__(self, values: Sequence[object], describe: Describe, weak: bool = False) -> None:
        self._versions = versions(values)
        self._values: Sequence[Any] = (
            [weakref.ref(v) if isinstance(v, _Tensor) else None for v in values] if weak else values
        )
        self._describe = describe
        self._weak = weak

    def check(self, label: str) -> None:
        """Raise :class:`~customgrad.ModifiedBetweenPassesError` for the first tensor written
        to in place since the guard was made (``label``: the node, as errors name it)."""
        values = [r and r() for r in self._values] if self._weak else self._values
        verify(label, values, self._versions, lambda: self._describe)


_Tensor = torch.Tensor
_VERSION = itertools.repeat("_version")
_NO_VERSION = itertools.repeat(None)


def versions(values: Sequence[object]) -> list[int | None]:
    """The version counter of each of ``values`` (None for what is not a tensor)."""
    return [*map(getattr, values, _VERSION, _NO_VERSION)]  # (in C: no Python loop)


def verify(
    label: str,
    values: Sequence[object],
    then: list[int | None],
    describe: Callable[[], Describe],
) -> None:
    """torch's saved-tensor rule across the passes: raise
    :class:`~customgrad.ModifiedBetweenPassesError` for the first of ``values`` whose version
    moved since ``then`` was read (``describe()`` gives what names them, made only then)."""
    now = versions(values)
    if now == then:
        return
    for i, (v, was) in enumerate(zip(now, then)):
        if v is not None and was is not None and v != was:
            what, where = describe()(i)
            raise ModifiedBetweenPassesError(
                MSG_MODIFIED.format(label=label, what=what, now=v, then=was, where=where)
            )


def read_values(
    grads: Sequence[object], saved: object, more: Sequence[object] = ()
) -> tuple[object, ...]:
    """What a guard over the output gradients ``grads`` (a list per list output), the saved
    values ``saved`` (a pytree) and ``more`` watches, in that order (see :func:`describer`)."""
    if type(saved) is tuple and list not in map(type, grads):  # the common case: flat
        return (*grads, *saved, *more)  # (saved: a tuple here)
    return (*tensors_of(list(grads)), *tensors_of(saved), *more)


def describer(
    grads: Sequence[object],
    saved: object,
    describe_saved: Describe,
    describe_more: Describe | None = None,
) -> Describe:
    """What names the ``i``-th of :func:`read_values` ``(grads, saved, more)``: an output
    gradient, the ``k``-th saved tensor (``describe_saved(k)``), or the ``k``-th of ``more``."""
    flat = type(saved) is tuple and list not in map(type, grads)
    n_grads = len(grads) if flat else len(tensors_of(list(grads)))
    n_saved = len(saved) if flat else len(tensors_of(saved))  # type: ignore[arg-type]

    def describe(i: int) -> tuple[str, str]:
        if i < n_grads:
            outputs = range(n_grads) if flat else [
                j for j, g in enumerate(grads) for _ in tensors_of(g)
            ]  # fmt: skip
            return f"the gradient of output {outputs[i]}", "given to the input pass"
        if i < n_grads + n_saved:
            j = i - n_grads
            k = len(tensors_of(list(saved)[:j])) if flat else j  # type: ignore[call-overload]
            return describe_saved(k)
        k = i - n_grads - n_saved
        return describe_more(k) if describe_more is not None else (f"kept value {k}", "")

    return describe


def guard(
    grads: Sequence[object],
    saved: object,
    describe_saved: Describe,
    more: Sequence[object] = (),
    describe_more: Describe | None = None,
    weak: bool = False,
) -> Guard:
    """A :class:`Guard` over the output gradients ``grads`` (a list per list output), the
    tensors of ``saved`` (a pytree) and ``more``, in that order. ``describe_saved(k)`` names the
    ``k``-th saved tensor, ``describe_more(k)`` the ``k``-th of ``more``."""
    values = read_values(grads, saved, more)
    return Guard(values, describer(grads, saved, describe_saved, describe_more), weak)


def tensors_of(value: object) -> list[torch.Tensor]:
    """The tensors of a pytree (output gradients, a saved pytree, shared work), in order."""
    if isinstance(value, _Tensor):
        return [value]
    if value is None:
        return []
    leaves: list[object] = optree.tree_leaves(value, none_is_leaf=True)  # type: ignore[arg-type]
    return [t for t in leaves if isinstance(t, _Tensor)]


def edge_name(t: torch.Tensor, edges: Sequence[tuple[object, int]], names: Sequence[str]) -> str:
    """``" (argument 'x')"`` when ``t`` is the input of a node whose edges are ``edges`` (its
    ``next_functions``, named ``names``): the same tensor on the same edge; else ``""``."""
    edge: tuple[object, int] | None = None
    if t.grad_fn is not None:
        edge = (t.grad_fn, t.output_nr)
    elif t.requires_grad:
        try:
            found = torch.autograd.graph.get_gradient_edge(t)
            edge = (found.node, found.output_nr)
        except (AssertionError, RuntimeError):  # no edge torch can name
            edge = None
    if edge is not None:
        for (fn, nr), name in zip(edges, names):
            if fn is edge[0] and nr == edge[1]:
                return f" (argument {name!r})"
    return ""


PassRecord = tuple[object, ...]
"""The output gradients a pass was given, as :func:`record_pass` keeps them: per gradient a
weak reference and its version counter (a list of those for a list output; None for none)."""

_ANY: Any = object()  # a non-differentiable output's gradient: not compared


def record_pass(
    grads: Sequence[object], differentiable: Sequence[bool] | None = None
) -> PassRecord:
    """A record of the output gradients ``grads`` that holds none of them alive. The gradients of
    non-differentiable outputs are not recorded: autograd makes new zeros for them each pass."""
    out: list[Any] = []
    several = (
        sum(differentiable) if differentiable is not None else len(grads)
    ) > 1  # an unused output's gradient is autograd's fresh zeros, each pass
    for i, g in enumerate(grads):
        if differentiable is not None and not differentiable[i]:
            out.append(_ANY)
        elif isinstance(g, torch.Tensor):
            if several:
                out.append((weakref.ref(g), g._version, g.any()))
            else:
                out.append((weakref.ref(g), g._version))
        elif isinstance(g, list):
            out.append(
                [(weakref.ref(t), t._version) if isinstance(t, torch.Tensor) else None for t in g]
            )
        else:
            out.append(None)
    return tuple(out)


def _same(entry: Any, g: Any) -> bool:
    if entry is None:
        return g is None
    if entry[0]() is g:
        return bool(g._version == entry[1])
    # Zeros for zeros (an output no loss uses: autograd makes new ones each pass).
    return (
        len(entry) == 3 and isinstance(g, torch.Tensor) and not bool(entry[2]) and not bool(g.any())
    )


def same_pass(made: PassRecord | None, grads: Sequence[object] | None) -> bool:
    """Whether ``grads`` are the output gradients ``made`` records: the same tensors, none of
    them written to since (a pass of other gradients, or of gradients changed in place between
    the passes, is another pass)."""
    if made is None or grads is None or len(made) != len(grads):
        return False
    for entry, g in zip(made, grads):
        if entry is _ANY:
            continue
        if isinstance(entry, list):
            if not isinstance(g, list) or len(g) != len(entry):
                return False
            if not all(_same(e, t) for e, t in zip(entry, g)):
                return False
        elif not _same(entry, g):
            return False
    return True


V = TypeVar("V")


class HandOff(Generic[V]):
    """What one pass of a node computed for the node's later pass (a :data:`HandOffValue` in a
    :class:`Holder`'s store).

    Attributes:
        made: the output gradients of the pass that made it (:func:`record_pass`): only a pass
            with the same ones, unchanged, reads it.
        kind: ``"shared"`` (``ctx.shared``), ``"kept"`` (a split program's kept values) or
            ``"gradients"`` (gradients computed early by a backward that runs once).
        value: what is handed over.
        guard: the version counters of the tensors W reads with it (:class:`Guard`), checked
            when W first reads it; None once checked.
        next: the hand-off of an earlier pass of the node whose later pass has not run yet
            (see :data:`MAX_PENDING`), or None.
    """

    __slots__ = ("guard", "kind", "made", "next", "value")

    def __init__(
        self, made: PassRecord, kind: HandOffKind, value: V, guard: Guard | None = None
    ) -> None:
        self.made = made
        self.kind = kind
        self.value = value
        self.guard = guard  # the versions of what W reads of it, until W checked them
        self.next: HandOff[V] | None = None  # the node's hand-off of an earlier pass, if pending

    def made_by(self, grads: Sequence[object] | None) -> bool:
        """Whether a pass with output gradients ``grads`` is the pass that made it."""
        return same_pass(self.made, grads)

    def __repr__(self) -> str:
        return f"<HandOff {self.kind}: {nbytes(self.value)} bytes>"


def hand_over(
    record: Holder,
    grads: Sequence[object],
    kind: HandOffKind,
    value: HandOffValue,
    guard: Guard | None = None,
) -> None:
    """Keep ``value`` on ``record`` for the node's later pass (made by a pass with ``grads``),
    beside the pending hand-offs of other passes (what this pass made before is replaced);
    ``guard``: the versions of what the later pass reads with it (checked when it reads it)."""
    made = record_pass(grads, record.differentiable)
    new: HandOff[HandOffValue] = HandOff(made, kind, value, guard)
    new.next = _without(record.handoff, grads, MAX_PENDING - 1)
    record.handoff = new


def handed_over(record: Holder, grads: Sequence[object], kind: HandOffKind) -> object:
    """What the node's earlier pass kept of ``kind`` (a :data:`HandOffValue`) for a pass with
    output gradients ``grads`` (:data:`NO_HANDOFF` when nothing, or when it was made by a pass
    of other gradients)."""
    for handoff in pending(record):
        if handoff.kind == kind and handoff.made_by(grads):
            checked(record, handoff)
            return handoff.value
    return NO_HANDOFF


def checked(record: Holder, handoff: HandOff[HandOffValue]) -> None:
    """Check ``handoff``'s guard (once: the first read checks it) for the node ``record``."""
    found = handoff.guard
    if found is not None:
        found.check(record.label)
        handoff.guard = None


def check_pass(record: Holder, grads: Sequence[object]) -> None:
    """Check the guards of what the pass with output gradients ``grads`` finds on ``record``,
    before it reads anything (a compiled region's node, whose backward first unpacks its saved
    tensors: customgrad's error, not torch's)."""
    for handoff in pending(record):
        if handoff.guard is not None and handoff.made_by(grads):
            checked(record, handoff)


def pending(record: Holder) -> Iterator[HandOff[HandOffValue]]:
    """The hand-offs ``record`` holds, newest first (one per pass whose later pass has not
    run)."""
    handoff = record.handoff
    while handoff is not None:
        yield handoff
        handoff = handoff.next


def release(record: Holder, grads: Sequence[object]) -> None:
    """Free what the pass with output gradients ``grads`` kept (its later pass ran); the
    hand-offs of other passes stay."""
    record.handoff = _without(record.handoff, grads, MAX_PENDING)


def _without(
    chain: HandOff[HandOffValue] | None, grads: Sequence[object], keep: int
) -> HandOff[HandOffValue] | None:
    """``chain`` less the hand-offs made by a pass with ``grads``, at most ``keep`` of them."""
    kept: list[HandOff[HandOffValue]] = []
    while chain is not None:
        if len(kept) < keep and not chain.made_by(grads):
            kept.append(chain)
        chain = chain.next
    head: HandOff[HandOffValue] | None = None
    for h in reversed(kept):
        h.next = head
        head = h
    return head


def nbytes(value: object) -> int:
    """The bytes of the tensors in ``value`` (a pytree), each storage counted once."""
    seen: set[int] = set()
    total = 0
    leaves: list[object] = optree.tree_leaves(value, none_is_leaf=True)  # type: ignore[arg-type]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            storage = leaf.untyped_storage()
            key = storage.data_ptr() if storage.data_ptr() else id(storage)
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total
