"""What every backward call of an op did, counted over the run (for :func:`customgrad.summary`).

A pass's runner (:mod:`customgrad._codegen`) adds one to a slot of its op's :class:`CallCounts`
in each branch it can take, the slot chosen when the runner is written (what the branch does, in
which pass), so counting costs one list increment per call. ``summary()`` reads the counts, so
it describes the whole run, not the latest trace.
"""

from __future__ import annotations

__all__ = ["KINDS", "PHASES", "CallCounts", "slot"]

KINDS = ("split", "ran once", "handed", "whole", "per pass", "split off")
"""What one backward call of an op did:

- ``"split"``: the pass ran only its part of the backward (a half of the pair, the traced
  backward's part for this pass);
- ``"ran once"``: a backward that is not split ran whole in the first pass that needed a
  gradient and kept the later pass's gradients (the run-once rule);
- ``"handed"``: the later pass took the gradients the first pass kept (no backward work);
- ``"whole"``: the pass needed every gradient the node requires, and ran the backward for all
  of them (a full backward, or a node with nothing to split: only its weights, or only its
  inputs, require grad);
- ``"per pass"``: ``split="phase"``: the backward was called for this pass's gradients;
- ``"split off"``: the split was off (``CUSTOMGRAD_SPLIT=0``, :func:`customgrad.no_split`), so
  a pass that needed only part of the gradients ran the whole backward: work the other pass
  repeats.
"""

PHASES = ("input", "weight", "full")
"""The pass a call ran in: ``"input"`` (I: only non-weight gradients), ``"weight"`` (W: only
weight gradients), ``"full"`` (every gradient the pass needed, weights and inputs together)."""


def slot(kind: str, phase: str) -> int:
    """The index of (``kind``, ``phase``) in :attr:`CallCounts.counts`."""
    return KINDS.index(kind) * len(PHASES) + PHASES.index(phase)


class CallCounts:
    """The backward calls of one op, by what each did and in which pass.

    Attributes:
        counts: one count per (kind, phase), at :func:`slot`; runners add to it (without a
            lock: backwards running at the same moment on several threads may lose a count;
            the counts are a report, never an input to the split).
        other_split: the calls in a pass that needed only part of the gradients without
            customgrad's split having planned it (torch's ``stage_backward_input`` /
            ``stage_backward_weight``, ``autograd.grad`` asking for some inputs): a split
            whose plain ``autograd.Function``\\ s customgrad does not see.
    """

    __slots__ = ("counts", "other_split")

    def __init__(self) -> None:
        self.counts = [0] * (len(KINDS) * len(PHASES))
        self.other_split = 0

    def add(self, kind: str, phase: str) -> None:
        """Count one call (what the generated runners do inline)."""
        self.counts[slot(kind, phase)] += 1

    def by_kind(self) -> dict[str, dict[str, int]]:
        """The non-zero counts: ``{kind: {phase: calls}}``, kinds in :data:`KINDS` order.

        A ``"split off"`` call ran the whole backward's runner, which counted it ``"whole"`` in
        the ``"full"`` pass too; it is counted once here, as ``"split off"`` in the pass that
        needed part of it.
        """
        counts = list(self.counts)
        off = sum(counts[slot("split off", p)] for p in PHASES)
        full = slot("whole", "full")
        counts[full] = max(0, counts[full] - off)
        out: dict[str, dict[str, int]] = {}
        for kind in KINDS:
            phases = {p: counts[slot(kind, p)] for p in PHASES}
            phases = {p: n for p, n in phases.items() if n}
            if phases:
                out[kind] = phases
        return out

    def __repr__(self) -> str:
        return f"CallCounts({self.by_kind()})"
