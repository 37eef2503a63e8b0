"""Weight work hides the expert all-to-all inside torch's schedules: ``overlap_forward_backward``.

DualPipe's idea: a mixture-of-experts forward waits for its tokens to reach their experts
(dispatch) and to come back (combine); a microbatch's weight gradients (W) need no
communication, so they can run in those waits. The model waits through
:meth:`WeightGradQueue.run_while <customgrad.pipelining.WeightGradQueue.run_while>`; inside
:meth:`WeightGradQueue.overlap <customgrad.pipelining.WeightGradQueue.overlap>` that wait runs
queued W. :func:`overlap_forward_backward` gives a torch schedule's forwards W to run there,
through torch's own hook, ``register_custom_function``:

- DualPipeV's overlapped forward-backward actions (``OVERLAP_F_B``: the forward of one
  microbatch and the full backward of another) run the backward's input pass first, then the
  forward with that backward's W deferred into it;
- a W that comes right before a forward on the rank (ZBV, the interleaved zero-bubble
  schedule) is deferred into that forward.

What the forward's waits leave of the deferred W runs right after it. The stage's part of the
step that torch's runtime does around each action (waiting for received tensors, the loss, the
hand-over between a V's two stages, counting backwards) is :class:`customgrad._torch.
pipelining.RuntimeStep`'s, the same as torch's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.nn.parallel import DistributedDataParallel

from customgrad._errors import ArgumentTypeError, ArgumentValueError
from customgrad._torch.pipelining import RuntimeStep, register_action, runtime_class
from customgrad.pipelining._queue import WeightGradQueue
from customgrad.pipelining._stage import PipelineStage

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
    )

__all__ = ["overlap_forward_backward"]

Key = tuple[int, int]

MSG_NOT_A_RUNTIME = """\
overlap_forward_backward: expected one of torch's schedules that run an action list \
(ScheduleDualPipeV, ScheduleZBVZeroBubble, ScheduleInterleavedZeroBubble, \
ScheduleInterleaved1F1B, ScheduleLoopedBFS), got {got}. Schedule1F1B and ScheduleGPipe run each \
stage's weight gradients inside its full backward: no W is left to hide a forward's all-to-all. \
For example:

    schedule = ScheduleDualPipeV([stage0, stage1], n_microbatches, loss_fn=loss_fn)
    overlap_forward_backward(schedule)
"""

MSG_NO_QUEUE = """\
overlap_forward_backward: stage {stage} is a {cls} without a WeightGradQueue, but the overlap \
runs the queue's weight work inside the forwards' all-to-all waits. Build every stage with one \
queue, the one the model's all-to-all waits through:

    queue = WeightGradQueue()
    stage = customgrad.pipelining.PipelineStage(module, stage_index, n_stages, device, queue=queue)
    ...                                     # in the model, where it waits for an all-to-all:
    work = dist.all_to_all_single(out, x, out_splits, in_splits, group=ep_group, async_op=True)
    queue.run_while(work, "dispatch")
"""

MSG_TWO_QUEUES = """\
overlap_forward_backward: stages {first} and {second} have different WeightGradQueues; the \
overlap runs one queue's weight work in the waits of the model's all-to-alls, so every stage of \
the rank must use the same queue (the one the model's all-to-all waits through). Build them \
with one: queue = WeightGradQueue(); PipelineStage(..., queue=queue) for each.
"""


def overlap_forward_backward(schedule: PipelineScheduleSingle | PipelineScheduleMulti) -> None:
    """Make ``schedule`` run weight work (W) inside its forwards' all-to-all waits.

    For torch's schedules that run an action list (``ScheduleDualPipeV``,
    ``ScheduleZBVZeroBubble``, ``ScheduleInterleavedZeroBubble``, ...), whose stages are
    :class:`~customgrad.pipelining.PipelineStage`\\ s built with one
    :class:`~customgrad.pipelining.WeightGradQueue`, the queue the model's all-to-alls wait
    through (:meth:`~customgrad.pipelining.WeightGradQueue.run_while`). Registers custom
    functions (``register_custom_function``) for the forward, weight and overlapped
    forward-backward actions:

    - DualPipeV's ``OVERLAP_F_B`` (the forward of one microbatch and the full backward of
      another) runs the backward's input pass (I) first, then the forward with that
      backward's W deferred into it;
    - a W that comes right before a forward on the rank (with nothing but sends and receives
      between) is deferred into that forward.

    The forward runs inside :meth:`~customgrad.pipelining.WeightGradQueue.overlap` for its
    deferred W, so its all-to-all waits run them while the tokens are in flight; what they leave
    runs right after the forward. Gradients are those of the schedule without the overlap: each
    stage's W still run in the same order, once. A stage whose module is wrapped in DDP keeps
    its W in its slot (DDP reduces in the stage's last W); FSDP2 reduces after the step's last
    W, as without the overlap. ``simulate(..., overlap=True)`` predicts what this gives.

    Args:
        schedule: the schedule, built from this rank's stages.

    Raises:
        ArgumentTypeError: ``schedule`` does not run an action list (``Schedule1F1B``,
            ``ScheduleGPipe``).
        ArgumentValueError: a stage is not a customgrad ``PipelineStage`` with a queue, or the
            stages have different queues.

    Example:
        Two stages of an MoE model on this rank, experts on the expert-parallel group::

            queue = WeightGradQueue()
            stages = [PipelineStage(chunk, s, n_stages, device, queue=queue) for s, chunk in mine]
            schedule = ScheduleDualPipeV(stages, n_microbatches, loss_fn=loss_fn)
            overlap_forward_backward(schedule)
            schedule.step(x, target=y)   # the model's all-to-alls wait with queue.run_while
    """
    if not isinstance(schedule, runtime_class()):
        raise ArgumentTypeError(MSG_NOT_A_RUNTIME.format(got=type(schedule).__name__))
    stages = RuntimeStep.stages_of(schedule)
    queue: WeightGradQueue | None = None
    first = -1
    for stage in stages:
        own = stage.queue if isinstance(stage, PipelineStage) else None
        if own is None:
            raise ArgumentValueError(
                MSG_NO_QUEUE.format(stage=stage.stage_index, cls=type(stage).__name__)
            )
        if queue is None:
            queue, first = own, stage.stage_index
        elif own is not queue:
            raise ArgumentValueError(MSG_TWO_QUEUES.format(first=first, second=stage.stage_index))
    assert queue is not None  # a schedule has stages
    held = {s.stage_index for s in stages if isinstance(s.submod, DistributedDataParallel)}
    runner = _Overlap(queue, held)
    register_action(schedule, "OVERLAP_F_B", runner.pair)
    register_action(schedule, "F", runner.forward)
    register_action(schedule, "W", runner.weight)


class _Overlap:
    """The custom functions of one schedule: the W deferred into the rank's next forward."""

    def __init__(self, queue: WeightGradQueue, held: set[int]) -> None:
        self.queue = queue
        self.held = held  # DDP stages: W in its slot
        self.deferred: list[Key] = []

    # torch calls these with its _Action and _PipelineContext (RuntimeStep reads them)

    def forward(self, action: object, ctx: object) -> None:
        step = RuntimeStep(ctx)
        ((stage, _, mb),) = step.parts(action)
        self._forward(step, stage, mb)

    def weight(self, action: object, ctx: object) -> None:
        step = RuntimeStep(ctx)
        ((stage, _, mb),) = step.parts(action)
        if stage not in self.held and step.next_kinds(action) in (["F"], ["OVERLAP_F_B"]):
            self.deferred.append((stage, mb))  # into the next forward's waits
        else:
            step.weight(stage, mb)

    def pair(self, action: object, ctx: object) -> None:
        step = RuntimeStep(ctx)
        parts = {kind: (stage, mb) for stage, kind, mb in step.parts(action)}
        (f_stage, f_mb), (b_stage, b_mb) = parts["F"], parts["B"]
        if b_stage in self.held:  # as torch runs it
            self._forward(step, f_stage, f_mb)
            step.backward(b_stage, b_mb, full=True)
            return
        step.backward(b_stage, b_mb, full=False)
        self.deferred.append((b_stage, b_mb))
        self._forward(step, f_stage, f_mb)

    def _forward(self, step: RuntimeStep, stage: int, mb: int) -> None:
        keys, self.deferred = self.deferred, []
        with self.queue.overlap(keys):
            step.forward(stage, mb)
        for s, m in keys:  # what the waits left; the stage's own bookkeeping for the rest
            step.weight(s, m)
