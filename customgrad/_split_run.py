"""A backward run three ways and compared: in full, then the input pass, then the weight pass.

``check_op``'s ``split`` and ``flops`` checks and ``explain_split`` both run a backward in full,
then split (I, then W), each pass under its own FLOP counter (and launch counter), and compare
the split's gradients with the full backward's. :class:`SplitRun` is that one run: the caller
says what each pass runs (an ``autograd.grad`` restricted to some leaves, a stage's
``stage_backward_input``), :meth:`SplitRun.run` counts it, :func:`differences` compares.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from customgrad._flops import FlopCounter
from customgrad._launches import LaunchCounter

__all__ = ["PASSES", "Difference", "SplitRun", "differences"]

PASSES = ("full", "input", "weight")
"""The passes a split is compared in, in the order they run."""

_R = TypeVar("_R")


class SplitRun:
    """The passes of one backward, each counted: :attr:`phase` names the one running (hooks read
    it to attribute what they see), :meth:`counter` its FLOP counter.

    Args:
        record: keep the input and weight passes' counted calls (``FlopCounter.calls``), to
            find work both compute.
        launches: count kernel launches per pass too (:class:`~customgrad._launches.LaunchCounter`).
    """

    def __init__(self, *, record: bool = False, launches: bool = False) -> None:
        self.phase = "full"
        self._record = record
        self._count_launches = launches
        self.flop_counters: dict[str, FlopCounter] = {}
        self.launch_counters: dict[str, LaunchCounter] = {}

    def counter(self, phase: str | None = None) -> FlopCounter:
        """The FLOP counter of ``phase`` (the running pass when None)."""
        phase = self.phase if phase is None else phase
        found = self.flop_counters.get(phase)
        if found is None:
            found = self.flop_counters[phase] = FlopCounter(
                record=self._record and phase in ("input", "weight")
            )
        return found

    def run(self, phase: str, fn: Callable[[], _R]) -> _R:
        """Run ``fn`` as the pass ``phase`` (one of :data:`PASSES`, or another name for a run
        that belongs to none), under its counters."""
        before, self.phase = self.phase, phase
        with contextlib.ExitStack() as scope:
            scope.enter_context(self.counter(phase))
            if self._count_launches:
                launches = self.launch_counters[phase] = LaunchCounter()
                scope.enter_context(launches)
            try:
                return fn()
            finally:
                self.phase = before

    @property
    def flops(self) -> dict[str, int]:
        """FLOPs per pass of :data:`PASSES` that ran."""
        return {p: self.flop_counters[p].total for p in PASSES if p in self.flop_counters}


@dataclass(frozen=True)
class Difference:
    """A gradient the split computed that is not the full backward's.

    Attributes:
        index: its position in the gradients compared.
        error: the largest difference relative to the full gradient's largest value (inf when
            that is zero, or the shapes differ).
        detail: what ``torch.testing.assert_close`` said, its first lines.
    """

    index: int
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
    """The gradients of ``split`` that differ from ``full``'s, by
    ``torch.testing.assert_close`` (both tolerances None: its defaults for the dtype). A None
    gradient is zeros shaped like the tensor of ``like`` it is for."""
    found: list[Difference] = []
    for i, (want, got, ref) in enumerate(zip(full, split, like)):
        a = torch.zeros_like(ref) if want is None else want
        b = torch.zeros_like(ref) if got is None else got
        try:
            torch.testing.assert_close(b, a, atol=atol, rtol=rtol)
        except AssertionError as e:
            lines = str(e).strip().splitlines()
            detail = "\n".join(lines[:3]) + ("\n..." if len(lines) > 3 else "")
            scale = float(a.abs().max()) if a.numel() else 0.0
            same = a.shape == b.shape
            error = float((b - a).abs().max()) / scale if same and scale else float("inf")
            found.append(Difference(i, error, f"{type(e).__name__}: {detail}"))
    return found
