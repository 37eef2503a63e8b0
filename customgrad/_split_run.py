"""A backward run in full, then as its input pass and its weight pass, counted and compared.

``check_op`` (its ``split`` and ``flops`` checks) and ``explain_split`` both run a backward in
full and then split (I, then W), each pass under its own FLOP counter, and compare the split's
gradients with the full backward's: :class:`SplitRun` counts each pass the caller runs,
:func:`differences` compares.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import torch

from customgrad._flops import FlopCounter
from customgrad._launches import LaunchCounter

__all__ = ["PASSES", "Difference", "SplitRun", "differences"]

PASSES = ("full", "input", "weight")
"""The passes a split is compared in, in the order they run."""

_R = TypeVar("_R")


class SplitRun:
    """The passes of one backward, each under its own counters: :attr:`phase` names the pass
    running (hooks read it), :meth:`counter` gives a pass's FLOP counter.

    Args:
        record: keep the calls the input and weight passes counted (``FlopCounter.calls``).
        launches: count kernel launches per pass too (:attr:`launch_counters`).
    """

    def __init__(self, *, record: bool = False, launches: bool = False) -> None:
        self.phase = "full"
        self._record = record
        self._launches = launches
        self.flop_counters: dict[str, FlopCounter] = {}
        self.launch_counters: dict[str, LaunchCounter] = {}

    def counter(self, phase: str | None = None) -> FlopCounter:
        """The FLOP counter of ``phase`` (the running pass when None)."""
        phase = self.phase if phase is None else phase
        if phase not in self.flop_counters:
            record = self._record and phase in ("input", "weight")
            self.flop_counters[phase] = FlopCounter(record=record)
        return self.flop_counters[phase]

    def run(self, phase: str, fn: Callable[[], _R]) -> _R:
        """``fn()`` as the pass ``phase`` (of :data:`PASSES`, or another name for a run that
        belongs to none), counted."""
        before, self.phase = self.phase, phase
        with contextlib.ExitStack() as scope:
            scope.enter_context(self.counter(phase))
            if self._launches:
                scope.enter_context(self.launch_counters.setdefault(phase, LaunchCounter()))
            try:
                return fn()
            finally:
                self.phase = before

    @property
    def flops(self) -> dict[str, int]:
        """FLOPs of each pass of :data:`PASSES` that ran."""
        return {p: self.flop_counters[p].total for p in PASSES if p in self.flop_counters}


class Difference(NamedTuple):
    """A split gradient that is not the full backward's: its position, the largest difference
    relative to the full gradient's largest value (inf when that is 0 or the shapes differ), and
    what ``torch.testing.assert_close`` said."""

    at: int
    error: float
    detail: str


def differences(
    full: Sequence[torch.Tensor | None],
    split: Sequence[torch.Tensor | None],
    like: Sequence[torch.Tensor],
    *,
    atol: float | None = None,
    rtol: float | None = None,
) -> list[Difference]:
    """The gradients of ``split`` that ``torch.testing.assert_close`` finds unlike ``full``'s
    (both tolerances None: its defaults for the dtype); None is zeros shaped like ``like``'s."""
    found: list[Difference] = []
    for i, (want, got, ref) in enumerate(zip(full, split, like)):
        a = torch.zeros_like(ref) if want is None else want
        b = torch.zeros_like(ref) if got is None else got
        try:
            torch.testing.assert_close(b, a, atol=atol, rtol=rtol)
        except AssertionError as e:
            lines = str(e).strip().splitlines()
            detail = "\n".join(lines[:3]) + ("\n..." if len(lines) > 3 else "")
            scale = float(a.abs().max()) if a.numel() and a.shape == b.shape else 0.0
            error = float((b - a).abs().max()) / scale if scale else float("inf")
            found.append(Difference(i, error, f"{type(e).__name__}: {detail}"))
    return found
