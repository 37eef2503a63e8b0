"""The ``register_*`` methods of an op: each checks the function it is given and swaps it in.

Kernels go into the op's kernel table (:class:`~customgrad._kernels.Kernels`); autograd
registrations replace the op's :class:`~customgrad._rules.AutogradRules` whole, so that a
backward always sees one consistent set. Every change of rules or kernels rebuilds the op's fast
call. A function that cannot take the arguments customgrad will call it with is refused here,
when it is registered, rather than at its first call (:func:`check_arity`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast, overload

from customgrad._errors import DefinitionError, where
from customgrad._kernels import Kernels, dispatch_key
from customgrad._kernels import device_types as device_types_of
from customgrad._rules import AutogradRules, Half, OpSpec, SplitMode
from customgrad._torch import dynamo

if TYPE_CHECKING:
    from customgrad._autosplit import AutoSplitter
    from customgrad._signature import Signature

__all__ = ["OpRegistration", "check_arity", "check_backward", "grads_shape"]

# A user function: registration takes any callable (customgrad checks its arity here, its results
# at every call), so its parameters are not checked against the rule's Protocol statically.
F = TypeVar("F", bound=Callable[..., Any])


def check_arity(qualname: str, what: str, fn: Callable[..., object], want: int, shape: str) -> None:
    """Refuse a registered function that cannot take ``want`` positional arguments."""
    if not callable(fn):
        raise DefinitionError(f"{qualname}: {what} must be a function, got {fn!r}.")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins: nothing to check
        return
    positional = [
        p
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    required = sum(1 for p in positional if p.default is inspect.Parameter.empty)
    if required <= want and (varargs or len(positional) >= want):
        return
    raise DefinitionError(
        f"{qualname}: {what} takes {len(positional)} positional parameter(s), but customgrad "
        f"calls it with {want}: {shape}. (defined at {where(fn)})"
    )


def grads_shape(sig: Signature) -> str:
    """The parameters customgrad calls a backward function with, in words."""
    n = len(sig.output_kinds)
    grads = ["grad"] if n == 1 else [f"grad{i}" for i in range(n)]
    return f"(ctx, saved, {', '.join(grads)}): one gradient per output"


def check_backward(sig: Signature, var: str, half: Half, fn: Callable[..., object]) -> None:
    """Refuse a backward function for a half the op does not have, or of the wrong arity."""
    name = sig.qualname
    if half == "weight" and not sig.weights:
        raise DefinitionError(
            f"{name}: register_backward_weight on an op without weights. Its backward is "
            f"its input half alone: register it with @{var}.register_backward_input "
            f"(or name the weight arguments in cg.op(..., weights=...)). (backward_weight "
            f"defined at {where(fn)})"
        )
    if half == "input" and sig.weights and not sig.input_names:
        raise DefinitionError(
            f"{name}: register_backward_input on an op whose Tensor arguments are all "
            f"weights ({', '.join(sig.weights)}). Its backward is its weight half alone: "
            f"register it with @{var}.register_backward_weight. (backward_input "
            f"defined at {where(fn)})"
        )
    check_arity(name, f"the {half} backward", fn, 2 + len(sig.output_kinds), grads_shape(sig))


class OpRegistration:
    """The ``register_*`` methods of :class:`~customgrad.CustomOp`, which inherits them.

    Each returns the function it was given, so decorators stack; registering again replaces
    the earlier function. Registrations may come after the op's first call.
    """

    name: str
    rules: AutogradRules
    _sig: Signature
    _var: str
    _kernels: Kernels

    def _set_rules(self, rules: AutogradRules) -> None:
        """Swap in new autograd registrations (whole, so a backward sees one consistent set)."""
        self.rules = rules

    def _register_kernel(self, types: tuple[str, ...] | None, fn: Callable[..., object]) -> None:
        """Put ``fn`` in the op's kernel table (the one backend kernel reads it by device)."""
        for dt in types or (None,):
            self._kernels.by_device[dt] = fn

    @overload
    def register_kernel(
        self, device_types: str | Sequence[str] | None, fn: None = None
    ) -> Callable[[F], F]: ...

    @overload
    def register_kernel(self, device_types: str | Sequence[str] | None, fn: F) -> F: ...

    def register_kernel(
        self, device_types: str | Sequence[str] | None, fn: F | None = None
    ) -> F | Callable[[F], F]:
        """Register ``fn`` as the kernel for ``device_types`` (all devices when None).

        Registering again for the same device replaces the earlier kernel.

        Raises:
            DefinitionError: an unknown device type (``"cpuu"``, ``"CPU"``, ``"cpu:0"``).

        Example:
            >>> import torch, customgrad as cg
            >>> @cg.op("doc_kernel::double")
            ... def double(x: torch.Tensor) -> torch.Tensor:
            ...     return x * 2
            >>> @double.register_kernel("cpu")
            ... def _(x):
            ...     return x + x
            >>> double(torch.ones(2))
            tensor([2., 2.])
        """
        types = device_types_of(device_types)
        for dt in types or ():
            dispatch_key(self.name, dt)  # refuses an unknown device type

        def register(f: F) -> F:
            if not callable(f):
                raise DefinitionError(f"{self.name}: register_kernel needs a function, got {f!r}.")
            self._register_kernel(types, f)
            return f

        return register if fn is None else register(fn)

    def register_fake(self, fn: F) -> F:
        """Register the fake (meta) kernel: output tensors of the right shape, dtype and device
        (and the residuals, for an op that declares ``residuals=``)."""
        if not callable(fn):
            raise DefinitionError(f"{self.name}: register_fake needs a function, got {fn!r}.")
        self._kernels.fake = fn
        return fn

    def register_flops(self, fn: F) -> F:
        """Register the kernel's FLOP count, ``flops(*args) -> int``, for a kernel a FLOP
        counter cannot see into (a Triton kernel, a C++/CUDA extension).

        ``torch.utils.flop_counter.FlopCounterMode`` (and customgrad's tools) count each call of
        the op's forward as what ``fn`` returns; it is called with the op's arguments, whose
        tensors may be fake or meta: read their shapes, not their values. Without it, a call
        counts as the torch ops the kernel runs (counted once per shape on fake tensors). The
        backward counts as what it runs: kernels it calls as ops have formulas of their own.

        Example:
            >>> import math, torch, customgrad as cg
            >>> @cg.op("doc_flops::matmul")
            ... def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            ...     return a @ b                 # imagine a Triton kernel here
            >>> @matmul.register_flops
            ... def _(a, b):
            ...     return 2 * math.prod(a.shape) * b.shape[-1]
            >>> from torch.utils.flop_counter import FlopCounterMode
            >>> with FlopCounterMode(display=False) as counter:
            ...     _ = matmul(torch.randn(8, 16), torch.randn(16, 32))
            >>> counter.get_total_flops()
            8192
        """
        check_arity(self.name, "flops", fn, len(self._sig.names), f"({', '.join(self._sig.names)})")
        self._kernels.flops = fn
        return fn

    def register_save_for_backward(self, fn: F) -> F:
        """Register ``save_for_backward(inputs, output) -> pytree`` (``inputs``: the arguments by
        name; ``save_for_backward(inputs, output, residuals)`` for an op with residuals)."""
        if self._sig.residual_names:
            check_arity(self.name, "save_for_backward", fn, 3, "(inputs, output, residuals)")
        else:
            check_arity(self.name, "save_for_backward", fn, 2, "(inputs, output)")
        self._set_rules(dataclasses.replace(self.rules, save=fn))
        return fn

    def _half_rules(
        self, half: Half, fn: Callable[..., object], differentiable: bool
    ) -> frozenset[Half]:
        """Check a backward function for ``half``; the halves registered as not differentiable
        once it is registered."""
        check_backward(self._sig, self._var, half, fn)
        nondiff = set(self.rules.nondifferentiable) - {half}
        if not differentiable:
            nondiff.add(half)
        return frozenset(nondiff)

    @overload
    def register_backward(
        self,
        fn: F,
        /,
        *,
        split: SplitMode = "auto",
        recompute: Literal["none", "cheap"] = "none",
        differentiable: bool = True,
    ) -> F: ...

    @overload
    def register_backward(
        self,
        fn: None = None,
        /,
        *,
        split: SplitMode = "auto",
        recompute: Literal["none", "cheap"] = "none",
        differentiable: bool = True,
    ) -> Callable[[F], F]: ...

    def register_backward(
        self,
        fn: F | None = None,
        /,
        *,
        split: SplitMode = "auto",
        recompute: Literal["none", "cheap"] = "none",
        differentiable: bool = True,
    ) -> F | Callable[[F], F]:
        """Register one backward returning ``{arg_name: grad}`` for every argument.

        customgrad splits it for zero-bubble schedules: with ``split="auto"`` (default) it is
        traced (``make_fx`` on fake tensors, with every argument that requires grad asked for)
        and partitioned into the part input gradients need and the part weight gradients need
        (work both need is done once, in the earlier pass, and handed to the later one). With
        ``split="phase"`` it is called once per pass with ``ctx.needs_input_grad`` set for that
        pass.

        A traced backward gives what calling it would give, or it is not traced. A trace is
        reused only for a call with the same: shapes, strides, dtypes, devices and
        ``requires_grad`` of the saved tensors and output gradients; plain saved values; set of
        arguments that require grad; ambient state (autocast per device type, deterministic
        algorithms, default dtype and device); and values the function reads from its closure,
        defaults and globals (and those of the user functions it calls): plain values, dicts,
        lists, tuples and sets by value, tensors by identity, functions and modules by identity.

        It may read ``t.requires_grad``, ``ctx.needs_input_grad``, plain values and config
        dicts; call torch ops and other custom ops (kept as opaque calls); write in place into
        tensors it created. It falls back to ``split="phase"``, with one warning on the
        ``customgrad`` logger saying why, when it branches on tensor values, touches data
        pointers, reads an object whose state a trace would freeze (an ``nn.Module``, a user
        object), changes Python state it reads, or writes into its inputs. It must not branch on
        state read through library modules (``os.environ``, ``random``, ``torch.backends``
        flags), which is not checked. Its Python side effects (prints, logging) happen when it
        is traced, not at every backward.

        To see how an op's backward split (traced, or fallen back and why): the log line,
        ``customgrad.testing.check_op(op, ...).backward``, or ``NodeInfo.auto_split`` of
        ``customgrad.graph.explain_split``. See docs/writing-ops/traced-backward.md.

        Args:
            fn: ``backward(ctx, saved, *grads) -> dict``.
            split: ``"auto"`` or ``"phase"``, see above.
            recompute: ``"cheap"`` recomputes shared results without FLOPs (views,
                elementwise) in the later pass instead of keeping them between passes.
            differentiable: False when the backward is not itself differentiable (like
                ``torch.autograd.function.once_differentiable``): double backward then raises.
        """

        def register(f: F) -> F:
            if split not in ("auto", "phase"):
                raise DefinitionError(
                    f"{self.name}: register_backward(split={split!r}): use 'auto' or 'phase'."
                )
            if recompute not in ("none", "cheap"):
                raise DefinitionError(
                    f"{self.name}: register_backward(recompute={recompute!r}): use 'none' or "
                    f"'cheap'."
                )
            nondiff = self._half_rules("full", f, differentiable)
            self._set_rules(
                dataclasses.replace(
                    self.rules,
                    backward=f,
                    backward_input=None,
                    backward_weight=None,
                    backward_shared=None,
                    split=split,
                    recompute=recompute,
                    nondifferentiable=nondiff,
                    auto=_auto_split(cast("OpSpec", self), f, split, recompute),
                )
            )
            return f

        return register if fn is None else register(fn)

    @overload
    def register_backward_input(self, fn: F, /, *, differentiable: bool = True) -> F: ...

    @overload
    def register_backward_input(
        self, fn: None = None, /, *, differentiable: bool = True
    ) -> Callable[[F], F]: ...

    def register_backward_input(
        self, fn: F | None = None, /, *, differentiable: bool = True
    ) -> F | Callable[[F], F]:
        """Register the input half: gradients of the non-weight arguments only.

        An op without weights needs only this half.
        """

        def register(f: F) -> F:
            nondiff = self._half_rules("input", f, differentiable)
            self._set_rules(
                dataclasses.replace(
                    self.rules,
                    backward_input=f,
                    backward=None,
                    auto=None,
                    nondifferentiable=nondiff,
                )
            )
            return f

        return register if fn is None else register(fn)

    @overload
    def register_backward_weight(self, fn: F, /, *, differentiable: bool = True) -> F: ...

    @overload
    def register_backward_weight(
        self, fn: None = None, /, *, differentiable: bool = True
    ) -> Callable[[F], F]: ...

    def register_backward_weight(
        self, fn: F | None = None, /, *, differentiable: bool = True
    ) -> F | Callable[[F], F]:
        """Register the weight half: gradients of the weight arguments only."""

        def register(f: F) -> F:
            nondiff = self._half_rules("weight", f, differentiable)
            self._set_rules(
                dataclasses.replace(
                    self.rules,
                    backward_weight=f,
                    backward=None,
                    auto=None,
                    nondifferentiable=nondiff,
                )
            )
            return f

        return register if fn is None else register(fn)

    def register_backward_shared(self, fn: F) -> F:
        """Register work both halves need, ``shared(ctx, saved, *grads) -> Any``.

        The halves read it as ``ctx.shared``: computed once per node, in the earlier pass of a
        split backward, kept for the later pass and freed after it (in a full backward, once).
        """
        check_arity(
            self.name,
            "the shared backward",
            fn,
            2 + len(self._sig.output_kinds),
            grads_shape(self._sig),
        )
        self._set_rules(
            dataclasses.replace(self.rules, backward_shared=fn, backward=None, auto=None)
        )
        return fn

    def register_jvp(self, fn: F) -> F:
        """Register the forward-mode rule ``jvp(inputs, output, tangents) -> output tangent``.

        Used by ``torch.func.jvp``, ``jacfwd`` and dual tensors; ``tangents`` holds a tangent
        (or None) per argument, by name.
        """
        check_arity(self.name, "jvp", fn, 3, "(inputs, output, tangents)")
        self._set_rules(dataclasses.replace(self.rules, jvp=fn))
        return fn


def _auto_split(
    op: OpSpec, fn: Callable[..., object], split: str, recompute: str
) -> AutoSplitter | None:
    """The automatic splitter for a single backward, or None (``split="phase"``)."""
    if split != "auto":
        return None
    # Tracing imports dynamo; imported inside the first backward, that import keeps the
    # backward's frames (and so the node and its saved tensors) alive for good. Import it now.
    dynamo.load()

    from customgrad._autosplit import AutoSplitter  # imports torch.fx: only when needed

    return AutoSplitter(op, fn, recompute)
