"""The autograd engine while it runs a backward: what it will execute, which node and which
graph task run now, and what ``torch.autograd.grad`` captures.

- :data:`will_execute`: whether the running backward uses a node's gradient
  (``torch._C._will_engine_execute_node``), how a customgrad node learns which pass it is in;
- :data:`edge_query`: :data:`will_execute` where torch has it, else a fallback that says every
  edge is needed (and logs once that the split then computes every gradient in every pass);
- :data:`current_node`: the node whose backward runs now (``torch._C._current_autograd_node``);
- :data:`graph_task_id`: which backward (graph task) runs now
  (``torch._C._current_graph_task_id``), what a hand-off between passes is keyed by;
- :data:`graph_kept`: whether it retains the graph
  (``torch._C._autograd._get_current_graph_task_keep_graph``);
- :data:`ACCUMULATE_GRAD`: the class of a leaf's accumulation node
  (``torch._C._functions.AccumulateGrad``);
- :func:`captured_by_caller`: which leaves the running ``torch.autograd.grad`` captures, read
  from the locals of torch's ``_engine_run_backward`` frame (the engine query raises for those
  leaves, and each raise costs about a small op's backward), or that the running
  ``torch.autograd.backward`` has no ``inputs=`` (every node it reaches runs: no query is needed).

Each is looked up once at import; when torch lacks one, its fallback gives the slower general
answer (ask the engine, treat every edge as needed), never a wrong one.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

__all__ = [
    "ACCUMULATE_GRAD",
    "FRAME_READABLE",
    "EVERY_EDGE",
    "captured_by_caller",
    "current_node",
    "edge_query",
    "graph_kept",
    "input_shape",
    "graph_task_id",
    "will_execute",
]

will_execute: Callable[[Any], bool] | None = getattr(torch._C, "_will_engine_execute_node", None)
"""``torch._C._will_engine_execute_node`` (raises outside a backward and for a leaf
``autograd.grad`` captures: treat an error as "needed"), or None on a torch without it."""

_warned_no_query = False


def _every_edge(fn: Any) -> bool:
    """The engine query's fallback: every edge is needed (logged once)."""
    global _warned_no_query
    if not _warned_no_query:
        _warned_no_query = True
        logging.getLogger("customgrad").warning(
            "customgrad: this torch has no torch._C._will_engine_execute_node; split backward "
            "falls back to computing every gradient in every pass."
        )
    return True


edge_query: Callable[[Any], bool] = will_execute if will_execute is not None else _every_edge
"""Whether the running backward uses the gradient sent along an edge to ``fn`` (may raise:
treat an error as "needed"); on a torch without the engine's query, always True."""

current_node: Callable[[], Any] = getattr(torch._C, "_current_autograd_node", lambda: None)
"""The autograd node whose backward the calling thread runs (None outside a backward)."""

graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: 0)
"""The id of the graph task the calling thread runs (-1 outside a backward)."""

graph_kept: Callable[[], bool] = getattr(
    getattr(torch._C, "_autograd", None), "_get_current_graph_task_keep_graph", lambda: True
)
"""Whether the running backward retains the graph (``retain_graph=True``); True when unknown."""


def input_shape(node: Any, nr: int) -> torch.Size | None:
    """The shape of the gradient ``node`` takes at its input ``nr`` (``node._input_metadata``,
    what torch's own ``autograd.backward`` reads for a ``GradientEdge``), or None when torch does
    not say (the caller then takes a slower general way)."""
    metadata = getattr(node, "_input_metadata", None)
    if metadata is None:
        return None
    try:
        return torch.Size(metadata[nr].shape)
    except (IndexError, AttributeError, TypeError):
        return None


ACCUMULATE_GRAD: type = getattr(getattr(torch._C, "_functions", None), "AccumulateGrad", type(None))
"""The class of a leaf's gradient-accumulation node."""

_run_backward: Any = getattr(torch.autograd.graph, "_engine_run_backward", None)
_RUN_BACKWARD_CODE = getattr(_run_backward, "__code__", None)
_GRAD_CODE = getattr(torch.autograd.grad, "__code__", None)
_BACKWARD_CODE = getattr(torch.autograd.backward, "__code__", None)
FRAME_READABLE = (
    _RUN_BACKWARD_CODE is not None
    and _GRAD_CODE is not None
    and {"args", "kwargs"} <= set(_RUN_BACKWARD_CODE.co_varnames)
)
"""Whether this torch's ``_engine_run_backward(t_outputs, *args, **kwargs)`` frame can be read."""

_NOTHING: frozenset[int] = frozenset()

EVERY_EDGE: frozenset[int] = frozenset({-1})
"""What :func:`captured_by_caller` answers for a ``torch.autograd.backward`` (``.backward()``)
without ``inputs=``: the engine runs every node it reaches (its ``exec_info`` is empty), and the
next edges of a node that runs lead to nodes it reaches (``_will_engine_execute_node`` answers
True for each; ``tests/test_call_path.py`` checks it), so every edge is needed. (No
tensor has ``id`` -1: the set never matches a leaf.)"""


def captured_by_caller(depth: int) -> frozenset[int]:
    """The ``id`` of each leaf the running ``torch.autograd.grad`` captures, read from its
    ``_engine_run_backward`` frame, expected ``depth`` frames up (a few more are looked at).

    :data:`EVERY_EDGE` for a ``torch.autograd.backward`` without ``inputs=``, which runs every
    node. Empty when unknown, and in a ``.backward(inputs=...)`` (which captures nothing): the
    caller then asks the engine, which costs speed, never a gradient.
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
            if caller is None:
                return _NOTHING
            code = caller.f_code
            if code is not _GRAD_CODE and code is not _BACKWARD_CODE:
                return _NOTHING  # other callers: ask the engine
            local = frame.f_locals
            args, kwargs = local.get("args"), local.get("kwargs")
            if code is _BACKWARD_CODE:
                # torch.autograd.backward(tensors, grads, retain, create, inputs_tuple,
                # allow_unreachable=True, accumulate_grad=True): without inputs= the engine
                # runs every node it reaches
                if (
                    isinstance(kwargs, dict)
                    and kwargs.get("accumulate_grad") is True
                    and isinstance(args, tuple)
                    and len(args) >= 4
                    and type(args[3]) is tuple
                    and not args[3]
                ):
                    return EVERY_EDGE
                return _NOTHING
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
