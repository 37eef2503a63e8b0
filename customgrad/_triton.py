"""Raw Triton launches where tensors have no data: found in a traceback, explained by name.

``torch.compile`` (AOTAutograd) and customgrad's automatic split run a backward on fake
tensors. A Triton kernel launched directly from that backward (``kernel[grid](x, ...)``) reads
its arguments' data pointers, and torch answers with "Attempted to access the data pointer on
an invalid python storage", naming neither the op nor the kernel. :func:`raw_launch` finds the
launch in the error's traceback (the first frame inside Triton's runtime, and the user's frame
that called it); :func:`raise_if_raw_launch` turns the error into a :class:`UnsupportedError`
naming the op, the kernel and the fix. :func:`launch_in` finds a launch in a function's code
without running it (a function dynamo skips: ``torch.compiler.disable``). Triton is never
imported here.
"""

from __future__ import annotations

import contextlib
import dis
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from customgrad._errors import UnsupportedError, where

__all__ = [
    "FIX_RAW_LAUNCH",
    "MSG_RAW_LAUNCH",
    "RawLaunch",
    "function_named",
    "launch_in",
    "raise_if_raw_launch",
    "raw_launch",
]

_TRITON_RUNTIME = f"{os.sep}triton{os.sep}runtime{os.sep}"

MSG_RAW_LAUNCH = """\
{op}: {label} launches the Triton kernel {kernel} directly ({at}) on tensors without data: \
torch.compile traces the backward on fake tensors, which a raw launch cannot read. Make the \
kernel an op with a fake kernel and call the op from the backward, so the trace keeps it as \
one opaque call:

    @cg.op("mylib::my_kernel")                   # or torch.library.triton_op + wrap_triton
    def my_kernel(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        ...                                       # the launch: {kernel}[grid](...)
    @my_kernel.register_fake
    def _(x, weight):
        return torch.empty_like(x), torch.empty_like(weight)

({label} defined at {loc})"""


FIX_RAW_LAUNCH = (
    "make the launch an op with a fake kernel (torch.library.triton_op with wrap_triton, or a "
    "customgrad op with register_fake: docs/writing-ops/triton.md shows both) and call the op "
    "from the backward: the capture keeps it as one opaque call"
)
"""How a backward that launches a Triton kernel itself is made capturable."""


@dataclass(frozen=True)
class RawLaunch:
    """A Triton launch found in a traceback.

    Attributes:
        kernel: the kernel's name (``"_backward_kernel"``), or ``"(unknown)"``.
        at: ``file:line`` of the launch in the caller's code.
    """

    kernel: str
    at: str


_NO_DATA = (
    "data pointer",  # compiled Triton; torch's invalid python storage; FakeTensor's warning
    "data_ptr",
    'storage of a tensor on device "meta"',  # the interpreter copying a fake tensor to the host
)


def _data_pointer_error(e: BaseException) -> bool:
    text = str(e)
    return any(s in text for s in _NO_DATA)


def raw_launch(e: BaseException) -> RawLaunch | None:
    """The Triton launch that raised ``e`` for want of data, if ``e`` is such an error."""
    if not _data_pointer_error(e):
        return None
    tb = e.__traceback__
    caller = None
    while tb is not None:
        frame = tb.tb_frame
        if _TRITON_RUNTIME in frame.f_code.co_filename:
            owner = frame.f_locals.get("self")
            fn = getattr(owner, "fn", None)
            name = getattr(fn, "__name__", None) or getattr(owner, "__name__", None)
            at = (
                f"{caller.f_code.co_filename}:{caller.f_lineno}"
                if caller is not None
                else "unknown"
            )
            return RawLaunch(name if isinstance(name, str) else "(unknown)", at)
        caller = frame
        tb = tb.tb_next
    return None


def raise_if_raw_launch(
    e: BaseException, op: str, label: str, fn: Callable[..., object] | None
) -> None:
    """Raise :class:`UnsupportedError` (from ``e``) if ``e`` is a raw Triton launch's."""
    found = raw_launch(e)
    if found is not None:
        raise UnsupportedError(
            MSG_RAW_LAUNCH.format(
                op=op, label=label, kernel=found.kernel, at=found.at, loc=where(fn)
            )
        ) from e


def _is_kernel(value: object) -> bool:
    """Whether ``value`` is a Triton kernel (``@triton.jit``, autotuned, heuristics, or the
    interpreter's), by the module of its type."""
    return type(value).__module__.startswith("triton.runtime")


def launch_in(fn: object, depth: int = 3) -> RawLaunch | None:
    """The first Triton kernel ``fn``'s code launches, read from the code (the globals and
    closure variables it names), looking into the plain functions it calls (``depth`` deep)."""
    while hasattr(fn, "__wrapped__"):  # functools.wraps, torch.compiler.disable
        fn = fn.__wrapped__
    code = getattr(fn, "__code__", None)
    if code is None or depth <= 0:
        return None
    scope: dict[str, object] = dict(getattr(fn, "__globals__", {}))
    for var, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        with contextlib.suppress(ValueError):  # an empty cell
            scope[var] = cell.cell_contents
    line = code.co_firstlineno
    called: list[object] = []
    for ins in dis.get_instructions(code):
        number = getattr(ins, "line_number", None) or ins.starts_line  # 3.13: line_number
        if type(number) is int:
            line = number
        if ins.opname not in ("LOAD_GLOBAL", "LOAD_DEREF", "LOAD_NAME"):
            continue
        value = scope.get(str(ins.argval))
        if _is_kernel(value):
            return RawLaunch(str(ins.argval), f"{code.co_filename}:{line}")
        if callable(value) and hasattr(value, "__code__"):
            called.append(value)
    for callee in called:
        found = launch_in(callee, depth - 1)
        if found is not None:
            return found
    return None


def function_named(name: str, ident: int) -> object | None:
    """The function named ``name`` (a module's global, or a class's attribute ``A.b``) whose
    ``id`` is ``ident``, found in the modules loaded (read from their ``__dict__``: nothing
    runs), or None."""
    first, *rest = name.split(".")
    for module in list(sys.modules.values()):
        value: object = getattr(module, "__dict__", {}).get(first)
        for part in rest:
            member = getattr(value, "__dict__", {}).get(part)
            value = getattr(member, "__func__", member)  # a staticmethod's function
        if value is not None and id(value) == ident:
            return value
    return None
