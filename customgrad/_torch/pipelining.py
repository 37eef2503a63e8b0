"""Private members of ``torch.distributed.pipelining``.

- :func:`stage_base`: ``torch.distributed.pipelining.stage._PipelineStageBase``, the base of
  every pipeline stage class (``PipelineStage`` and the tracer's ``_PipelineStage``);
- :func:`torch_split`: torch's own split backward, ``stage_backward_input`` and
  ``stage_backward_weight`` of ``torch.distributed.pipelining._backward``;
- :func:`ddp_find_tensors`: the tensors in a stage's outputs, as DDP's reducer expects them
  for ``prepare_for_backward`` (``torch.nn.parallel.distributed._find_tensors``).

Imported lazily: ``import customgrad`` does not load ``torch.distributed.pipelining``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["ddp_find_tensors", "stage_base", "torch_split"]


def stage_base() -> type[Any]:
    """The base class of torch's pipeline stages (``_PipelineStageBase``)."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    return _PipelineStageBase


def torch_split() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """torch's ``(stage_backward_input, stage_backward_weight)``."""
    from torch.distributed.pipelining import _backward

    return _backward.stage_backward_input, _backward.stage_backward_weight


def ddp_find_tensors(outputs: Any) -> list[Any]:
    """The tensors in ``outputs`` (nested in lists, tuples, dicts, dataclasses) as DDP finds them."""
    from torch.nn.parallel.distributed import _find_tensors

    return list(_find_tensors(outputs))
