"""An op in the dispatcher: its ``torch.library`` definition and the kernels customgrad registers.

Each op is defined in a ``torch.library.Library`` fragment of its namespace, and customgrad
registers its own kernels for it, and its FLOP formula in torch's table
(:class:`~customgrad._flops.OpFlops`, what ``FlopCounterMode`` counts the op's call as): the
backend kernel (``CompositeExplicitAutograd``, which runs
the op's kernel for the device from :class:`~customgrad._kernels.Kernels`), the fake kernel,
the Autograd kernel (customgrad's node, the same ``AutogradImpl.apply`` a direct call reaches)
and, for an op that mutates, an ``ADInplaceOrView`` kernel that bumps the versions of the tensors
it writes. An op with ``residuals=`` has a second overload, ``with_residuals``, whose kernels
return them too: the Autograd kernel runs it to hand them to ``save_for_backward``.

``torch.ops.ns.name``, ``torch.compile`` and modes reach the op through these kernels; the
direct call of the op skips the dispatcher when it can prove nothing else would run
(``CustomOp.__call__``). A later definition of the same name destroys the fragment
(:meth:`OpLibrary.destroy`), which removes every registration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.autograd.forward_ad as _fwad

from customgrad._errors import DefinitionError, MissingRegistrationError, where
from customgrad._flops import OpFlops, register_op_flops, unregister_op_flops
from customgrad._kernels import Kernel, Kernels, first_tensor
from customgrad._torch import dispatcher

if TYPE_CHECKING:
    from customgrad._autograd import AutogradImpl
    from customgrad._signature import Signature

__all__ = ["DispatchedOp", "OpLibrary", "any_requires_grad", "has_tangent"]

_below_autograd = dispatcher.below_autograd
_Tensor = torch.Tensor


class DispatchedOp(Protocol):
    """What the dispatcher's kernels read of an op (a :class:`~customgrad.CustomOp`)."""

    _sig: Signature
    _kernels: Kernels
    _impl: AutogradImpl
    _mutated_idx: tuple[int, ...]

    def _run_call(self, args: tuple[object, ...], kernel: Kernel | None, requires: bool) -> object:
        """Run a call whose kernel is decided (None: through the dispatcher, below autograd)."""


class OpLibrary:
    """The ``torch.library`` definition of one op and the kernels customgrad registers for it.

    Args:
        op: the op whose kernels these are.
        schema: the op's schema without the name (its outputs).
        kernel_schema: the kernel's schema (outputs, then residuals); defines ``with_residuals``
            when it differs from ``schema``.

    Raises:
        DefinitionError: ``torch.library`` refused the definition (nothing stays registered).
    """

    def __init__(self, op: DispatchedOp, schema: str, kernel_schema: str) -> None:
        self._op = op
        self._sig = sig = op._sig
        self._kernels = op._kernels
        self._impl = op._impl
        self._mutated_idx = op._mutated_idx
        name = sig.qualname
        ns, opname = name.split("::")
        residuals = bool(sig.residual_names)
        self._lib = torch.library.Library(ns, "FRAGMENT")
        try:
            self._lib.define(opname + schema)
            if residuals:
                self._lib.define(f"{opname}.with_residuals{kernel_schema}")
            packet = getattr(getattr(torch.ops, ns), opname)
            self.opoverload: dispatcher.OpOverload = packet.default
            """``torch.ops.ns.name.default``."""
            self.kernel_overload: dispatcher.OpOverload = (
                packet.with_residuals if residuals else packet.default
            )
            """The overload whose kernel returns the residuals too (``default`` without any)."""
            overloads = [""] + (["with_residuals"] if residuals else [])
            for overload in overloads:
                qual = opname if not overload else f"{opname}.{overload}"
                impl = self.backend if not overload else self.backend_full
                self._lib.impl(qual, impl, "CompositeExplicitAutograd")
                torch.library.register_fake(
                    f"{name}.{overload}" if overload else name,
                    self.fake if not overload else self.fake_full,
                    lib=self._lib,
                )
            self._lib.impl(opname, self.autograd, "Autograd")
            if self._mutated_idx:
                self._lib.impl(opname, self.inplace_view, "ADInplaceOrView", with_keyset=True)
            self._packet = packet
            register_op_flops(packet, OpFlops(self._kernels))
        except RuntimeError as e:
            dispatcher.destroy_library(self._lib)
            first = str(e).strip().splitlines()[0]
            raise DefinitionError(
                f"{name}: torch.library refused the definition (schema {schema}): {first}"
            ) from None

    def destroy(self) -> None:
        """Remove the definition and every registration (the name is free again)."""
        unregister_op_flops(self._packet)
        dispatcher.destroy_library(self._lib)

    # -- the kernels the dispatcher calls --------------------------------------------------
    def autograd(self, *args: object, **kwargs: object) -> object:
        """The Autograd kernel: customgrad's node, as a direct call records it."""
        args = self._sig.normalize(args, kwargs)
        return self._op._run_call(args, None, torch.is_grad_enabled() and any_requires_grad(args))

    def backend_full(self, *args: object, **kwargs: object) -> object:
        """Every return of the kernel (outputs, then residuals)."""
        kernels = self._kernels
        full = self._sig.normalize(args, kwargs)
        out = kernels.run(kernels.kernel_for(first_tensor(full)), full)
        kernels.checked_output(full, out)
        return out

    def backend(self, *args: object, **kwargs: object) -> object:
        """The op's outputs (residuals dropped)."""
        if self._sig.residual_names:
            with _below_autograd():
                out = self.kernel_overload(*args, **kwargs)
            return self._sig.split_outputs(out, ())[0]
        return self.backend_full(*args, **kwargs)

    def fake_full(self, *args: object, **kwargs: object) -> object:
        """The registered fake kernel: every return (outputs, then residuals)."""
        kernels = self._kernels
        fake = kernels.fake
        if fake is None:
            sig = self._sig
            raise MissingRegistrationError(
                f"{kernels.qualname}: no fake kernel registered; torch.compile, FakeTensorMode "
                f"and opcheck need one to know output shapes without running the op. Add:\n\n"
                f"    @{kernels.var}.register_fake\n"
                f"    def _({', '.join(sig.names)}):\n"
                f"        return <empty tensor(s) shaped like the output"
                f"{' and the residuals' if sig.residual_names else ''}>\n\n"
                f"(op defined at {where(kernels.fn)})"
            )
        return fake(*args, **kwargs)

    def fake(self, *args: object, **kwargs: object) -> object:
        """The fake kernel's outputs (residuals dropped)."""
        out = self.fake_full(*args, **kwargs)
        if self._sig.residual_names:
            return self._sig.split_outputs(out, ())[0]
        return out

    def inplace_view(
        self, keyset: dispatcher.DispatchKeySet, *args: object, **kwargs: object
    ) -> object:
        """``ADInplaceOrView``: run the op below, then bump the mutated tensors' versions."""
        with dispatcher.below_ad_inplace_or_view():
            out = self.opoverload.redispatch(
                keyset & dispatcher.AFTER_AD_INPLACE_OR_VIEW, *args, **kwargs
            )
        full = self._sig.normalize(args, kwargs)
        mutated: list[torch.Tensor] = []
        for i in self._mutated_idx:
            a = full[i]
            if isinstance(a, _Tensor):
                mutated.append(a)
            elif isinstance(a, (list, tuple)):
                mutated.extend(t for t in a if isinstance(t, _Tensor))
        if mutated:
            torch.autograd.graph.increment_version(mutated)
        return out


def any_requires_grad(args: tuple[object, ...]) -> bool:
    """Whether any tensor argument (or item of a tensor list) requires grad."""
    for a in args:
        if isinstance(a, _Tensor):
            if a.requires_grad:
                return True
        elif isinstance(a, (list, tuple)) and any(
            isinstance(t, _Tensor) and t.requires_grad for t in a
        ):
            return True
    return False


def has_tangent(args: tuple[object, ...]) -> bool:
    """Whether a forward-mode tangent is attached to any tensor argument."""
    for a in args:
        items = a if isinstance(a, (list, tuple)) else (a,)
        for t in items:
            if isinstance(t, _Tensor) and _fwad.unpack_dual(t).tangent is not None:
                return True
    return False
