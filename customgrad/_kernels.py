"""An op's kernels: the table by device type and the fake kernel, how a direct call runs
(the one dispatch decision), and the check of what a kernel returns.

customgrad registers one backend kernel per op (``CompositeExplicitAutograd``), which picks
the op's kernel from :class:`Kernels` by device. A kernel or autocast rule registered for the op
through ``torch.library`` by anyone else shows in ``torch.library``'s registrations under the
device's keys (:class:`ForeignKeys`): the direct call then lets the dispatcher run it. Otherwise
the direct call runs the kernel itself when nothing but the backend kernel would see a
dispatcher call. :meth:`Kernels.route` makes that decision, for the general call
(``CustomOp.__call__``) and the generated fast path alike; every kernel's return is checked the
same way (:meth:`Kernels.checked_output`), whichever path ran it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from customgrad._errors import (
    DefinitionError,
    KernelOutputError,
    MissingRegistrationError,
    MutationError,
    where,
)
from customgrad._signature import ArgKind, Signature
from customgrad._torch import dispatcher

__all__ = [
    "DISPATCH",
    "Dispatch",
    "IMPLS",
    "Kernel",
    "MSG_KERNEL_MUTATED",
    "ForeignKeys",
    "Kernels",
    "device_types",
    "dispatch_key",
    "first_tensor",
    "version_of",
]

_Tensor = torch.Tensor
_intercepted = dispatcher.intercepted
_alias_check = dispatcher.alias_check

Kernel = Callable[..., object]
"""A kernel: the op's function for a device, called with the op's arguments."""


class Dispatch(enum.Enum):
    """What :meth:`Kernels.route` returns when the whole call must go through the dispatcher."""

    DISPATCH = "dispatch"


DISPATCH: Final = Dispatch.DISPATCH


MSG_KERNEL_MUTATED = """\
{op}: the kernel wrote into argument {arg!r} in place (its version went from {before} to \
{after}), but {name!r} is not in mutates_args. Autograd and the backward read {name!r} as it was \
before the call, so every gradient that depends on it would be silently wrong. Compute out of \
place, on a copy:

    {name} = {name}.clone()      # first line of the kernel; then write into the copy

or declare the write (then {name!r} must not require grad):

    @cg.op({qualname!r}, mutates_args=({name!r},))

(kernel defined at {loc})"""


def version_of(t: object) -> int | None:
    """The version counter of a tensor (None for anything else, and for an inference tensor,
    which keeps none). In-place torch ops bump it; a Triton kernel's stores do not."""
    if isinstance(t, _Tensor) and not t.is_inference():
        return t._version
    return None


def first_tensor(args: tuple[object, ...]) -> torch.Tensor | None:
    """The first tensor among ``args`` (list items included): its device picks the kernel."""
    for a in args:
        if isinstance(a, _Tensor):
            return a
        if isinstance(a, (list, tuple)):
            t = next((x for x in a if isinstance(x, _Tensor)), None)
            if t is not None:
                return t
    return None


def device_types(device_types: str | Sequence[str] | None) -> tuple[str, ...] | None:
    if device_types is None:
        return None
    if isinstance(device_types, str):
        return (device_types,)
    return tuple(device_types)


def dispatch_key(qualname: str, device_type: object) -> str:
    """The dispatch key of ``device_type`` ("cpu" → "CPU"), or a DefinitionError."""
    fix = (
        'Use a device type as torch.device names it, lowercase and without an index: "cpu", '
        '"cuda", "xpu", "mps", ... (or None for every device).'
    )
    if not isinstance(device_type, str) or ":" in device_type:
        raise DefinitionError(f"{qualname}: invalid device type {device_type!r}. {fix}")
    try:
        return dispatcher.dispatch_key_for_device(device_type)
    except (RuntimeError, ValueError):
        raise DefinitionError(f"{qualname}: unknown device type {device_type!r}. {fix}") from None


IMPLS = dispatcher.library_impls()
"""torch.library's registrations (a live set), or None when this torch keeps none."""


class ForeignKeys(dict[str, tuple[str, str]]):
    """Per device type, the ``torch.library`` registration keys of kernels that would run
    instead of customgrad's own: the device's backend key and its autocast key."""

    def __init__(self, qualname: str) -> None:
        super().__init__()
        self.prefix = qualname.replace("::", "/") + "/"
        # read without a dict lookup (``tensor.device.type`` alone costs more than the check)
        self.cpu = self["cpu"]
        self.cuda = self["cuda"]

    def __missing__(self, device_type: str) -> tuple[str, str]:
        key = dispatcher.dispatch_key_for_device(device_type)
        keys = self[device_type] = (self.prefix + key, f"{self.prefix}Autocast{key}")
        return keys


class Kernels:
    """The op's kernels by device type (``None``: the kernel for every device) and its fake
    kernel; which kernel a direct call runs, and the check of what a kernel returns.

    Args:
        sig: the op's signature (its name and function name the op in messages).
        var: the op's name as a Python variable, for the fixes messages show.
        mutates: the arguments the op declares it writes into (``mutates_args``; then every
            call goes through the dispatcher, whose ``ADInplaceOrView`` kernel records the
            writes). Every other Tensor argument is watched: a kernel that writes into one
            raises :class:`~customgrad.MutationError` (:meth:`run`).
        write_run: writes :attr:`run` for these kernels
            (:func:`customgrad._codegen.write_kernel_run`, passed in: the code writer reads
            this module, not the other way round).
    """

    def __init__(
        self,
        sig: Signature,
        var: str,
        mutates: Sequence[str],
        write_run: Callable[[Kernels], Callable[[Kernel, tuple[object, ...]], object]],
    ) -> None:
        self.sig = sig
        self.qualname = sig.qualname
        self.var = var
        self.fn = sig.fn
        self.mutates = bool(mutates)
        self.watched: tuple[int, ...] = tuple(
            i
            for i, (name, kind) in enumerate(zip(sig.names, sig.kinds))
            if kind is not ArgKind.OTHER and name not in mutates
        )
        """The arguments (indices) whose tensors a kernel must not write into."""
        self.run: Callable[[Kernel, tuple[Any, ...]], Any] = write_run(self)
        """``run(kernel, args)``: call ``kernel`` on schema-ordered ``args`` and return what it
        returns; a write into an argument that is not in ``mutates_args`` raises
        (:meth:`raise_if_mutated`). Every call of a kernel goes through it (the written forward
        reads the same version counters inline). Written for the op's arguments
        (:func:`customgrad._codegen.write_kernel_run`); :meth:`run_any` is its interpreted twin."""
        self.by_device: dict[str | None, Kernel] = {}
        self.fake: Callable[..., Any] | None = None
        """The fake kernel (``register_fake``), or None."""
        self.flops: Callable[..., int] | None = None
        """The kernel's FLOPs from its arguments (``register_flops``), or None: then FLOP
        counters count the torch ops it runs (:class:`customgrad._flops.OpFlops`)."""
        self.foreign_keys = ForeignKeys(sig.qualname)

    def for_device(self, device_type: str) -> Kernel | None:
        by = self.by_device
        return by.get(device_type) or by.get(None)

    def kernel_for(self, first: torch.Tensor | None) -> Kernel:
        """The kernel for the device of ``first`` (the call's first tensor), or an error."""
        k = self.for_device(first.device.type) if first is not None else self.by_device.get(None)
        if k is None:
            by = self.by_device
            devices = ", ".join(sorted(d for d in by if d is not None)) or "none"
            raise MissingRegistrationError(
                f"{self.qualname}: no kernel for these inputs' device (kernels registered for: "
                f"{devices}). Add one with @{self.var}.register_kernel('<device>') or "
                f"register a kernel for all devices with register_kernel(None). "
                f"(op defined at {where(self.fn)})"
            )
        return k

    def versions(self, args: tuple[object, ...]) -> list[int | None]:
        """The version counters of the watched arguments' tensors (list items inline)."""
        out: list[int | None] = []
        for i in self.watched:
            a = args[i]
            if isinstance(a, (list, tuple)):
                out.extend(map(version_of, a))
            else:
                out.append(version_of(a))
        return out

    def run_any(self, kernel: Kernel, args: tuple[object, ...]) -> object:
        """:attr:`run`, interpreted: also for tensors without a version counter (inference
        tensors, which it skips)."""
        before = self.versions(args)
        out = self.sig.call(kernel, args) if self.sig.kwonly_names else kernel(*args)
        if self.versions(args) != before:
            self.raise_if_mutated(args, before)
        return out

    def raise_if_mutated(self, args: tuple[object, ...], before: Sequence[int | None]) -> None:
        """Raise :class:`~customgrad.MutationError` for the first watched tensor whose version
        moved since ``before`` (:meth:`versions`, read before the kernel ran)."""
        names = self.sig.names
        it = iter(before)
        for i in self.watched:
            a = args[i]
            items = list(enumerate(a)) if isinstance(a, (list, tuple)) else [(None, a)]
            for k, t in items:
                was = next(it, None)
                now = version_of(t)
                if was is not None and now != was:
                    raise MutationError(
                        MSG_KERNEL_MUTATED.format(
                            op=self.qualname,
                            arg=names[i] if k is None else f"{names[i]}[{k}]",
                            name=names[i],
                            before=was,
                            after=now,
                            qualname=self.qualname,
                            loc=where(self.fn),
                        )
                    )

    def route(self, first: torch.Tensor | None, plain: bool) -> Kernel | Dispatch | None:
        """How a direct call of the op runs: the one dispatch decision, made for every call
        that does not start in the dispatcher (``CustomOp.__call__`` and the fast path).

        Args:
            first: the first tensor argument (its device picks the kernel), or None.
            plain: whether every tensor argument is a plain ``Tensor`` or ``Parameter``.

        Returns:
            :data:`DISPATCH` when a kernel or autocast rule that customgrad did not register
            would run for the call's device (``register_kernel``, ``register_autocast``,
            ``Library.impl`` through ``torch.library``; customgrad registers only its backend
            kernel, ``CompositeExplicitAutograd``, and its Autograd kernel), or when this torch
            does not keep those registrations: the dispatcher then runs the whole call, as for
            ``torch.ops``. Else the kernel to call directly when nothing but it would see a
            dispatcher call made now: plain tensors, not meta ones (they go to the fake kernel),
            an op that mutates nothing (the dispatcher's ``ADInplaceOrView`` kernel records
            writes), no mode, transform or profiler. Else None: the kernel runs through the
            dispatcher, below autograd.
        """
        if first is None:
            return None
        impls = IMPLS
        if impls is None:
            return DISPATCH
        keys = self.foreign_keys
        if not impls.isdisjoint(
            # read without a dict lookup for the usual devices (``device.type`` costs more)
            keys.cpu if first.is_cpu else keys.cuda if first.is_cuda else keys[first.device.type]
        ):
            return DISPATCH
        if not plain or self.mutates or first.is_meta or _intercepted():
            return None
        by_device = self.by_device
        if len(by_device) == 1 and None in by_device:
            return by_device[None]
        return self.kernel_for(first)

    def checked_output(
        self, args: tuple[object, ...], out: object
    ) -> tuple[object, tuple[object, ...]]:
        """Check the kernel's return against the schema and refuse outputs that alias inputs:
        ``(outputs as the op returns them, residuals)``."""
        sig = self.sig
        if type(out) is _Tensor and not sig.kernel_output_is_tuple:
            public: Any = out
            residuals: tuple[Any, ...] = ()
            outs: tuple[Any, ...] = (out,)
        else:
            public, residuals = sig.split_outputs(out, args)
            if out is None:
                return public, residuals
            # split_outputs checked the kinds: a tuple or list when the kernel returns several
            outs = (
                tuple(out)
                if isinstance(out, (tuple, list)) and sig.kernel_output_is_tuple
                else (out,)
            )
        if _alias_check(args, {}, outs):
            raise KernelOutputError(
                f"{self.qualname}: the kernel returned a Tensor that is (a view of) one of its "
                f"inputs or of another output. Custom ops must return new tensors (as "
                f"torch.library.custom_op requires); under torch.compile an alias would give "
                f"different results. Return a copy (x.clone()), or leave the op out of the "
                f"aliasing part. (kernel defined at {where(self.fn)})"
            )
        return public, residuals
