"""Errors raised by :mod:`customgrad.pipelining`.

Each is a :class:`customgrad.CustomGradError` and a :class:`RuntimeError`: they are raised for
calls made in the wrong order or from the wrong place, not for wrong values.
"""

from __future__ import annotations

from customgrad._errors import CustomGradError

__all__ = [
    "PipeliningError",
    "SplitStateError",
    "WeightGradQueueError",
    "MissingInputPassError",
    "WeightPassTwiceError",
    "PendingWeightWorkError",
    "StreamSyncError",
    "StrayWeightWorkError",
]


class PipeliningError(CustomGradError, RuntimeError):
    """Base class of the errors :mod:`customgrad.pipelining` raises."""


class SplitStateError(PipeliningError):
    """``stage_backward_weight`` was given ``param_groups`` it cannot use (reused, or foreign)."""


class WeightGradQueueError(PipeliningError):
    """A :class:`~customgrad.pipelining.WeightGradQueue` was used out of order."""


class MissingInputPassError(WeightGradQueueError):
    """W was asked for a microbatch whose input pass (I) never ran."""


class WeightPassTwiceError(WeightGradQueueError):
    """W was asked twice for the same microbatch in one step."""


class PendingWeightWorkError(WeightGradQueueError):
    """A step ended with weight-gradient work still in the queue."""


class StreamSyncError(WeightGradQueueError):
    """Deferred work is run from another stream, before the stream it was queued on finished."""


class StrayWeightWorkError(WeightGradQueueError):
    """A ``dw_builder`` found work of more than one microbatch: some ran outside the schedule."""
