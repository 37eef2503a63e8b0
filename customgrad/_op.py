"""``customgrad.op``: declare a custom op, register its kernels and its split autograd."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, Protocol, TypeVar, overload

import torch
from typing_extensions import ParamSpec

from customgrad import _autograd
from customgrad._errors import DefinitionError, MissingRegistrationError, MutationError, where
from customgrad._signature import Signature, parse_name

__all__ = [
    "BackwardFn",
    "CustomOp",
    "SaveForBackwardFn",
    "op",
]

P = ParamSpec("P")
R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])

_OPS: dict[str, CustomOp[..., Any]] = {}
_below_autograd = torch._C._AutoDispatchBelowAutograd
_tls_include = getattr(torch._C, "_dispatch_tls_local_include_set", None)
_tf_mode_enabled = getattr(torch._C, "_is_torch_function_mode_enabled", None)
_PLAIN_INCLUDE = _tls_include().raw_repr() if _tls_include is not None else None
_profiler = torch.autograd.profiler
_Tensor = torch.Tensor
# Plain tensors a kernel may be called with directly (Parameter adds no torch_function/dispatch).
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling


def _plain_dispatch() -> bool:
    """True when nothing but the backend kernel would see a dispatcher call made now.

    No dispatch or function mode, no functorch transform, no profiler: calling the kernel
    directly then gives exactly what the dispatcher would, minus its overhead.
    """
    if _tls_include is None or _tf_mode_enabled is None or _profiler._is_profiler_enabled:
        return False
    return _tls_include().raw_repr() == _PLAIN_INCLUDE and not _tf_mode_enabled()


class SaveForBackwardFn(Protocol):
    """``save_for_backward(inputs, output) -> pytree``: what the backward will need."""

    def __call__(self, inputs: Any, output: Any, /) -> Any: ...


class BackwardFn(Protocol):
    """``backward(ctx, saved, *grads) -> {arg_name: grad}``."""

    def __call__(
        self, ctx: _autograd.BackwardContext, saved: Any, /, *grads: Any
    ) -> dict[str, Any]: ...


MSG_NO_AUTOGRAD = """\
{name}: an input requires grad, but the op has no autograd registered{missing}.
Register a save_for_backward function and either one backward or the input/weight pair:

    @{var}.register_save_for_backward
    def _(inputs, output):
        return inputs.x, inputs.weight

    @{var}.register_backward_input           # gradients of non-weight arguments
    def _(ctx, saved, grad):
        x, weight = saved
        return {{"x": grad @ weight}}

    @{var}.register_backward_weight          # gradients of {weights}
    def _(ctx, saved, grad):
        x, weight = saved
        return {{"weight": grad.mT @ x}}

(or @{var}.register_backward for a single backward returning every gradient).
Call the op under torch.no_grad() or on inputs that don't require grad if you need no gradients.
(op defined at {loc})"""


def _device_key(device_type: str) -> str:
    to_key = getattr(torch._C, "_dispatch_key_for_device", None)
    if to_key is not None:
        return str(to_key(device_type))
    return {"cpu": "CPU", "cuda": "CUDA", "xpu": "XPU", "mps": "MPS", "meta": "Meta"}.get(
        device_type, device_type.upper()
    )


def _device_types(device_types: str | Sequence[str] | None) -> tuple[str, ...] | None:
    if device_types is None:
        return None
    if isinstance(device_types, str):
        return (device_types,)
    return tuple(device_types)


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
    ) -> None:
        ns, opname = parse_name(name)
        if name in _OPS:
            raise DefinitionError(
                f"{name}: an op of that name is already defined (at {where(_OPS[name]._fn)}). "
                f"Op names are global, like torch.ops; pick another name."
            )
        if isinstance(weights, str):
            weights = (weights,)
        if isinstance(mutates_args, str):
            mutates_args = (mutates_args,)
        weights = tuple(weights)
        mutates = tuple(mutates_args)
        try:
            schema = torch.library.infer_schema(fn, mutates_args=mutates)
        except (ValueError, TypeError) as e:
            raise DefinitionError(
                f"{name}: cannot infer the op's schema from the annotations of the function "
                f"defined at {where(fn)}: {e}"
            ) from None
        diff = None if output_differentiability is None else tuple(output_differentiability)
        self._fn: Callable[..., Any] = fn
        self._sig = Signature(name, schema, fn, weights, diff)
        self.name = name
        self.schema = schema
        self.weights: tuple[str, ...] = weights
        self._mutates = mutates
        self._lib = torch.library.Library(ns, "FRAGMENT")
        try:
            self._lib.define(opname + schema)
        except RuntimeError as e:
            raise DefinitionError(
                f"{name}: torch.library refused the definition (schema {schema}): {e}"
            ) from None
        self.opoverload: torch._ops.OpOverload = getattr(getattr(torch.ops, ns), opname).default
        self._opoverload = self.opoverload

        self._kernels: dict[str | None, Callable[..., Any]] = {}
        self._registered_keys: set[str] = set()
        self._fake_fn: Callable[..., Any] | None = None
        self._save_fn: SaveForBackwardFn | None = None
        self._backward_fn: BackwardFn | None = None
        self._backward_input_fn: BackwardFn | None = None
        self._backward_weight_fn: BackwardFn | None = None

        self._lib.impl(opname, self._composite_kernel, "CompositeExplicitAutograd")
        self._lib.impl(opname, self._autograd_kernel, "Autograd")
        if mutates:
            self._lib.impl(opname, self._inplace_view_kernel, "ADInplaceOrView", with_keyset=True)
        torch.library.register_fake(name, self._fake_kernel, lib=self._lib)
        self.register_kernel(device_types, fn)
        _OPS[name] = self
        self.__name__ = opname
        self.__qualname__ = opname
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    # -- calling ---------------------------------------------------------------------------
    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        sig = self._sig
        if kwargs or len(args) != sig.nargs:
            args = sig.bind(args, kwargs)  # type: ignore[assignment]
        if _is_compiling():
            # Dynamo records the OpOverload; its Autograd kernel below handles gradients.
            return sig.call(self._opoverload, args)  # type: ignore[no-any-return]
        if not sig.has_lists:
            # One pass over the arguments: does any require grad, and are they plain tensors
            # on one device (for _kernel_on)?
            grad = _grad_enabled()
            requires = False
            exact = True
            device = None
            for a in args:
                if isinstance(a, _Tensor):
                    if grad and a.requires_grad:
                        requires = True
                    if type(a) not in _PLAIN_TYPES:
                        exact = False
                    elif device is None and exact:
                        device = a.device.type
                elif isinstance(a, (list, tuple)) and any(isinstance(t, _Tensor) for t in a):
                    return self._call_general(args)  # type: ignore[no-any-return]
            kernel = self._kernel_on(device) if exact else None
            if requires:
                return _autograd.apply(self, args, kernel)  # type: ignore[no-any-return]
            if kernel is not None:
                if sig.kwonly_names:
                    return sig.call(kernel, args)  # type: ignore[no-any-return]
                return kernel(*args)  # type: ignore[no-any-return]
            with _below_autograd():
                return sig.call(self._opoverload, args)  # type: ignore[no-any-return]
        return self._call_general(args)  # type: ignore[no-any-return]

    def _call_general(self, args: tuple[Any, ...]) -> Any:
        sig = self._sig
        if torch.is_grad_enabled() and _any_requires_grad(args):
            return _autograd.apply(self, args)
        kernel = self._direct_kernel(args)
        if kernel is not None:
            return sig.call(kernel, args)
        with _below_autograd():
            return sig.call(self._opoverload, args)

    def _autograd_kernel(self, *args: Any, **kwargs: Any) -> Any:
        args = self._sig.normalize(args, kwargs)
        if torch.is_grad_enabled() and _any_requires_grad(args):
            return _autograd.apply(self, args)
        with torch._C._AutoDispatchBelowAutograd():
            return self._sig.call(self._opoverload, args)

    def _inplace_view_kernel(self, keyset: Any, *args: Any, **kwargs: Any) -> Any:
        with torch._C._AutoDispatchBelowADInplaceOrView():
            out = self._opoverload.redispatch(
                keyset & torch._C._after_ADInplaceOrView_keyset, *args, **kwargs
            )
        full = self._sig.normalize(args, kwargs)
        mutated = []
        for name in self._mutates:
            a = full[self._sig.index[name]]
            if isinstance(a, torch.Tensor):
                mutated.append(a)
            elif isinstance(a, (list, tuple)):
                mutated.extend(t for t in a if isinstance(t, torch.Tensor))
        if mutated:
            torch.autograd.graph.increment_version(mutated)
        return out

    def _check_mutated_no_grad(self, args: tuple[Any, ...]) -> None:
        for name in self._mutates:
            a = args[self._sig.index[name]]
            items = a if isinstance(a, (list, tuple)) else [a]
            if any(isinstance(t, torch.Tensor) and t.requires_grad for t in items):
                raise MutationError(
                    f"{self.name}: argument {name!r} is in mutates_args and requires grad; "
                    f"customgrad does not differentiate through in-place mutation. Pass "
                    f"{name}.detach() or a buffer that does not require grad. "
                    f"(op defined at {where(self._fn)})"
                )

    def _direct_kernel(self, args: tuple[Any, ...]) -> Callable[..., Any] | None:
        """The kernel to call without the dispatcher, or None when the dispatcher must run.

        Used in eager mode below autograd: only for plain tensors on a device with a
        registered kernel, with no mode or transform active, and for ops that mutate nothing.
        """
        device = None
        for a in args:
            if isinstance(a, torch.Tensor):
                if type(a) not in _PLAIN_TYPES:
                    return None
                if device is None:
                    device = a.device.type
            elif isinstance(a, (list, tuple)):
                for t in a:
                    if isinstance(t, torch.Tensor):
                        if type(t) not in _PLAIN_TYPES:
                            return None
                        if device is None:
                            device = t.device.type
        return self._kernel_on(device)

    def _kernel_on(self, device: str | None) -> Callable[..., Any] | None:
        """The kernel for plain tensors on ``device``, or None when the dispatcher must run.

        The dispatcher runs for ops that mutate, while a mode, transform or profiler is active,
        and for meta tensors (they go to the fake kernel).
        """
        if device is None or device == "meta" or self._mutates or not _plain_dispatch():
            return None
        kernels = self._kernels
        return kernels.get(device) or kernels.get(None)

    def _kernel_for(self, args: tuple[Any, ...]) -> Callable[..., Any]:
        kernels = self._kernels
        if len(kernels) > 1 or None not in kernels:
            for a in args:
                t = a if isinstance(a, torch.Tensor) else None
                if t is None and isinstance(a, (list, tuple)) and a:
                    t = next((x for x in a if isinstance(x, torch.Tensor)), None)
                if t is not None:
                    k = kernels.get(t.device.type)
                    if k is not None:
                        return k
                    break
        k = kernels.get(None)
        if k is None:
            devices = ", ".join(sorted(d for d in kernels if d is not None)) or "none"
            raise MissingRegistrationError(
                f"{self.name}: no kernel for these inputs' device (kernels registered for: "
                f"{devices}). Add one with @{self.__name__}.register_kernel('<device>') or "
                f"register a kernel for all devices with register_kernel(None). "
                f"(op defined at {where(self._fn)})"
            )
        return k

    def _composite_kernel(self, *args: Any, **kwargs: Any) -> Any:
        kernel = self._kernels.get(None)
        if kernel is None:
            kernel = self._kernel_for(self._sig.normalize(args, kwargs))
        return kernel(*args, **kwargs)

    def _device_kernel(self, device_type: str) -> Callable[..., Any]:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            return self._kernels[device_type](*args, **kwargs)

        return kernel

    def _fake_kernel(self, *args: Any, **kwargs: Any) -> Any:
        fake = self._fake_fn
        if fake is None:
            raise MissingRegistrationError(
                f"{self.name}: no fake kernel registered; torch.compile, FakeTensorMode and "
                f"opcheck need one to know output shapes without running the op. Add:\n\n"
                f"    @{self.__name__}.register_fake\n"
                f"    def _({', '.join(self._sig.names)}):\n"
                f"        return <empty tensor(s) shaped like the output>\n\n"
                f"(op defined at {where(self._fn)})"
            )
        return fake(*args, **kwargs)

    def _missing_autograd_message(self) -> str:
        missing: list[str] = []
        if self._save_fn is None:
            missing.append("register_save_for_backward")
        if self._backward_fn is None:
            has_in = self._backward_input_fn is not None
            has_w = self._backward_weight_fn is not None
            if has_in and not has_w:
                missing.append("register_backward_weight")
            elif has_w and not has_in:
                missing.append("register_backward_input")
            elif not has_in and not has_w:
                missing.append("register_backward (or the register_backward_input/_weight pair)")
        return MSG_NO_AUTOGRAD.format(
            name=self.name,
            missing=f" (missing: {', '.join(missing)})" if missing else "",
            var=self.__name__,
            weights=", ".join(repr(w) for w in self.weights) or "the weights",
            loc=where(self._fn),
        )

    # -- registration ----------------------------------------------------------------------
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

        def register(f: F) -> F:
            types = _device_types(device_types)
            if types is None:
                self._kernels[None] = f
                return f
            for dt in types:
                key = _device_key(dt)
                self._kernels[dt] = f
                if key not in self._registered_keys:
                    self._lib.impl(self.name.split("::")[1], self._device_kernel(dt), key)
                    self._registered_keys.add(key)
            return f

        return register if fn is None else register(fn)

    def register_fake(self, fn: F) -> F:
        """Register the fake (meta) kernel: output tensors of the right shape, dtype and device."""
        self._fake_fn = fn
        return fn

    def register_save_for_backward(self, fn: F) -> F:
        """Register ``save_for_backward(inputs, output) -> pytree`` (inputs is a namedtuple)."""
        self._save_fn = fn
        return fn

    def register_backward(self, fn: F) -> F:
        """Register one backward returning ``{arg_name: grad}``; customgrad splits it per pass."""
        self._backward_fn = fn
        self._backward_input_fn = None
        self._backward_weight_fn = None
        return fn

    def register_backward_input(self, fn: F) -> F:
        """Register the input half: gradients of the non-weight arguments only."""
        self._backward_input_fn = fn
        self._backward_fn = None
        return fn

    def register_backward_weight(self, fn: F) -> F:
        """Register the weight half: gradients of the weight arguments only."""
        self._backward_weight_fn = fn
        self._backward_fn = None
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


def _lookup(name: str) -> CustomOp[..., Any]:
    return _OPS[name]


def _any_requires_grad(args: tuple[Any, ...]) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.requires_grad:
                return True
        elif isinstance(a, (list, tuple)) and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in a
        ):
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
) -> CustomOp[P, R] | Callable[[Callable[P, R]], CustomOp[P, R]]:
    """Declare a custom op from a type-annotated function.

    The schema is inferred from the annotations with ``torch.library.infer_schema``; ``fn``
    becomes the kernel for ``device_types`` (all devices when None). The op is a real
    dispatcher op: ``torch.ops.ns.name.default`` gives the same outputs and gradients.

    Args:
        name: ``"namespace::name"``; reserved namespaces (``aten``, ``torch``, ...) are refused.
        fn: the kernel. Omit it to use ``op`` as a decorator.
        weights: names of weight arguments (Tensor arguments whose gradients a zero-bubble
            schedule computes in the W pass).
        mutates_args: names of arguments the kernel writes to in place.
        device_types: device types ``fn`` serves, e.g. ``"cpu"`` or ``("cpu", "cuda")``.
        output_differentiability: one bool per output; False marks it non-differentiable.

    Returns:
        A :class:`CustomOp`, callable with ``fn``'s signature.

    Raises:
        DefinitionError: for an invalid name, ``weights`` or annotations.

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
        )

    if fn is None:
        return define
    return define(fn)
