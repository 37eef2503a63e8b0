"""Private members of ``torch.distributed.pipelining``.

- :func:`stage_base`: ``torch.distributed.pipelining.stage._PipelineStageBase``, the base of
  every pipeline stage class (``PipelineStage`` and the tracer's ``_PipelineStage``);
- :func:`torch_split`: torch's own split backward, ``stage_backward_input`` and
  ``stage_backward_weight`` of ``torch.distributed.pipelining._backward``;
- :func:`torch_split_running`: whether torch's own ``stage_backward_input`` is running (its
  frame on a thread's stack), for the releases where it cannot run customgrad ops;
- :func:`ddp_find_tensors`: the tensors in a stage's outputs, as DDP's reducer expects them
  for ``prepare_for_backward`` (``torch.nn.parallel.distributed._find_tensors``).

Imported lazily: ``import customgrad`` does not load ``torch.distributed.pipelining``.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = [
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
