"""An op's kernels: the table by device type, and which kernel the dispatcher would run.

customgrad registers one backend kernel per op (``CompositeExplicitAutograd``), which picks
the op's kernel from :class:`Kernels` by device. A kernel or autocast rule registered for the op
through ``torch.library`` by anyone else shows in ``torch.library``'s registrations under the
device's keys (:class:`ForeignKeys`): the direct call then lets the dispatcher run it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from customgrad._errors import DefinitionError, MissingRegistrationError, where
from customgrad._torch_internals import library_impls

__all__ = ["IMPLS", "ForeignKeys", "Kernels", "device_types", "dispatch_key"]

_Tensor = torch.Tensor


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
        key = torch._C._dispatch_key_for_device(device_type)
    except (RuntimeError, ValueError):
        raise DefinitionError(f"{qualname}: unknown device type {device_type!r}. {fix}") from None
    return str(key)


IMPLS = library_impls()
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
        key = str(torch._C._dispatch_key_for_device(device_type))
        keys = self[device_type] = (self.prefix + key, f"{self.prefix}Autocast{key}")
        return keys


class Kernels:
    """The op's kernels by device type (``None``: the kernel for every device)."""

    def __init__(self, qualname: str, var: str, fn: Callable[..., Any]) -> None:
        self.qualname = qualname
        self.var = var
        self.fn = fn
        self.by_device: dict[str | None, Callable[..., Any]] = {}

    def for_device(self, device_type: str) -> Callable[..., Any] | None:
        by = self.by_device
        return by.get(device_type) or by.get(None)

    def for_args(self, args: tuple[Any, ...]) -> Callable[..., Any]:
        """The kernel for the device of the first tensor in ``args``, or an error."""
        by = self.by_device
        if len(by) > 1 or None not in by:
            for a in args:
                t = a if isinstance(a, _Tensor) else None
                if t is None and isinstance(a, (list, tuple)):
                    t = next((x for x in a if isinstance(x, _Tensor)), None)
                if t is not None:
                    k = by.get(t.device.type)
                    if k is not None:
                        return k
                    break
        k = by.get(None)
        if k is None:
            devices = ", ".join(sorted(d for d in by if d is not None)) or "none"
            raise MissingRegistrationError(
                f"{self.qualname}: no kernel for these inputs' device (kernels registered for: "
                f"{devices}). Add one with @{self.var}.register_kernel('<device>') or "
                f"register a kernel for all devices with register_kernel(None). "
                f"(op defined at {where(self.fn)})"
            )
        return k
