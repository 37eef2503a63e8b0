"""The boundary between an op and its autograd: the registered rules, and what autograd reads.

:class:`AutogradRules` is a small frozen record of an op's autograd registrations; the op swaps
it whole on every ``register_*`` call, so a backward always sees one consistent set.
:class:`OpSpec` is everything :mod:`customgrad._autograd` needs from an op (as torch's
``make_autograd_impl(op, info)`` depends on an ``InfoProtocol``, never on ``CustomOpDef``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

if TYPE_CHECKING:
    from customgrad._autosplit import AutoSplitter
    from customgrad._kernels import Kernels
    from customgrad._pass import BackwardContext
    from customgrad._signature import Signature

__all__ = [
    "AutogradRules",
    "BackwardFn",
    "Gradient",
    "Half",
    "JvpFn",
    "OpSpec",
    "SaveForBackwardFn",
    "SharedFn",
    "SplitMode",
]

Half = Literal["full", "input", "weight", "shared"]
"""A registered backward function: the single ``backward``, one half of the pair, or the work
both halves share."""

SplitMode = Literal["auto", "phase"]
"""How a single ``register_backward`` is split: ``"auto"`` traces it and partitions the trace
into an input and a weight part (falling back to ``"phase"`` when it can't be traced);
``"phase"`` calls it once per pass with ``ctx.needs_input_grad`` set for that pass."""


Gradient = torch.Tensor | list[torch.Tensor | None] | None
"""The gradient of one output or argument (a list for a list of Tensors; None where none
flows), or the tangent of one argument in a jvp."""


class SaveForBackwardFn(Protocol):
    """``save_for_backward(inputs, output[, residuals]) -> pytree``: what the backward needs.

    ``inputs`` is a record (a NamedTuple) of the arguments by name; ``output`` the op's output
    as the caller sees it; ``residuals``, a record of the residuals by name, is passed when the
    op declares ``residuals=``. The result is any pytree (its Tensors are saved through
    autograd); the backward gets it back as ``saved``.
    """

    def __call__(
        self, inputs: tuple[object, ...], output: object, /, *residuals: tuple[object, ...]
    ) -> object: ...


class BackwardFn(Protocol):
    """``backward(ctx, saved, *grads) -> {arg_name: grad}``: a gradient (or None) per
    argument the pass needs, by name; customgrad checks each against its argument."""

    def __call__(
        self, ctx: BackwardContext, saved: object, /, *grads: Gradient
    ) -> Mapping[str, Gradient]: ...


class SharedFn(Protocol):
    """``shared(ctx, saved, *grads) -> work``: work both halves need, read as ``ctx.shared``."""

    def __call__(self, ctx: BackwardContext, saved: object, /, *grads: Gradient) -> object: ...


class JvpFn(Protocol):
    """``jvp(inputs, output, tangents) -> output tangent(s)`` for forward-mode AD.

    ``inputs`` and ``tangents`` are records of the arguments by name (a tangent is a
    :data:`Gradient`: None for an argument without one); the result has the structure of the
    op's output (customgrad checks it).
    """

    def __call__(
        self, inputs: tuple[object, ...], output: object, tangents: tuple[object, ...], /
    ) -> object: ...


@dataclasses.dataclass(frozen=True)
class AutogradRules:
    """An op's autograd registrations, replaced whole by each ``register_*`` call.

    Attributes:
        save: ``save_for_backward``.
        backward: the single backward (exclusive with the pair).
        backward_input: the input half of the pair.
        backward_weight: the weight half of the pair.
        backward_shared: work both halves need, computed once per node (``ctx.shared``).
        jvp: the forward-mode rule.
        split: how a single backward is split (:data:`SplitMode`).
        recompute: for an automatic split, ``"cheap"`` recomputes cheap shared results in the
            later pass instead of keeping them from the earlier one.
        nondifferentiable: the halves registered with ``differentiable=False``.
        auto: the automatic splitter of the single backward (set by the op when ``split`` is
            ``"auto"``), or None.
    """

    save: SaveForBackwardFn | None = None
    backward: BackwardFn | None = None
    backward_input: BackwardFn | None = None
    backward_weight: BackwardFn | None = None
    backward_shared: SharedFn | None = None
    jvp: JvpFn | None = None
    split: SplitMode = "auto"
    recompute: Literal["none", "cheap"] = "none"
    nondifferentiable: frozenset[Half] = frozenset()
    auto: AutoSplitter | None = None

    def missing(self, *, has_inputs: bool, has_weights: bool) -> list[str]:
        """The ``register_*`` calls still needed before the op can be differentiated.

        An op without weights needs only its input half; one whose every Tensor argument is a
        weight, only its weight half.
        """
        missing: list[str] = []
        if self.save is None:
            missing.append("register_save_for_backward")
        if self.backward is not None:
            return missing
        need_in = has_inputs or not has_weights
        have_in = self.backward_input is not None
        have_w = self.backward_weight is not None
        if not have_in and not have_w:
            if need_in and has_weights:
                missing.append("register_backward (or the register_backward_input/_weight pair)")
            elif need_in:
                missing.append("register_backward (or register_backward_input)")
            else:
                missing.append("register_backward (or register_backward_weight)")
            return missing
        if need_in and not have_in:
            missing.append("register_backward_input")
        if has_weights and not have_w:
            missing.append("register_backward_weight")
        return missing


class OpSpec(Protocol):
    """What customgrad's autograd needs from an op."""

    @property
    def name(self) -> str:
        """``"ns::name"``."""

    @property
    def signature(self) -> Signature:
        """Arguments, outputs, weights and residuals."""

    @property
    def rules(self) -> AutogradRules:
        """The current autograd registrations."""

    @property
    def _kernels(self) -> Kernels:
        """The op's kernels (the node's forward calls ``Kernels.run`` directly when it can)."""

    def _run_kernel(self, args: tuple[Any, ...], kernel: Callable[..., Any] | None) -> Any:
        """Run the forward below autograd on schema-ordered ``args``: everything the kernel
        returns (outputs, then residuals). ``kernel`` is the kernel to call directly, or None
        to go through the dispatcher."""

    def _missing_autograd_message(self) -> str:
        """The error message for an op whose autograd registrations are incomplete."""
