"""``customgrad.op``: declare a custom op, call it, and the registry of ops by name.

:class:`CustomOp` is the object ``cg.op`` returns. Its call (:meth:`CustomOp.__call__`) checks
the arguments once and asks :meth:`~customgrad._kernels.Kernels.route` (the one dispatch
decision) how to run: through the dispatcher when
something else would run (a kernel or autocast rule registered through ``torch.library``), else
the op's kernel directly (or below autograd under a mode, transform or profiler), through its
autograd node when gradients are needed; under ``torch.compile`` the dispatcher runs it. The op's other parts live beside it: its ``torch.library`` definition
and dispatcher kernels (:mod:`customgrad._dispatch`), its kernel table (:mod:`customgrad._kernels`),
its ``register_*`` methods (:mod:`customgrad._registration`, inherited) and its autograd
(:mod:`customgrad._autograd`). A name defined again replaces the op (``_ReplacedOp``), as
torch's ``custom_op`` does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar, overload

import torch
from typing_extensions import ParamSpec

from customgrad._autograd import AutogradImpl
from customgrad._codegen import write_kernel_run
from customgrad._dispatch import OpLibrary, has_tangent
from customgrad._errors import MissingRegistrationError, MutationError, where
from customgrad._kernels import DISPATCH as _DISPATCH
from customgrad._kernels import Kernel, Kernels, dispatch_key
from customgrad._kernels import device_types as _device_types
from customgrad._messages import missing_autograd_message
from customgrad._registration import OpRegistration
from customgrad._rules import (
    AutogradRules,
    BackwardFn,
    JvpFn,
    SaveForBackwardFn,
    SharedFn,
)
from customgrad._signature import ArgKind, Signature, make_schema, parse_name
from customgrad._torch import dispatcher, dynamo
from customgrad._torch.transforms import forward_ad_level as _forward_ad_level

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
_below_autograd = dispatcher.below_autograd
_Tensor = torch.Tensor
# Plain tensors a kernel may be called with directly (Parameter adds no torch_function/dispatch).
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_Parameter = torch.nn.Parameter
_grad_enabled = torch.is_grad_enabled
# dynamo.tracing, not torch.compiler.is_compiling(): a capture refuses a backward that reads that
_is_compiling = dynamo.tracing
_TENSOR = ArgKind.TENSOR
_OPTIONAL = ArgKind.OPTIONAL_TENSOR
_LIST = ArgKind.TENSOR_LIST
_OTHER = ArgKind.OTHER


class CustomOp(OpRegistration, Generic[P, R]):
    """A custom op: a real dispatcher op (``torch.ops.ns.name.default``) with split autograd.

    Create one with :func:`customgrad.op`. Calling it runs the op: under autograd it records a
    customgrad node whose backward is the registered ``backward`` (or the input/weight pair),
    validated on every call.

    Attributes:
        name: ``"ns::name"``.
        opoverload: the ``OpOverload`` (``torch.ops.ns.name.default``).
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
        _, opname = parse_name(name)  # refuses an invalid name
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
        self._plain_grad_call = not mutates and bool(self._sig.output_kinds)
        """Whether a call with grad needed goes straight to ``AutogradImpl.apply`` (what
        :meth:`_run_call` does for it; ``__call__`` skips that frame)."""
        self._var = opname
        self._kernels = Kernels(self._sig, opname, mutates, write_kernel_run)
        self.signature: Signature = self._sig
        """Arguments, outputs, weights and residuals of the op."""
        self.rules = AutogradRules()
        """The current autograd registrations (read-only: use the ``register_*`` methods)."""
        self._impl = AutogradImpl(self)

        old = _OPS.get(name)
        if old is not None:
            # A redefinition (a notebook cell run again): replace the old op, as torch's
            # custom_op does. Its nodes in existing graphs keep their backward.
            old._retire(self)
        self._library = OpLibrary(self, self.schema, kernel_schema)
        self.opoverload: dispatcher.OpOverload = self._library.opoverload
        self._register_kernel(types, fn)
        _OPS[name] = self
        self.__name__ = opname
        self.__qualname__ = opname
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__wrapped__ = fn

    def _retire(self, new: CustomOp[..., Any]) -> None:
        """Give the name to ``new``: remove this op's registrations; calling it raises."""
        self._library.destroy()
        self._replaced_by = new
        self.__class__ = _ReplacedOp

    # -- what customgrad's autograd reads (customgrad._rules.OpSpec) --------------------------
    def _run_kernel(
        self, args: tuple[Any, ...], kernel: Kernel | None
    ) -> tuple[Any, tuple[Any, ...]]:
        """Run the kernel below autograd: ``(outputs as the op returns them, residuals)``."""
        if kernel is None:
            with _below_autograd():
                out = self._sig.call(self._library.kernel_overload, args)
        else:
            out = self._kernels.run(kernel, args)
        return self._kernels.checked_output(args, out)

    def _missing_autograd_message(self) -> str:
        return missing_autograd_message(self._sig, self.rules, self._var, self._fn)

    # -- calling ---------------------------------------------------------------------------
    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
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
        if sig.tensors_only:  # the same checks, for Tensor and Optional[Tensor] arguments
            for a in args:
                if type(a) is _Tensor or type(a) is _Parameter:
                    if first is None:
                        first = a
                    if a.requires_grad:
                        requires = True
                elif isinstance(a, _Tensor):
                    plain = False
                    if first is None:
                        first = a
                    if a.requires_grad:
                        requires = True
                elif a is not None:
                    sig.check_args(args)  # raises, naming the argument
            for i in sig.required_tensors:
                if args[i] is None:
                    sig.check_args(args)  # None only where the argument is Optional
            requires = requires and _grad_enabled()
        else:
            grad = _grad_enabled()
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
        kernel = self._kernels.route(first, plain)
        if kernel is _DISPATCH:
            # A kernel or autocast rule registered through torch.library would run: let the
            # dispatcher run it, exactly as for torch.ops (its Autograd kernel is customgrad's,
            # which ends in _run_call as this call does).
            return sig.call(self.opoverload, args)  # type: ignore[no-any-return]
        if requires and self._plain_grad_call:
            # _run_call's first branch, without its frame (the commonest call: grad mode, an
            # argument requiring grad, nothing mutated)
            return self._impl.apply(args, kernel)  # type: ignore[return-value]
        return self._run_call(args, kernel, requires)  # type: ignore[return-value]

    def _run_call(self, args: tuple[object, ...], kernel: Kernel | None, requires: bool) -> object:
        """Run a call whose kernel is decided: the one door of the direct call and of the
        dispatcher's Autograd kernel (:meth:`customgrad._dispatch.OpLibrary.autograd`).

        Args:
            args: schema-ordered arguments, checked.
            kernel: the kernel to call directly (:meth:`Kernels.route`), or None to call it
                through the dispatcher, below autograd.
            requires: whether grad mode is on and a tensor argument requires grad.
        """
        if self._mutated_idx:
            self._check_mutated_no_grad(args)
        sig = self._sig
        if requires and sig.output_kinds:
            return self._impl.apply(args, kernel)
        if _forward_ad_level() >= 0 and has_tangent(args):
            return self._forward_ad(args, kernel)
        if kernel is not None:
            kernels = self._kernels
            return kernels.checked_output(args, kernels.run(kernel, args))[0]
        with _below_autograd():
            return sig.call(self.opoverload, args)

    def _forward_ad(self, args: tuple[Any, ...], kernel: Kernel | None) -> Any:
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

    # -- identity --------------------------------------------------------------------------
    def __deepcopy__(self, memo: dict[int, object]) -> CustomOp[P, R]:
        return self

    def __copy__(self) -> CustomOp[P, R]:
        return self

    def __reduce__(self) -> tuple[Callable[[str], CustomOp[..., object]], tuple[str]]:
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

    _replaced_by: CustomOp[..., object]

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

    def register_flops(self, fn: F) -> F:
        raise self._replaced()


def registered_ops() -> list[CustomOp[..., object]]:
    """Every customgrad op defined in this process (the current definition of each name)."""
    return [op for op in _OPS.values() if type(op) is not _ReplacedOp]


def autograd_impl(op: CustomOp[..., R]) -> AutogradImpl:
    """The autograd implementation of ``op`` (for customgrad's tools: ``check_op``)."""
    return op._impl


def _lookup(name: str) -> CustomOp[..., object]:
    op = _OPS.get(name)
    if op is None:
        raise MissingRegistrationError(
            f"customgrad op {name!r} is not defined in this process, so it cannot be "
            f"unpickled. Import the module that defines it (its cg.op({name!r}, ...)) before "
            f"unpickling, e.g. in each worker process."
        )
    return op


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
