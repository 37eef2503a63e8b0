"""One record per customgrad autograd node: what its forward left for its backward.

Modules that look at nodes they did not make (the split planner, the weight-gradient queue,
``explain_split``) read a node only through :func:`record_of`. The node's own forward and
backward (:mod:`customgrad._autograd`, :mod:`customgrad._forward_ad` and the fast path's
written code), which know the node is customgrad's, read the attribute :data:`ATTR` directly:
one attribute load on the per-call path. Nothing else is stored on the node.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Protocol

from customgrad._signature import ArgKind

if TYPE_CHECKING:
    from customgrad._handoff import HandOff, HandOffValue
    from customgrad._routing import Route
    from customgrad._rules import OpSpec
    from customgrad._validate import TensorMeta

__all__ = ["ATTR", "NodeImpl", "NodeRecord", "attach", "record_of"]

ATTR = "_cg"
"""The attribute of a customgrad node that holds its record."""


class NodeImpl(Protocol):
    """What a record reads of its op's autograd (``customgrad._autograd.AutogradImpl``)."""

    spec: OpSpec
    weight_flags: dict[tuple[int, ...] | None, tuple[bool, ...]]

    def arg_of(self, lens: tuple[int, ...] | None) -> tuple[int, ...]:
        """For each flat input position, the index of its argument."""


class NodeRecord:
    """What one customgrad op call left on its autograd node.

    Attributes:
        impl: the op's autograd implementation (``impl.spec`` is the op).
        metas: ``(shape, dtype, device)`` of each flat input (list items inline; None for
            non-tensors); the node has one input edge per tensor entry, in this order.
        lens: lengths of the list arguments, or None when the op has none.
        out_lens: lengths of the list outputs (None entries for single tensors), or None when
            the node's outputs are the op's outputs as they are.
        saved_layout: how the saved values are laid out (see ``customgrad._autograd``).
        tag: what the forward was tagged with (see :func:`customgrad._routing.tagging`).
        route: what a planned backward told this node (see :mod:`customgrad._routing`).
        handoff: the node's hand-offs (:mod:`customgrad._handoff`: what its input pass
            computed for its weight pass), or None.
        traced: the node's traced split once its first backward chose one (False: the
            backward is called as written), or None before.
        traced_grads: the layout of the output gradients ``traced`` was chosen for (shapes,
            strides, dtypes: a backward with others chooses again).
        forward_ad: ``(args, outputs)`` kept for a jvp while forward AD is active.
        residual_slots: ``(position among the saved tensors, name)`` of each residual saved as
            the kernel returned it (guarded in double backward), or None.
    """

    # Set at forward, by the node's setup_context (``customgrad._autograd``), which makes the
    # record with ``object.__new__`` and sets these four without a call:
    impl: NodeImpl
    metas: list[TensorMeta]
    lens: tuple[int, ...] | None
    tag: object
    # The rest keep these class-level defaults until something sets them, which keeps creating
    # a record cheap (one per op call).
    out_lens: list[int | None] | None = None
    saved_layout: object = None
    route: Route | None = None
    handoff: HandOff[HandOffValue] | None = None
    traced: object = None  # a customgrad._traced_split.TracedSplit, False, or None
    traced_grads: object = None
    forward_ad: tuple[object, object] | None = None
    residual_slots: tuple[tuple[int, str], ...] | None = None
    weight_edges: tuple[bool, ...] | None = None

    @property
    def op(self) -> OpSpec:
        """The op this node belongs to."""
        spec: OpSpec = self.impl.spec
        return spec

    @property
    def label(self) -> str:
        """What errors call the node: its op."""
        return self.op.name

    @property
    def differentiable(self) -> tuple[bool, ...] | None:
        """Per output of the op, whether it is differentiable (the hand-off's :class:`Holder`)."""
        return self.op.signature.output_differentiability

    def edge_is_weight(self) -> tuple[bool, ...]:
        """For each of the node's input edges (``next_functions``), whether it carries a weight
        argument's gradient."""
        cached = self.weight_edges
        if cached is None:
            # One flag per flat input (list items inline); the inputs that were tensors (a meta,
            # not None) are the node's edges.
            cache = self.impl.weight_flags  # per list lengths
            flags = cache.get(self.lens)
            if flags is None:
                sig = self.op.signature
                lens = iter(self.lens or ())
                flags = tuple(
                    spec.name in sig.weight_set
                    for spec in sig.args
                    for _ in range(next(lens) if spec.kind is ArgKind.TENSOR_LIST else 1)
                )
                if len(cache) < 256:
                    cache[self.lens] = flags
            cached = self.weight_edges = tuple(itertools.compress(flags, self.metas))
        return cached

    def __repr__(self) -> str:
        return f"<customgrad node record of {self.op.name}>"


def record_of(node: object) -> NodeRecord | None:
    """The record of a customgrad autograd node, or None for any other node (or None)."""
    record = getattr(node, ATTR, None)
    return record if isinstance(record, NodeRecord) else None


def attach(ctx: object, record: NodeRecord) -> None:
    """Store ``record`` on the autograd node ``ctx`` (called once, at forward)."""
    setattr(ctx, ATTR, record)
