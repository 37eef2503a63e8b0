"""The hand-off: what the earlier pass of a node's backward computed for its later pass.

One type for every kind of hand-off a customgrad node makes between the input pass (I) and the
weight pass (W): the work a pair's halves share (``register_backward_shared``), the values a
traced backward's I part keeps for its W part, and the weight gradients of a backward that is
not split, run once in I (the run-once rule). The same rules hold for each:

- it belongs to the pass that made it: only a pass with the same output gradients (the same
  tensors) reads it, never a pass of another loss through the same node;
- it lives on the node's record until the later pass takes it, a full backward replaces it, or
  the graph is freed with the node (nothing else refers to it: no reference cycle).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import optree
import torch

from customgrad._record import NO_HANDOFF, NodeRecord

__all__ = ["HandOff", "HandOffKind", "handed_over", "nbytes", "same_tensors"]

HandOffKind = Literal["shared", "traced", "gradients"]


class HandOff:
    """What one pass of a node computed for the node's later pass.

    Attributes:
        grads: the output gradients of the pass that made it (what the later pass must match).
        kind: ``"shared"`` (``ctx.shared``), ``"traced"`` (a traced backward's kept values) or
            ``"gradients"`` (gradients computed early by a backward that runs once).
        value: what is handed over.
    """

    __slots__ = ("grads", "kind", "value")

    def __init__(self, grads: tuple[Any, ...], kind: HandOffKind, value: Any) -> None:
        self.grads = grads
        self.kind = kind
        self.value = value

    def __repr__(self) -> str:
        return f"<HandOff {self.kind}: {nbytes(self.value)} bytes>"


def handed_over(record: NodeRecord, grads: tuple[Any, ...], kind: HandOffKind) -> Any:
    """What the node's earlier pass kept of ``kind`` for a pass with output gradients ``grads``
    (:data:`NO_HANDOFF` when nothing, or when it was made by a pass of other gradients)."""
    handoff = record.handoff
    if handoff is None or handoff.kind != kind:
        return NO_HANDOFF
    made_with = handoff.grads
    if made_with is grads or same_tensors(
        made_with, grads, record.op.signature.output_differentiability
    ):
        return handoff.value
    return NO_HANDOFF


def same_tensors(
    a: tuple[Any, ...], b: tuple[Any, ...], differentiable: Sequence[bool] | None = None
) -> bool:
    """Whether two tuples of output gradients (lists for list outputs) hold the same tensors.

    The gradients of non-differentiable outputs are not compared: autograd materializes a new
    tensor of zeros for them in each pass.
    """
    if len(a) != len(b):
        return False
    for i, (x, y) in enumerate(zip(a, b)):
        if x is y or (differentiable is not None and not differentiable[i]):
            continue
        if not (
            isinstance(x, list)
            and isinstance(y, list)
            and len(x) == len(y)
            and all(p is q for p, q in zip(x, y))
        ):
            return False
    return True


def nbytes(value: Any) -> int:
    """The bytes of the tensors in ``value`` (a pytree), each storage counted once."""
    seen: set[int] = set()
    total = 0
    for leaf in optree.tree_leaves(value, none_is_leaf=True):
        if isinstance(leaf, torch.Tensor):
            storage = leaf.untyped_storage()
            key = storage.data_ptr() if storage.data_ptr() else id(storage)
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total
