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

from customgrad._errors import GradientValueError, MissingRegistrationError

if TYPE_CHECKING:
    from customgrad._signature import Signature

__all__ = [
    "AutogradRules",
    "BackwardContext",
    "KernelCalls",
    "Phase",
    "SharedSource",
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


Phase = Literal["full", "input", "weight"]

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
    auto: object = None
    """The automatic split of the single backward (a ``customgrad._autosplit.AutoSplitter``),
    or None."""

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
    def _kernels(self) -> KernelCalls:
        """The op's kernels (the node's forward calls ``Kernels.run`` directly when it can)."""

    def _run_kernel(self, args: tuple[Any, ...], kernel: Callable[..., Any] | None) -> Any:
        """Run the forward below autograd on schema-ordered ``args``: everything the kernel
        returns (outputs, then residuals). ``kernel`` is the kernel to call directly, or None
        to go through the dispatcher."""

    def _missing_autograd_message(self) -> str:
        """The error message for an op whose autograd registrations are incomplete."""


class KernelCalls(Protocol):
    """How the node's forward calls the op's kernel directly (``customgrad._kernels.Kernels``)."""

    @property
    def run(self) -> Callable[..., object]:
        """``run(kernel, args)``: the kernel called, its writes into arguments checked."""

    def checked_output(
        self, args: tuple[object, ...], out: object
    ) -> tuple[object, tuple[object, ...]]:
        """The kernel's return checked against the schema: ``(outputs, residuals)``."""


class SharedSource(Protocol):
    """Where ``ctx.shared`` comes from for one backward call (``customgrad._pass._Shared``)."""

    def get(self, ctx: BackwardContext) -> object:
        """The shared work: handed over from an earlier pass, or computed now."""


# --------------------------------------------------------------------------------------------
# What a backward function sees


class BackwardContext:
    """What a customgrad backward function is told about the running pass.

    Attributes:
        op: the :class:`~customgrad.CustomOp` whose backward runs.
        phase: ``"input"`` when the pass needs only non-weight arguments' gradients,
            ``"weight"`` when it needs only weights', ``"full"`` otherwise (every argument that
            requires grad is needed, or some of each kind are).
    """

    __slots__ = ("_needed", "_op", "_phase", "_shared")

    def __init__(
        self,
        op: OpSpec,
        phase: Phase,
        needed: frozenset[str],
        shared: SharedSource | None = None,
    ) -> None:
        self._op = op
        self._phase: Phase = phase
        self._needed = needed
        self._shared = shared

    # Read-only: a context without shared work is made once per pass plan and reused by every
    # backward call with that plan (:attr:`PassPlan.ctx`).
    @property
    def op(self) -> OpSpec:
        return self._op

    @property
    def phase(self) -> Phase:
        return self._phase

    def needs_input_grad(self, name: str) -> bool:
        """True if argument ``name`` requires grad and the engine will use its gradient now."""
        if name in self._needed:
            return True
        if name not in self._op.signature.index:
            raise GradientValueError(
                f"{self._op.name}: ctx.needs_input_grad({name!r}): no such argument. "
                f"Arguments: {', '.join(self._op.signature.names)}."
            )
        return False

    @property
    def shared(self) -> Any:
        """What ``register_backward_shared`` computes: once per node, in the earlier pass of a
        split, kept for the later one and freed after it."""
        if self._shared is None:
            var = self.op.name.split("::")[1]
            raise MissingRegistrationError(
                f"{self.op.name}: ctx.shared was read, but the op registers no shared work. "
                f"ctx.shared is what register_backward_shared computes for the halves of the "
                f"input/weight pair; register the work both halves need:\n\n"
                f"    @{var}.register_backward_shared\n"
                f"    def _(ctx, saved, grad):\n"
                f"        return grad @ saved.w_down      # read as ctx.shared in both halves\n\n"
                f"(A single register_backward computes such work itself: its automatic split "
                f"runs it once and hands it from I to W.)"
            )
        return self._shared.get(self)

    def __repr__(self) -> str:
        return (
            f"BackwardContext(op={self.op.name!r}, phase={self.phase!r}, "
            f"needed={sorted(self._needed)})"
        )
