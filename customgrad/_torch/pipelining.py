"""Private members of ``torch.distributed.pipelining``.

- :func:`stage_base`: ``torch.distributed.pipelining.stage._PipelineStageBase``, the base of
  every pipeline stage class (``PipelineStage`` and the tracer's ``_PipelineStage``);
- :func:`torch_split`: torch's own split backward, ``stage_backward_input`` and
  ``stage_backward_weight`` of ``torch.distributed.pipelining._backward``;
- :func:`torch_split_running`: whether torch's own ``stage_backward_input`` is running (its
  frame on a thread's stack), for the releases where it cannot run customgrad ops;
- :func:`ddp_find_tensors`: the tensors in a stage's outputs, as DDP's reducer expects them
  for ``prepare_for_backward`` (``torch.nn.parallel.distributed._find_tensors``);
- :class:`RuntimeStep`: one step of a ``_PipelineScheduleRuntime`` (ZBV, DualPipeV, the
  interleaved schedules) as a custom function registered with ``register_custom_function`` sees
  it: its compute actions run as the runtime's ``_step_microbatches`` runs them (its receive
  waits, loss, local hand-overs between a V's two stages, backward counting), and the action
  list around the running one.

Imported lazily: ``import customgrad`` does not load ``torch.distributed.pipelining``.
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable
from typing import Any

COMPUTE_KINDS = frozenset({"F", "I", "W", "B", "OVERLAP_F_B"})
COMM_KINDS = frozenset({"SEND_F", "RECV_F", "SEND_B", "RECV_B"})

__all__ = [
    "RuntimeStep",
    "ddp_find_tensors",
    "stage_base",
    "torch_split",
    "torch_split_running",
    "torch_stage_inits_same_rank",
]


def stage_base() -> type[Any]:
    """The base class of torch's pipeline stages (``_PipelineStageBase``)."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    return _PipelineStageBase


def torch_split() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """torch's ``(stage_backward_input, stage_backward_weight)``."""
    from torch.distributed.pipelining import _backward

    return _backward.stage_backward_input, _backward.stage_backward_weight


def _on_stack(frame: Any, code: Any) -> bool:
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def torch_split_running() -> bool:
    """Whether torch's own ``stage_backward_input`` is running: its frame is on this thread's
    stack (a backward on CPU runs on the caller's thread) or, called from one of the autograd
    engine's device threads (CUDA), on any thread's stack. Walks stacks: call it only where the
    answer matters (see ``customgrad._autograd``)."""
    code = torch_split()[0].__code__
    if _on_stack(sys._getframe(1), code):
        return True
    if threading.current_thread() is threading.main_thread():
        return False
    return any(_on_stack(f, code) for f in sys._current_frames().values())


def torch_stage_inits_same_rank() -> bool:
    """Whether torch's multi-stage schedules set up p2p by batching every stage's
    ``_get_init_p2p_neighbors_ops``, in V schedules a send to the stage's own rank, which gloo
    refuses (torch 2.11). torch 2.12 to 2.14 warm ``PipelineStage``\\ s up with a vote between
    neighbours instead (``_warmup_forward_vote``); torch 2.15 has neither (its stages set up
    their buffers without init ops). Read here: the init ops' method, and no vote."""
    from torch.distributed.pipelining import PipelineStage

    return hasattr(PipelineStage, "_get_init_p2p_neighbors_ops") and not hasattr(
        PipelineStage, "_warmup_forward_vote"
    )


def ddp_find_tensors(outputs: Any) -> list[Any]:
    """The tensors in ``outputs`` (nested in lists, tuples, dicts, dataclasses) as DDP finds them."""
    from torch.nn.parallel.distributed import _find_tensors

    return list(_find_tensors(outputs))


def runtime_class() -> type[Any]:
    """``_PipelineScheduleRuntime``, the base of the schedules that run an action list."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    return _PipelineScheduleRuntime


def register_action(schedule: Any, kind: str, fn: Callable[[Any, Any], None]) -> None:
    """``schedule.register_custom_function`` for the computation type named ``kind``."""
    from torch.distributed.pipelining.schedules import _ComputationType

    schedule.register_custom_function(_ComputationType(kind), fn)


class RuntimeStep:
    """What a custom function of a running ``_PipelineScheduleRuntime`` step needs.

    Built from the ``_PipelineContext`` torch passes the function; its methods run one compute
    action as torch 2.11-2.13's ``_step_microbatches`` does (``_perform_action``), so a custom
    function can run the halves of an action in another order.
    """

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.schedule = ctx.schedule_ref
        self.stages: dict[int, Any] = {s.stage_index: s for s in self.stages_of(self.schedule)}
        # The running step's own arguments, which torch does not put in the context.
        step_locals = _running_step_locals()
        self.loss_kwargs = step_locals.get("loss_kwargs")
        self.return_outputs = step_locals.get("return_outputs", True)

    @staticmethod
    def stages_of(schedule: Any) -> list[Any]:
        """This rank's stages of a multi-stage schedule."""
        return list(schedule._stages)

    @staticmethod
    def parts(action: Any) -> list[tuple[int, str, int]]:
        """``(stage, kind, microbatch)`` of an action's compute parts (an ``OVERLAP_F_B``'s
        two sub-actions, else the action itself)."""
        subs = action.sub_actions if action.sub_actions is not None else (action,)
        return [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in subs]

    def next_kinds(self, action: Any) -> list[str]:
        """The kinds of the actions after ``action`` on this rank up to the next compute action
        (included), leaving out sends and receives."""
        order = self.schedule.pipeline_order_with_comms[self.schedule.rank]
        kinds = []
        for later in order[order.index(action) + 1 :]:
            kind = later.computation_type.value
            if kind in COMM_KINDS:
                continue
            kinds.append(kind)
            if kind in COMPUTE_KINDS:
                break
        return kinds

    def forward(self, stage_index: int, mb: int) -> None:
        schedule, stage = self.schedule, self.stages[stage_index]
        schedule._assert_unsharded(stage)
        if not stage.is_first and stage_index - 1 not in self.stages:
            if (stage_index, mb) not in schedule.fwd_recv_ops:
                raise AssertionError(f"Computing forward {stage_index}F{mb} before receiving input")
            _wait(schedule.fwd_recv_ops.pop((stage_index, mb)))
        ctx = self.ctx
        output = stage.forward_one_chunk(
            mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb], save_forward_output=self.return_outputs
        )
        if _takes_loss_kwargs(schedule):
            schedule._maybe_compute_loss(stage, output, ctx.target_mbs, mb, self.loss_kwargs)
        else:
            schedule._maybe_compute_loss(stage, output, ctx.target_mbs, mb)
        if stage_index + 1 in self.stages:
            self.stages[stage_index + 1].set_local_fwd_input(output, mb)

    def backward(self, stage_index: int, mb: int, full: bool) -> None:
        """B (``full``) or I of one microbatch."""
        schedule, stage = self.schedule, self.stages[stage_index]
        schedule._assert_unsharded(stage)
        if not stage.is_last and stage_index + 1 not in self.stages:
            if (stage_index, mb) not in schedule.bwd_recv_ops:
                raise AssertionError(f"Running backward {stage_index}B{mb} before receiving input")
            _wait(schedule.bwd_recv_ops.pop((stage_index, mb)))
        loss = schedule._maybe_get_loss(stage, mb)
        last = False
        if full:
            schedule.backward_counter[stage_index] += 1
            last = schedule.backward_counter[stage_index] == schedule._n_microbatches
        stage.backward_one_chunk(mb, loss=loss, full_backward=full, last_backward=last)
        if stage_index - 1 in self.stages:
            self.stages[stage_index - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)

    def weight(self, stage_index: int, mb: int) -> None:
        schedule, stage = self.schedule, self.stages[stage_index]
        schedule._assert_unsharded(stage)
        schedule.backward_counter[stage_index] += 1
        last = schedule.backward_counter[stage_index] == schedule._n_microbatches
        stage.backward_weight_one_chunk(mb, last_backward=last)


def _wait(works: Any) -> None:
    from torch.distributed.pipelining.schedules import _wait_batch_p2p

    _wait_batch_p2p(works)


def _takes_loss_kwargs(schedule: Any) -> bool:
    """torch 2.13 passes the step's ``loss_kwargs`` to the loss; 2.11 and 2.12 have none."""
    return "loss_kwargs" in inspect.signature(schedule._maybe_compute_loss).parameters


def _running_step_locals() -> dict[str, Any]:
    """``loss_kwargs`` and ``return_outputs`` of the ``_step_microbatches`` frame that called
    the custom function (on this thread's stack), or nothing when none is found."""
    code = runtime_class()._step_microbatches.__code__
    frame: Any = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return {k: frame.f_locals[k] for k in ("loss_kwargs", "return_outputs")
                    if k in frame.f_locals}  # fmt: skip
        frame = frame.f_back
    return {}
