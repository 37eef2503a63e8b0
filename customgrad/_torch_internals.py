"""Every private torch internal the op core reads, in one place, detected per torch version.

customgrad needs a few things torch has no public API for:

- :func:`will_execute`: whether the running backward uses a node's gradient
  (``torch._C._will_engine_execute_node``), how a customgrad node learns which pass it is in;
- :func:`graph_task_id`: which backward (graph task) runs now
  (``torch._C._current_graph_task_id``), what a hand-off between passes is keyed by;
- :func:`captured_by_caller`: which leaves the running ``torch.autograd.grad`` captures, read
  from the locals of torch's ``_engine_run_backward`` frame (the engine query raises for those
  leaves, and each raise costs about a small op's backward);
- :func:`library_impls`: the kernels registered through ``torch.library`` (``Library.impl``
  records each ``"ns/op/DispatchKey"`` it registers), which tells whether the dispatcher would
  run a kernel other than customgrad's own for an op.

Each is looked up once at import; when torch lacks it, the caller falls back to the slower
general answer (ask the engine, go through the dispatcher), never to a wrong one.
``tests/test_torch_internals.py`` fails loudly when the installed torch no longer matches what
is read here, so a torch upgrade cannot make customgrad silently slower.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Set
from typing import Any

import torch
import torch.library
from torch.autograd.graph import GradientEdge

__all__ = [
    "ACCUMULATE_GRAD",
    "FRAME_READABLE",
    "captured_by_caller",
    "graph_kept",
    "graph_task_id",
    "legacy_batched",
    "library_impls",
    "will_execute",
]

will_execute: Callable[[Any], bool] | None = getattr(torch._C, "_will_engine_execute_node", None)
"""``torch._C._will_engine_execute_node`` (raises for a leaf ``autograd.grad`` captures), or
None on a torch without it."""

graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: 0)
"""The id of the graph task the calling thread runs (-1 outside a backward)."""

graph_kept: Callable[[], bool] = getattr(
    getattr(torch._C, "_autograd", None), "_get_current_graph_task_keep_graph", lambda: True
)
"""Whether the running backward retains the graph (``retain_graph=True``); True when unknown."""

_is_legacy_batched: Any = getattr(
    getattr(torch._C, "_functorch", None), "is_legacy_batchedtensor", None
)


def legacy_batched(t: torch.Tensor) -> bool:
    """Whether ``t`` is batched by torch's legacy vmap (``autograd.grad(...,
    is_grads_batched=True)``, ``jacobian(..., vectorize=True)``), which functorch's
    "transforms active" query does not see (``torch._C._functorch.is_legacy_batchedtensor``).
    True when unknown: the caller then calls the backward as written, never a trace that could
    not run on it."""
    if _is_legacy_batched is None:
        return True
    return bool(_is_legacy_batched(t))


ACCUMULATE_GRAD: type = getattr(getattr(torch._C, "_functions", None), "AccumulateGrad", type(None))
"""The class of a leaf's gradient-accumulation node."""

_run_backward: Any = getattr(torch.autograd.graph, "_engine_run_backward", None)
_RUN_BACKWARD_CODE = getattr(_run_backward, "__code__", None)
_GRAD_CODE = getattr(torch.autograd.grad, "__code__", None)
FRAME_READABLE = (
    _RUN_BACKWARD_CODE is not None
    and _GRAD_CODE is not None
    and {"args", "kwargs"} <= set(_RUN_BACKWARD_CODE.co_varnames)
)
"""Whether this torch's ``_engine_run_backward(t_outputs, *args, **kwargs)`` frame can be read."""

_NOTHING: frozenset[int] = frozenset()

_impls: Any = getattr(torch.library, "_impls", None)
_IMPLS: Set[str] | None = _impls if isinstance(_impls, set) else None


def library_impls() -> Set[str] | None:
    """The ``"ns/op/DispatchKey"`` of every kernel registered through ``torch.library`` (a live
    set: read it at each call), or None when this torch does not keep one."""
    return _IMPLS


def captured_by_caller(depth: int) -> frozenset[int]:
    """The ``id`` of each leaf the running ``torch.autograd.grad`` captures, read from its
    ``_engine_run_backward`` frame, expected ``depth`` frames up (a few more are looked at).

    Empty when unknown, and in a ``.backward()`` (which captures nothing): the caller then asks
    the engine, which costs speed, never a gradient.
    """
    if not FRAME_READABLE:
        return _NOTHING
    try:
        frame: Any = sys._getframe(depth)
    except ValueError:  # not that deep: not called from torch's engine on this thread
        return _NOTHING
    for _ in range(3):
        if frame is None:
            return _NOTHING
        if frame.f_code is _RUN_BACKWARD_CODE:
            caller = frame.f_back
            if caller is None or caller.f_code is not _GRAD_CODE:
                return _NOTHING  # .backward() captures nothing; other callers: ask the engine
            local = frame.f_locals
            args, kwargs = local.get("args"), local.get("kwargs")
            if (
                not isinstance(kwargs, dict)
                or kwargs.get("accumulate_grad", True)
                or not isinstance(args, tuple)
                or len(args) < 4
                or not isinstance(args[3], tuple)
            ):
                return _NOTHING  # a .backward() (nothing captured) or a call we don't know
            ids = set()
            for t in args[3]:
                if isinstance(t, GradientEdge):
                    t = getattr(t.node, "variable", None)
                if t is not None:
                    ids.add(id(t))
            return frozenset(ids)
        frame = frame.f_back
    return _NOTHING
