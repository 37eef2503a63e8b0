"""``customgrad.op``: declare a custom op, register its kernels and its split autograd."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, Literal, TypeVar, overload

import torch
import torch.autograd.forward_ad as _fwad
from typing_extensions import ParamSpec

from customgrad import _fastpath
from customgrad._autograd import AutogradImpl
from customgrad._errors import (
    DefinitionError,
    KernelOutputError,
    MissingRegistrationError,
    MutationError,
    where,
)
from customgrad._kernels import IMPLS as _IMPLS
from customgrad._kernels import ForeignKeys, Kernels, dispatch_key
from customgrad._kernels import device_types as _device_types
from customgrad._messages import missing_autograd_message
from customgrad._rules import (
    AutogradRules,
    BackwardFn,
    Half,
    JvpFn,
    SaveForBackwardFn,
    SharedFn,
    SplitMode,
)
from customgrad._signature import ArgKind, Signature, make_schema, parse_name
from customgrad._switches import STATE as _SWITCHES

__all__ = [
    "BackwardFn",
    "CustomOp",
    "JvpFn",
    "SaveForBackwardFn",
    "SharedFn",
    "op",
    "registered_ops",
]

P = ParamSpec("P")
R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])

_OPS: weakref.WeakValueDictionary[str, CustomOp[..., Any]] = weakref.WeakValueDictionary()
"""The live ops by name. Weak: an op stays alive while its dispatcher registrations (which hold
its kernels) do, that is until it is replaced by a new definition of its name."""
_DECLINED = _fastpath.DECLINED
_below_autograd = torch._C._AutoDispatchBelowAutograd
_tf_mode_enabled: Callable[[], bool] = torch._C._is_torch_function_mode_enabled
_dispatch_stack_len: Callable[[], int] = torch._C._len_torch_dispatch_stack
_functorch_active: Callable[[], bool] = torch._C._are_functorch_transforms_active
_profiler = torch.autograd.profiler
_Tensor = torch.Tensor
# Plain tensors a kernel may be called with directly (Parameter adds no torch_function/dispatch).
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling
_alias_check: Callable[..., bool] | None = getattr(
    torch._C, "_any_output_is_alias_to_input_or_output", None
)
_TENSOR = ArgKind.TENSOR
_OPTIONAL = ArgKind.OPTIONAL_TENSOR
_LIST = ArgKind.TENSOR_LIST
_OTHER = ArgKind.OTHER


def _check_arity(qualname: str, what: str, fn: Callable[..., Any], want: int, shape: str) -> None:
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


class CustomOp(Generic[P, R]):
    """A custom op: a real dispatcher op (``torch.ops.ns.name.default``) with split autograd.

    Create one with :func:`customgrad.op`. Calling it runs the op: under autograd it records a
    customgrad node whose backward is the registered ``backward`` (or the input/weight pair),
    validated on every call.

    Attributes:
        name: ``"ns::name"``.
        opoverload: the ``torch._ops.OpOverload`` (``torch.ops.ns.name.default``).
        schema: the schema string, e.g. ``"(Tensor x, Tensor weight) -> Tensor"``.
        weights: names of the weight arguments.
        residuals: names of the values the kernel returns for ``save_for_backward`` only.
    """

    def __init__(
        self,
        name: str,
        fn: Callable[P, R],
        *,
        weights: Iterable[str] = (),
        mutates_args: Iterable[str] = (),
        device_types: str | Sequence[str] | None = None,
        output_differentiability: Sequence[bool] | None = None,
        schema: str | None = None,
        residuals: Iterable[str] = (),
    ) -> None:
        ns, opname = parse_name(name)
        weights = (weights,) if isinstance(weights, str) else tuple(weights)
        mutates = (mutates_args,) if isinstance(mutates_args, str) else tuple(mutates_args)
        residual_names = (residuals,) if isinstance(residuals, str) else tuple(residuals)
        types = _device_types(device_types)
        for dt in types or ():
            dispatch_key(name, dt)  # refuses an unknown device type
        kernel_schema = make_schema(name, fn, schema, mutates)
        diff = None if output_differentiability is None else tuple(output_differentiability)
        self._sig = Signature(name, kernel_schema, fn, weights, residual_names, diff)
        self._fn: Callable[..., Any] = fn
        self.name = name
        self.schema = self._sig.schema
        self.weights: tuple[str, ...] = weights
        self.residuals: tuple[str, ...] = residual_names
        self._mutates = mutates
        self._mutated_idx = tuple(self._sig.index[m] for m in mutates)
        self._var = opname
        self._kernels = Kernels(name, opname, fn)
        self._fake_fn: Callable[..., Any] | None = None
        self.signature: Signature = self._sig
        """Arguments, outputs, weights and residuals of the op."""
        self.rules = AutogradRules()
        """The current autograd registrations (read-only: use the ``register_*`` methods)."""
        self._impl = AutogradImpl(self)
        self._fast_call: Callable[[tuple[Any, ...]], Any] | None = None
        self._foreign_keys = ForeignKeys(name)

        old = _OPS.get(name)
        if old is not None:
            # A redefinition (a notebook cell run again): replace the old op, as torch's
            # custom_op does. Its nodes in existing graphs keep their backward.
            old._retire(self)
        self._lib = torch.library.Library(ns, "FRAGMENT")
        try:
            self._lib.define(opname + self.schema)
            if residual_names:
                self._lib.define(f"{opname}.with_residuals{kernel_schema}")
            packet = getattr(getattr(torch.ops, ns), opname)
            self.opoverload: torch._ops.OpOverload = packet.default
            self._kernel_overload: torch._ops.OpOverload = (
                packet.with_residuals if residual_names else packet.default
            )
            overloads = [""] + (["with_residuals"] if residual_names else [])
            for overload in overloads:
                qual = opname if not overload else f"{opname}.{overload}"
                impl = self._backend_impl if not overload else self._backend_full_impl
                self._lib.impl(qual, impl, "CompositeExplicitAutograd")
                torch.library.register_fake(
                    f"{name}.{overload}" if overload else name,
                    self._fake_impl if not overload else self._fake_full_impl,
                    lib=self._lib,
                )
            self._lib.impl(opname, self._autograd_impl, "Autograd")
            if mutates:
                self._lib.impl(opname, self._inplace_view_impl, "ADInplaceOrView", with_keyset=True)
            self._register_kernel(types, fn)
        except RuntimeError as e:
            self._lib._destroy()
            first = str(e).strip().splitlines()[0]
            raise DefinitionError(
                f"{name}: torch.library refused the definition (schema {self.schema}): {first}"
            ) from None
        _OPS[name] = self
        self.__name__ = opname
        self.__qualname__ = opname
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__wrapped__ = fn

    def _retire(self, new: CustomOp[..., Any]) -> None:
        """Give the name to ``new``: remove this op's registrations; calling it raises."""
        self._lib._destroy()
        self._fast_call = None
        self._replaced_by = new
        self.__class__ = _ReplacedOp

    # -- what customgrad's autograd reads (customgrad._rules.OpSpec) --------------------------
    def _run_kernel(self, args: tuple[Any, ...], kernel: Any) -> tuple[Any, tuple[Any, ...]]:
        """Run the kernel below autograd: ``(outputs as the op returns them, residuals)``."""
        sig = self._sig
        if kernel is None:
            with _below_autograd():
                out = sig.call(self._kernel_overload, args)
        elif sig.kwonly_names:
            out = sig.call(kernel, args)
        else:
            out = kernel(*args)
        return self._checked_output(args, out)

    def _missing_autograd_message(self) -> str:
        return missing_autograd_message(self._sig, self.rules, self._var, self._fn)

    # -- calling ---------------------------------------------------------------------------
    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        fast = self._fast_call
        grad = _grad_enabled()
        if fast is not None and grad and not kwargs and _SWITCHES.fastpath:
            # (without grad mode the fast call declines: not called, one frame less)
            out = fast(args)
            if out is not _DECLINED:
                return out  # type: ignore[no-any-return]
        sig = self._sig
        if kwargs or len(args) != sig.nargs or sig.kwonly_names:
            args = sig.bind(args, kwargs)  # type: ignore[assignment]
        if _is_compiling():
            # Dynamo records the OpOverload; its Autograd kernel below handles gradients.
            return sig.call(self.opoverload, args)  # type: ignore[no-any-return]
        # One pass over the arguments: are they of the right kinds, does any require grad,
        # and are they plain tensors (for the direct kernel call)? The first tensor picks the
        # kernel's device.
        requires = False
        plain = True
        first: Any = None
        for a, kind in zip(args, sig.kinds):
            if isinstance(a, _Tensor):
                if kind is _OTHER or kind is _LIST:
                    sig.check_args(args)  # raises, naming the argument
                if grad and a.requires_grad:
                    requires = True
                if first is None:
                    first = a
                if type(a) not in _PLAIN_TYPES:
                    plain = False
            elif kind is _OTHER:
                continue
            elif kind is _LIST and isinstance(a, (list, tuple)):
                for t in a:
                    if isinstance(t, _Tensor):
                        if grad and t.requires_grad:
                            requires = True
                        if first is None:
                            first = t
                        if type(t) not in _PLAIN_TYPES:
                            plain = False
                    elif t is not None:
                        sig.check_args(args)
            elif not (kind is _OPTIONAL and a is None):
                sig.check_args(args)
        if self._mutated_idx:
            self._check_mutated_no_grad(args)
        if first is not None and (
            _IMPLS is None
            or not _IMPLS.isdisjoint(
                self._foreign_keys.cpu
                if first.is_cpu
                else self._foreign_keys.cuda
                if first.is_cuda
                else self._foreign_keys[first.device.type]
            )
        ):  # self._dispatcher_decides(first.device.type), inline
            # A kernel or autocast rule registered through torch.library would run: let the
            # dispatcher run it, exactly as for torch.ops (its Autograd kernel is customgrad's).
            return sig.call(self.opoverload, args)  # type: ignore[no-any-return]
        kernel = self._shortcut_kernel(first) if plain else None
        if requires and sig.output_kinds:
            return self._impl.apply(args, kernel)  # type: ignore[no-any-return]
        if _fwad._current_level >= 0 and _has_tangent(args):
            return self._forward_ad(args, kernel)  # type: ignore[no-any-return]
        if kernel is not None:
            out = sig.call(kernel, args) if sig.kwonly_names else kernel(*args)
            return self._checked_output(args, out)[0]  # type: ignore[no-any-return]
        with _below_autograd():
            return sig.call(self.opoverload, args)  # type: ignore[no-any-return]

    def _forward_ad(self, args: tuple[Any, ...], kernel: Any) -> Any:
        """Forward-mode AD of inputs that need no backward: through the registered jvp."""
        if self.rules.jvp is None:
            raise MissingRegistrationError(
                f"{self.name}: forward-mode AD (torch.func.jvp, jacfwd, dual tensors) reached "
                f"this op, which has no jvp rule. Register one (customgrad never differentiates "
                f"the kernel behind your registered backward):\n\n"
                f"    @{self._var}.register_jvp\n"
                f"    def _(inputs, output, tangents):     # tangents.x is None without one\n"
                f"        return ...                         # the output's tangent\n"
            )
        return self._impl.apply(args, kernel, backward=False)

    def _checked_output(self, args: tuple[Any, ...], out: Any) -> tuple[Any, tuple[Any, ...]]:
        """Check the kernel's return against the schema and refuse outputs that alias inputs."""
        sig = self._sig
        if type(out) is _Tensor and not sig.kernel_output_is_tuple:
            public: Any = out
            residuals: tuple[Any, ...] = ()
            outs: tuple[Any, ...] = (out,)
        else:
            public, residuals = sig.split_outputs(out, args)
            if out is None:
                return public, residuals
            outs = tuple(out) if sig.kernel_output_is_tuple else (out,)
        if _alias_check is not None and _alias_check(args, {}, outs):
            raise KernelOutputError(
                f"{self.name}: the kernel returned a Tensor that is (a view of) one of its "
                f"inputs or of another output. Custom ops must return new tensors (as "
                f"torch.library.custom_op requires); under torch.compile an alias would give "
                f"different results. Return a copy (x.clone()), or leave the op out of the "
                f"aliasing part. (kernel defined at {where(self._fn)})"
            )
        return public, residuals

    def _check_mutated_no_grad(self, args: tuple[Any, ...]) -> None:
        for name, i in zip(self._mutates, self._mutated_idx):
            a = args[i]
            items = a if isinstance(a, (list, tuple)) else [a]
            if torch.is_grad_enabled() and any(
                isinstance(t, _Tensor) and t.requires_grad for t in items
            ):
                raise MutationError(
                    f"{self.name}: argument {name!r} is in mutates_args and requires grad; "
                    f"customgrad does not differentiate through in-place mutation. Pass "
                    f"{name}.detach() or a buffer that does not require grad. "
                    f"(op defined at {where(self._fn)})"
                )

    def _dispatcher_decides(self, device_type: str) -> bool:
        """Whether a kernel that customgrad did not register would run for a call on
        ``device_type``: a kernel for the device or an autocast rule registered through
        ``torch.library`` (``register_kernel``, ``register_autocast``, ``Library.impl``).

        customgrad registers one backend kernel (``CompositeExplicitAutograd``, which picks the
        op's kernel by device) and its Autograd kernel, so any device or autocast key of the op
        in torch.library's registrations is someone else's. When this torch does not keep those
        registrations, every call goes through the dispatcher.
        """
        return _IMPLS is None or not _IMPLS.isdisjoint(self._foreign_keys[device_type])

    def _shortcut_kernel(self, first: torch.Tensor | None) -> Callable[..., Any] | None:
        """The kernel to call directly, skipping the dispatcher, or None to dispatch.

        ``first`` is the first tensor argument. The dispatcher runs for ops that mutate, while a
        mode, transform or profiler is active, and for meta tensors (they go to the fake kernel).
        """
        if (
            first is None
            or self._mutates
            or first.is_meta
            # Nothing but the backend kernel may see a dispatcher call made now: no dispatch
            # or function mode, no functorch transform, no profiler. Calling the kernel directly
            # then gives exactly what the dispatcher would, minus its overhead.
            or _profiler._is_profiler_enabled
            or _dispatch_stack_len()
            or _tf_mode_enabled()
            or _functorch_active()
        ):
            return None
        by_device = self._kernels.by_device
        if len(by_device) == 1 and None in by_device:
            return by_device[None]
        return self._kernels.for_device(first.device.type)

    # -- what the dispatcher calls ---------------------------------------------------------
    def _autograd_impl(self, *args: Any, **kwargs: Any) -> Any:
        sig = self._sig
        args = sig.normalize(args, kwargs)
        if self._mutated_idx:
            self._check_mutated_no_grad(args)
        if sig.output_kinds and torch.is_grad_enabled() and _any_requires_grad(args):
            return self._impl.apply(args, None)
        if _fwad._current_level >= 0 and _has_tangent(args):
            return self._forward_ad(args, None)
        with _below_autograd():
            return sig.call(self.opoverload, args)

    def _backend_full_impl(self, *args: Any, **kwargs: Any) -> Any:
        """Every return of the kernel (outputs, then residuals)."""
        kernel = self._kernels.for_args(self._sig.normalize(args, kwargs))
        out = kernel(*args, **kwargs)
        self._checked_output(self._sig.normalize(args, kwargs), out)
        return out

    def _backend_impl(self, *args: Any, **kwargs: Any) -> Any:
        """The op's outputs (residuals dropped)."""
        if self._sig.residual_names:
            with _below_autograd():
                out = self._kernel_overload(*args, **kwargs)
            return self._sig.split_outputs(out, ())[0]
        return self._backend_full_impl(*args, **kwargs)

    def _fake_full_impl(self, *args: Any, **kwargs: Any) -> Any:
        fake = self._fake_fn
        if fake is None:
            sig = self._sig
            raise MissingRegistrationError(
                f"{self.name}: no fake kernel registered; torch.compile, FakeTensorMode and "
                f"opcheck need one to know output shapes without running the op. Add:\n\n"
                f"    @{self._var}.register_fake\n"
                f"    def _({', '.join(sig.names)}):\n"
                f"        return <empty tensor(s) shaped like the output"
                f"{' and the residuals' if sig.residual_names else ''}>\n\n"
                f"(op defined at {where(self._fn)})"
            )
        return fake(*args, **kwargs)

    def _fake_impl(self, *args: Any, **kwargs: Any) -> Any:
        out = self._fake_full_impl(*args, **kwargs)
        if self._sig.residual_names:
            return self._sig.split_outputs(out, ())[0]
        return out

    def _inplace_view_impl(self, keyset: Any, *args: Any, **kwargs: Any) -> Any:
        with torch._C._AutoDispatchBelowADInplaceOrView():
            out = self.opoverload.redispatch(
                keyset & torch._C._after_ADInplaceOrView_keyset, *args, **kwargs
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

    # -- registration ----------------------------------------------------------------------
    def _set_rules(self, rules: AutogradRules) -> None:
        """Swap in new autograd registrations (whole, so a backward sees one consistent set)."""
        self.rules = rules
        self._refresh_fast()

    def _refresh_fast(self) -> None:
        """Rebuild the fast path for the current registrations and kernels."""
        self._fast_call = _fastpath.build(
            self._impl,
            self._kernels.by_device,
            self._checked_output,
            bool(self._mutates),
            _IMPLS,
            self._foreign_keys,
        )

    def _register_kernel(self, types: tuple[str, ...] | None, fn: Callable[..., Any]) -> None:
        """Put ``fn`` in the op's kernel table (the one backend kernel reads it by device)."""
        for dt in types or (None,):
            self._kernels.by_device[dt] = fn
        self._refresh_fast()

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
        types = _device_types(device_types)
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
        self._fake_fn = fn
        return fn

    def register_save_for_backward(self, fn: F) -> F:
        """Register ``save_for_backward(inputs, output) -> pytree`` (``inputs``: the arguments by
        name; ``save_for_backward(inputs, output, residuals)`` for an op with residuals)."""
        if self._sig.residual_names:
            _check_arity(self.name, "save_for_backward", fn, 3, "(inputs, output, residuals)")
        else:
            _check_arity(self.name, "save_for_backward", fn, 2, "(inputs, output)")
        self._set_rules(self.rules.replace(save=fn))
        return fn

    def _grads_shape(self) -> str:
        n = len(self._sig.output_kinds)
        grads = ["grad"] if n == 1 else [f"grad{i}" for i in range(n)]
        return f"(ctx, saved, {', '.join(grads)}): one gradient per output"

    def _half_rules(self, half: Half, fn: Callable[..., Any], differentiable: bool) -> Any:
        sig = self._sig
        if half == "weight" and not sig.weights:
            raise DefinitionError(
                f"{self.name}: register_backward_weight on an op without weights. Its backward is "
                f"its input half alone: register it with @{self._var}.register_backward_input "
                f"(or name the weight arguments in cg.op(..., weights=...)). (backward_weight "
                f"defined at {where(fn)})"
            )
        if half == "input" and sig.weights and not sig.input_names:
            raise DefinitionError(
                f"{self.name}: register_backward_input on an op whose Tensor arguments are all "
                f"weights ({', '.join(sig.weights)}). Its backward is its weight half alone: "
                f"register it with @{self._var}.register_backward_weight. (backward_input "
                f"defined at {where(fn)})"
            )
        _check_arity(
            self.name,
            f"the {half} backward",
            fn,
            2 + len(self._sig.output_kinds),
            self._grads_shape(),
        )
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
                self.rules.replace(
                    backward=f,
                    backward_input=None,
                    backward_weight=None,
                    backward_shared=None,
                    split=split,
                    recompute=recompute,
                    nondifferentiable=nondiff,
                    auto=_auto_split(self, f, split, recompute),
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
                self.rules.replace(
                    backward_input=f, backward=None, auto=None, nondifferentiable=nondiff
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
                self.rules.replace(
                    backward_weight=f, backward=None, auto=None, nondifferentiable=nondiff
                )
            )
            return f

        return register if fn is None else register(fn)

    def register_backward_shared(self, fn: F) -> F:
        """Register work both halves need, ``shared(ctx, saved, *grads) -> Any``.

        The halves read it as ``ctx.shared``: computed once per node, in the earlier pass of a
        split backward, kept for the later pass and freed after it (in a full backward, once).
        """
        _check_arity(
            self.name,
            "the shared backward",
            fn,
            2 + len(self._sig.output_kinds),
            self._grads_shape(),
        )
        self._set_rules(self.rules.replace(backward_shared=fn, backward=None, auto=None))
        return fn

    def register_jvp(self, fn: F) -> F:
        """Register the forward-mode rule ``jvp(inputs, output, tangents) -> output tangent``.

        Used by ``torch.func.jvp``, ``jacfwd`` and dual tensors; ``tangents`` holds a tangent
        (or None) per argument, by name.
        """
        _check_arity(self.name, "jvp", fn, 3, "(inputs, output, tangents)")
        self._set_rules(self.rules.replace(jvp=fn))
        return fn

    # -- identity --------------------------------------------------------------------------
    def __deepcopy__(self, memo: dict[int, Any]) -> CustomOp[P, R]:
        return self

    def __copy__(self) -> CustomOp[P, R]:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (_lookup, (self.name,))

    def __repr__(self) -> str:
        return f"<customgrad op {self.name}{self.schema}>"


MSG_REPLACED = """\
{name}: this op was replaced by a later definition of the same name (at {new_loc}), as \
torch's custom_op replaces one; the old object no longer runs or takes registrations. Use the \
new one: the object that definition returned, or torch.ops.{ns}.{opname}. (replaced op defined \
at {old_loc})"""


class _ReplacedOp(CustomOp[P, R]):
    """A :class:`CustomOp` whose name a later definition took (see ``CustomOp._retire``)."""

    _replaced_by: CustomOp[..., Any]

    def _replaced(self) -> MissingRegistrationError:
        ns, opname = self.name.split("::")
        return MissingRegistrationError(
            MSG_REPLACED.format(
                name=self.name,
                new_loc=where(self._replaced_by._fn),
                ns=ns,
                opname=opname,
                old_loc=where(self._fn),
            )
        )

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        raise self._replaced()

    def _set_rules(self, rules: AutogradRules) -> None:
        raise self._replaced()

    def _register_kernel(self, types: tuple[str, ...] | None, fn: Callable[..., Any]) -> None:
        raise self._replaced()

    def register_fake(self, fn: F) -> F:
        raise self._replaced()


def registered_ops() -> list[CustomOp[..., Any]]:
    """Every customgrad op defined in this process (the current definition of each name)."""
    return [op for op in _OPS.values() if type(op) is not _ReplacedOp]


def _auto_split(op: CustomOp[..., Any], fn: Callable[..., Any], split: str, recompute: str) -> Any:
    """The automatic splitter for a single backward, or None (``split="phase"``)."""
    if split != "auto":
        return None
    # Tracing imports torch._dynamo; imported inside the first backward, that import keeps the
    # backward's frames (and so the node and its saved tensors) alive for good. Import it now.
    import torch._dynamo  # noqa: F401

    from customgrad._autosplit import AutoSplitter  # imports torch.fx: only when needed

    return AutoSplitter(op, fn, recompute)


def autograd_impl(op: CustomOp[..., Any]) -> AutogradImpl:
    """The autograd implementation of ``op`` (for customgrad's tools: ``check_op``)."""
    return op._impl


def _lookup(name: str) -> CustomOp[..., Any]:
    op = _OPS.get(name)
    if op is None:
        raise MissingRegistrationError(
            f"customgrad op {name!r} is not defined in this process, so it cannot be "
            f"unpickled. Import the module that defines it (its cg.op({name!r}, ...)) before "
            f"unpickling, e.g. in each worker process."
        )
    return op


def _any_requires_grad(args: tuple[Any, ...]) -> bool:
    for a in args:
        if isinstance(a, _Tensor):
            if a.requires_grad:
                return True
        elif isinstance(a, (list, tuple)) and any(
            isinstance(t, _Tensor) and t.requires_grad for t in a
        ):
            return True
    return False


def _has_tangent(args: tuple[Any, ...]) -> bool:
    """Whether a forward-mode tangent is attached to any tensor argument."""
    for a in args:
        items = a if isinstance(a, (list, tuple)) else (a,)
        for t in items:
            if isinstance(t, _Tensor) and _fwad.unpack_dual(t).tangent is not None:
                return True
    return False


@overload
def op(
    name: str,
    fn: None = None,
    /,
    *,
    weights: Iterable[str] = (),
    mutates_args: Iterable[str] = (),
    device_types: str | Sequence[str] | None = None,
    output_differentiability: Sequence[bool] | None = None,
    schema: str | None = None,
    residuals: Iterable[str] = (),
) -> Callable[[Callable[P, R]], CustomOp[P, R]]: ...


@overload
def op(
    name: str,
    fn: Callable[P, R],
    /,
    *,
    weights: Iterable[str] = (),
    mutates_args: Iterable[str] = (),
    device_types: str | Sequence[str] | None = None,
    output_differentiability: Sequence[bool] | None = None,
    schema: str | None = None,
    residuals: Iterable[str] = (),
) -> CustomOp[P, R]: ...


def op(
    name: str,
    fn: Callable[P, R] | None = None,
    /,
    *,
    weights: Iterable[str] = (),
    mutates_args: Iterable[str] = (),
    device_types: str | Sequence[str] | None = None,
    output_differentiability: Sequence[bool] | None = None,
    schema: str | None = None,
    residuals: Iterable[str] = (),
) -> CustomOp[P, R] | Callable[[Callable[P, R]], CustomOp[P, R]]:
    """Declare a custom op from a type-annotated function.

    The schema is inferred from the annotations with ``torch.library.infer_schema`` (or given
    with ``schema=``); ``fn`` becomes the kernel for ``device_types`` (all devices when None).
    The op is a real dispatcher op: ``torch.ops.ns.name.default`` gives the same outputs and
    gradients.

    Args:
        name: ``"namespace::name"``; reserved namespaces (``aten``, ``torch``, ...) are refused.
        fn: the kernel. Omit it to use ``op`` as a decorator.
        weights: names of weight arguments (Tensor arguments whose gradients a zero-bubble
            schedule computes in the W pass).
        mutates_args: names of arguments the kernel writes to in place.
        device_types: device types ``fn`` serves, e.g. ``"cpu"`` or ``("cpu", "cuda")``.
        output_differentiability: one bool per output; False marks it non-differentiable.
        schema: the schema without the name, e.g. ``"(Tensor q, int[2] window=[-1, -1]) ->
            Tensor"``, for what annotations can't say (tuple defaults, ``Tensor?`` outputs).
        residuals: names for the kernel's last return values that are not outputs: only
            ``save_for_backward`` sees them (``save_for_backward(inputs, output, residuals)``),
            on every call path (direct, ``torch.ops``, ``torch.compile``, fake kernels).

    Returns:
        A :class:`CustomOp`, callable with ``fn``'s signature.

    Raises:
        DefinitionError: for an invalid name, ``weights``, device type, schema or annotations.

    Example:
        >>> import torch, customgrad as cg
        >>> @cg.op("doc_op::scale", weights=("w",))
        ... def scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ...     return x * w
        >>> @scale.register_fake
        ... def _(x, w):
        ...     return torch.empty_like(x)
        >>> @scale.register_save_for_backward
        ... def _(inputs, output):
        ...     return inputs.x, inputs.w
        >>> @scale.register_backward
        ... def _(ctx, saved, grad):
        ...     x, w = saved
        ...     return {"x": grad * w, "w": (grad * x).sum(0, keepdim=True)}
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> w = torch.full((1, 3), 2.0, requires_grad=True)
        >>> scale(x, w).sum().backward()
        >>> x.grad
        tensor([[2., 2., 2.],
                [2., 2., 2.]])
        >>> w.grad
        tensor([[2., 2., 2.]])
    """

    def define(f: Callable[P, R]) -> CustomOp[P, R]:
        return CustomOp(
            name,
            f,
            weights=weights,
            mutates_args=mutates_args,
            device_types=device_types,
            output_differentiability=output_differentiability,
            schema=schema,
            residuals=residuals,
        )

    if fn is None:
        return define
    return define(fn)
