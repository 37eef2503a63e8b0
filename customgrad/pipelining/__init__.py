"""Pipeline parallelism with customgrad ops: a split backward with nothing computed twice.

- :func:`stage_backward`, :func:`stage_backward_input`, :func:`stage_backward_weight`: drop-ins
  for ``torch.distributed.pipelining``'s split backward functions.
- :class:`PipelineStage`: torch's ``PipelineStage`` with those as its backward, for torch's
  schedules (``ScheduleZBVZeroBubble``, ``ScheduleInterleavedZeroBubble``, ``ScheduleDualPipeV``).
- :class:`WeightGradQueue`: customgrad weight-gradient work kept per stage and microbatch, run
  by a hand-written loop or as a ``PipelineStage`` ``dw_builder``, or inside a collective's wait
  (:meth:`WeightGradQueue.run_while`) to hide an expert all-to-all;
  :func:`overlap_forward_backward` makes torch's schedules do that.
- :func:`simulate`: replay a torch schedule's action lists against per-stage costs
  (:class:`StageCosts`) to predict its step time and bubble at any scale.
- :class:`ActionTimer`: times every F / I / W / B action of a rank's stages and its waits for
  peers; :func:`stage_costs` turns the measured steps into :class:`StageCosts`.
"""

from customgrad.pipelining._backward import stage_backward as stage_backward
from customgrad.pipelining._backward import stage_backward_input as stage_backward_input
from customgrad.pipelining._backward import stage_backward_weight as stage_backward_weight
from customgrad.pipelining._errors import MissingInputPassError as MissingInputPassError
from customgrad.pipelining._errors import PendingWeightWorkError as PendingWeightWorkError
from customgrad.pipelining._errors import PipeliningError as PipeliningError
from customgrad.pipelining._errors import SplitStateError as SplitStateError
from customgrad.pipelining._errors import StrayWeightWorkError as StrayWeightWorkError
from customgrad.pipelining._errors import StreamSyncError as StreamSyncError
from customgrad.pipelining._errors import WeightGradQueueError as WeightGradQueueError
from customgrad.pipelining._errors import WeightPassTwiceError as WeightPassTwiceError
from customgrad.pipelining._overlap import overlap_forward_backward as overlap_forward_backward
from customgrad.pipelining._queue import InFlight as InFlight
from customgrad.pipelining._queue import WeightGradQueue as WeightGradQueue
from customgrad.pipelining._simulate import CommWait as CommWait
from customgrad.pipelining._simulate import Simulation as Simulation
from customgrad.pipelining._simulate import StageCosts as StageCosts
from customgrad.pipelining._simulate import TimedAction as TimedAction
from customgrad.pipelining._simulate import simulate as simulate
from customgrad.pipelining._stage import PipelineStage as PipelineStage
from customgrad.pipelining._timing import ActionEvent as ActionEvent
from customgrad.pipelining._timing import ActionTimer as ActionTimer
from customgrad.pipelining._timing import ActionTimerError as ActionTimerError
from customgrad.pipelining._timing import RankBreakdown as RankBreakdown
from customgrad.pipelining._timing import RankStep as RankStep
from customgrad.pipelining._timing import StepTimeline as StepTimeline
from customgrad.pipelining._timing import WaitEvent as WaitEvent
from customgrad.pipelining._timing import stage_costs as stage_costs

# Tracebacks name the public errors where users catch them (customgrad.pipelining.X).
for _error in (
    ActionTimerError,
    MissingInputPassError,
    PendingWeightWorkError,
    PipeliningError,
    SplitStateError,
    StrayWeightWorkError,
    StreamSyncError,
    WeightGradQueueError,
    WeightPassTwiceError,
):
    _error.__module__ = __name__
del _error

__all__ = [
    "ActionEvent",
    "ActionTimer",
    "ActionTimerError",
    "CommWait",
    "InFlight",
    "MissingInputPassError",
    "PendingWeightWorkError",
    "PipelineStage",
    "Simulation",
    "PipeliningError",
    "RankBreakdown",
    "RankStep",
    "SplitStateError",
    "StageCosts",
    "StepTimeline",
    "StrayWeightWorkError",
    "StreamSyncError",
    "TimedAction",
    "WeightGradQueue",
    "WeightGradQueueError",
    "WaitEvent",
    "WeightPassTwiceError",
    "overlap_forward_backward",
    "stage_backward",
    "stage_backward_input",
    "simulate",
    "stage_backward_weight",
    "stage_costs",
]
