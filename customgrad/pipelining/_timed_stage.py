"""The stage subclass :class:`~customgrad.pipelining.ActionTimer` times actions with.

torch's schedules call five methods of a stage per microbatch: ``forward_one_chunk``,
``backward_one_chunk`` (I or B), ``backward_weight_one_chunk`` (W), and ``get_fwd_recv_ops`` /
``get_bwd_recv_ops`` when a receive is posted. torch has no hook around them
(``_PipelineScheduleRuntime.register_custom_function`` replaces an action instead of wrapping
it, and the single-stage schedules have none), so the timer puts a subclass in front of the
stage class that overrides them and calls ``super()``. This module is the one place that
depends on those methods: :func:`stage_methods_mismatch` checks their signatures on the torch it
runs with, and :func:`timed_stage_class` refuses, with a clear error, a torch whose stage changed
(tests/test_timing.py fails loudly then too).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from customgrad._errors import UnsupportedError

if TYPE_CHECKING:
    from customgrad.pipelining._timing import ActionTimer

__all__ = ["STAGE_METHODS", "stage_methods_mismatch", "timed_stage_class"]

#: The methods wrapped, and the leading parameters each must take (after ``self``).
STAGE_METHODS: dict[str, tuple[str, ...]] = {
    "forward_one_chunk": ("fwd_chunk_id",),
    "backward_one_chunk": ("bwd_chunk_id", "loss", "full_backward"),
    "backward_weight_one_chunk": ("bwd_chunk_id",),
    "get_fwd_recv_ops": ("fwd_chunk_id",),
    "get_bwd_recv_ops": ("bwd_chunk_id",),
}

MSG_STAGE_CHANGED = (
    "ActionTimer.stage_class({base}): torch {version}'s pipeline stage no longer matches what "
    "the timer wraps ({mismatch}). Time actions by hand with timer.action(kind, stage, "
    "microbatch) around your own loop, or use a torch release customgrad supports."
)


def stage_methods_mismatch(base: type) -> str | None:
    """What about ``base``'s per-microbatch methods differs from what the timer wraps, or None."""
    for name, params in STAGE_METHODS.items():
        method = getattr(base, name, None)
        if not callable(method):
            return f"no method {name}"
        got = tuple(inspect.signature(method).parameters)[1 : 1 + len(params)]
        if got != params:
            return f"{name} takes {got}, expected {params} first"
    return None


def timed_stage_class(base: type, timer: ActionTimer) -> type:
    """A subclass of ``base`` whose actions ``timer`` records.

    Raises:
        UnsupportedError: ``base`` lacks one of :data:`STAGE_METHODS` as expected.
    """
    mismatch = stage_methods_mismatch(base)
    if mismatch is not None:
        raise UnsupportedError(
            MSG_STAGE_CHANGED.format(
                base=base.__name__, version=torch.__version__, mismatch=mismatch
            )
        )
    name = f"Timed{base.__name__}"
    return type(name, (_TimedStage, base), {"_timer": timer, "__qualname__": name})


class _TimedStage:
    """Put in front of a pipeline stage class by :func:`timed_stage_class`."""

    _timer: ActionTimer
    stage_index: int

    def forward_one_chunk(self, fwd_chunk_id: int, *args: object, **kwargs: object) -> object:
        with self._timer.action("F", self.stage_index, fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)  # type: ignore[misc]

    def backward_one_chunk(
        self,
        bwd_chunk_id: int,
        loss: torch.Tensor | None = None,
        full_backward: bool = True,
        **kwargs: object,
    ) -> None:
        with self._timer.action("B" if full_backward else "I", self.stage_index, bwd_chunk_id):
            super().backward_one_chunk(  # type: ignore[misc]
                bwd_chunk_id, loss=loss, full_backward=full_backward, **kwargs
            )

    def backward_weight_one_chunk(self, bwd_chunk_id: int, **kwargs: object) -> None:
        queue = getattr(self, "queue", None)  # customgrad's stage: W may have run in a wait
        if queue is not None and queue.ran(self.stage_index, bwd_chunk_id):
            super().backward_weight_one_chunk(bwd_chunk_id, **kwargs)  # type: ignore[misc]
            return  # timed where it ran, inside the wait (WeightGradQueue.run_while)
        with self._timer.action("W", self.stage_index, bwd_chunk_id):
            super().backward_weight_one_chunk(bwd_chunk_id, **kwargs)  # type: ignore[misc]

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops: list[dist.P2POp] = super().get_fwd_recv_ops(fwd_chunk_id)  # type: ignore[misc]
        if ops:
            self._timer.posted_receive("F", self.stage_index, fwd_chunk_id)
        return ops

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops: list[dist.P2POp] = super().get_bwd_recv_ops(bwd_chunk_id)  # type: ignore[misc]
        if ops:
            self._timer.posted_receive("B", self.stage_index, bwd_chunk_id)
        return ops
