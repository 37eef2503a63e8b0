"""``torch.autograd.Function`` internals: a backward node's Function class, the backward node
class of a Function, and ``apply`` without its functorch wrapper.

- :func:`forward_cls`: the ``Function`` subclass whose backward a node runs
  (``node._forward_cls``), or None for a native node;
- :func:`set_backward_apply`: make a Function's backward nodes run ``apply(node, *grads)``
  (assigns ``Function._backward_cls.apply``), which lets customgrad read the node it runs in
  instead of the ``ctx`` torch hands to ``backward``;
- :func:`plain_apply`: what ``Function.apply`` ends in when no functorch transform is active
  (``torch._C._FunctionBase.apply``), without the Python wrapper's checks;
- :func:`setup_context_defined`: whether a Function overrides ``setup_context``
  (``torch.autograd.function._is_setup_context_defined``);
- :func:`custom_op_of`: the ``torch.library.custom_op`` whose backward a node runs (its Function
  is made in ``torch._library.autograd``, which holds the ``OpOverload`` in a closure);
- :func:`skipping`: make Function backward nodes compute nothing while the engine runs them
  (the engine calls a Function node's backward through the ``apply`` attribute it reads on the
  node itself, ``PyNode::apply``, so an attribute set on one node holds for that node only);
- :func:`replacing`: make given Function backward nodes call a function of their own in place of
  their backward (the same per-node ``apply`` attribute), and :func:`run_backward`: a node's
  backward as the engine would run it (the class's ``apply``, which the attribute shadows);
- :func:`edge_metadata`: the shape and dtype of the gradient a node takes at one of its inputs
  (``node._input_metadata``: the engine sums and casts a gradient sent along an edge to them);
- :func:`handles_keep_nodes` and :func:`keep_graphs`: on torch 2.11 and 2.12 the Python handle
  of a Function's backward node (``tensor.grad_fn``, what ``next_functions`` returns) does not
  keep the node alive; what keeps a graph alive there until a weight pass reads it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

__all__ = [
    "custom_op_of",
    "edge_metadata",
    "forward_cls",
    "handles_keep_nodes",
    "is_aot_node",
    "keep_graphs",
    "plain_apply",
    "replacing",
    "run_backward",
    "set_backward_apply",
    "setup_context_defined",
    "skipping",
]

_CUSTOM_OP_MODULE = "torch._library.autograd"
r"""The module whose generated Functions give ``torch.library.custom_op``\ s their autograd."""


def forward_cls(node: Any) -> type[Any] | None:
    """The ``torch.autograd.Function`` subclass whose backward ``node`` runs, else None."""
    cls = getattr(node, "_forward_cls", None)
    return cls if isinstance(cls, type) else None


def set_backward_apply(function: type[torch.autograd.Function], apply: Callable[..., Any]) -> None:
    """Make the backward nodes of ``function`` call ``apply(node, *grads)``."""
    function._backward_cls.apply = apply  # type: ignore[attr-defined]


@contextlib.contextmanager
def skipping(nodes: Iterable[Any]) -> Iterator[None]:
    """Inside the block, each Function backward node of ``nodes`` returns no gradient (None
    along every edge) when the engine runs it, without calling its backward."""
    done: list[Any] = []
    try:
        for node in nodes:
            if forward_cls(node) is None or "apply" in vars(node):
                continue  # a native node, or one whose ctx holds an ``apply`` of its own
            nones = (None,) * len(node.needs_input_grad)  # one per argument of the forward
            node.apply = lambda *grads, nones=nones: nones
            done.append(node)
        yield
    finally:
        for node in done:
            del node.apply


@contextlib.contextmanager
def replacing(calls: Iterable[tuple[Any, Callable[..., Any]]]) -> Iterator[None]:
    """Inside the block, each Function backward node of ``calls`` runs ``fn(*grads)`` (which
    returns one gradient per argument of the forward, as a backward does) in place of its
    backward when the engine runs it. A node whose ctx holds an ``apply`` of its own is left
    alone."""
    done: list[Any] = []
    try:
        for node, fn in calls:
            if forward_cls(node) is None or "apply" in vars(node):
                continue
            node.apply = fn
            done.append(node)
        yield
    finally:
        for node in done:
            del node.apply


def run_backward(node: Any, grads: tuple[Any, ...]) -> Any:
    """What the engine runs for a Function backward node given ``grads`` (its class's
    ``apply``: the Function's ``backward`` with the node as ctx)."""
    return type(node).apply(node, *grads)


def edge_metadata(node: Any, nr: int) -> tuple[torch.Size, torch.dtype] | None:
    """The shape and dtype of the gradient ``node`` takes at its input ``nr``
    (``node._input_metadata``), or None when torch does not say."""
    metadata = getattr(node, "_input_metadata", None)
    if metadata is None:
        return None
    try:
        meta = metadata[nr]
        return torch.Size(meta.shape), meta.dtype
    except (IndexError, AttributeError, TypeError):
        return None


def plain_apply(function: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``function.apply`` without the functorch dispatch of ``Function.apply``: valid only
    while no functorch transform is active (see :mod:`customgrad._torch.transforms`)."""
    return super(torch.autograd.Function, function).apply  # type: ignore[misc,no-any-return]


def custom_op_of(node: Any) -> str | None:
    """The name (``"ns::op"``) of the ``torch.library.custom_op`` whose backward ``node`` runs;
    its Function's class name (``GeneratedBackwardFor_ns_op_default``) when the op cannot be
    read from it; None for any other node."""
    from torch._ops import OpOverload

    cls = forward_cls(node)
    if cls is None or cls.__module__ != _CUSTOM_OP_MODULE:
        return None
    for cell in getattr(cls.forward, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, OpOverload):
            return str(value._schema.name)
    return cls.__name__


def is_aot_node(node: Any) -> bool:
    """Whether ``node`` is the autograd node of an AOTAutograd-compiled graph (its
    ``autograd.Function`` class carries the compiled forward, ``compiled_fw``)."""
    return getattr(getattr(node, "_forward_cls", None), "compiled_fw", None) is not None


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


@functools.cache
def handles_keep_nodes() -> bool:
    """Whether the Python handle of a ``torch.autograd.Function``'s backward node keeps the node
    alive (torch 2.13 and later). On torch 2.11 and 2.12 it holds the node weakly: once the
    tensors and nodes that referenced it are gone (the stage outputs freed or ``detach_()``\\ ed
    after an input pass), reading ``next_functions`` or ``_input_metadata`` on a kept handle
    raises "invalid for this instance of _C._FunctionBase". Probed once, by that behaviour."""
    with torch.enable_grad():
        out = _Double.apply(torch.zeros((), requires_grad=True))  # type: ignore[no-untyped-call]
    node = out.grad_fn
    del out
    try:
        node.next_functions  # noqa: B018 - the read is the probe
    except RuntimeError:
        return False
    return True


def keep_graphs(outputs: Iterable[object]) -> list[Any]:
    """Where :func:`handles_keep_nodes` is false, handles that keep the autograd graph behind
    ``outputs`` (tensors, :class:`~torch.autograd.graph.GradientEdge`\\ s; others are skipped)
    alive for as long as the returned list is referenced, however the outputs are freed or
    detached; elsewhere ``[]`` (kept handles keep their nodes themselves).

    A native node's handle holds its node, and a node holds the nodes its edges lead to: each
    tensor output gets a view whose node (``ViewBackward0``) leads to the output's node. The
    view's node saves no tensor, so the outputs' own memory is not kept; the graph's is (the
    saved tensors of every node in it, until the list is dropped).
    """
    if handles_keep_nodes():
        return []
    keep: list[Any] = []
    with torch.enable_grad():
        for out in outputs:
            if isinstance(out, GradientEdge):
                keep.append(out.node)  # a Function's node: the caller holds what holds it
            elif isinstance(out, torch.Tensor) and out.grad_fn is not None:
                keep.append(out.view_as(out).grad_fn)
    return keep


def setup_context_defined(function: type[torch.autograd.Function]) -> bool:
    """Whether ``function`` defines its own ``setup_context`` (a forward without ``ctx``)."""
    from torch.autograd.function import _is_setup_context_defined

    return bool(_is_setup_context_defined(function.setup_context))
