"""Pipeline parallelism with customgrad ops: a split backward with nothing computed twice.

- :func:`stage_backward`, :func:`stage_backward_input`, :func:`stage_backward_weight`: drop-ins
  for ``torch.distributed.pipelining``'s split backward functions.
"""

from customgrad.pipelining._backward import stage_backward as stage_backward
from customgrad.pipelining._backward import stage_backward_input as stage_backward_input
from customgrad.pipelining._backward import stage_backward_weight as stage_backward_weight
from customgrad.pipelining._errors import MissingInputPassError as MissingInputPassError
from customgrad.pipelining._errors import PendingWeightWorkError as PendingWeightWorkError
from customgrad.pipelining._errors import PipeliningError as PipeliningError
from customgrad.pipelining._errors import SplitStateError as SplitStateError
from customgrad.pipelining._errors import StreamSyncError as StreamSyncError
from customgrad.pipelining._errors import WeightGradQueueError as WeightGradQueueError
from customgrad.pipelining._errors import WeightPassTwiceError as WeightPassTwiceError

__all__ = [
    "MissingInputPassError",
    "PendingWeightWorkError",
    "PipeliningError",
    "SplitStateError",
    "StreamSyncError",
    "WeightGradQueueError",
    "WeightPassTwiceError",
    "stage_backward",
    "stage_backward_input",
    "stage_backward_weight",
]
