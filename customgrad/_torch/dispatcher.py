"""The dispatcher and ``torch.library``: op overload types, dispatch keys and guards, the
registrations ``torch.library`` keeps, schema parsing, and what would see a dispatcher call now
(modes, transforms, the profiler) or change what it computes (autocast, determinism).

Looked up once at import. Where torch lacks a name the fallback sends every call through the
dispatcher (the general answer), never around it: :func:`library_impls` gives None, and
:func:`intercepted` answers True.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Set
from typing import Any

import torch
import torch.autograd.profiler as _profiler
import torch.library
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket
from torch._ops import _OpNamespace as OpNamespace
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
)
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes

from customgrad._torch.transforms import functorch_active

__all__ = [
    "AFTER_AD_INPLACE_OR_VIEW",
    "active_flop_tables",
    "flops_uncounted",
    "DispatchKeySet",
    "INFRA_MODES",
    "HigherOrderOperator",
    "OpNamespace",
    "OpOverload",
    "OpOverloadPacket",
    "TorchDispatchMode",
    "alias_check",
    "any_autocast_enabled",
    "aten_callables",
    "below_ad_inplace_or_view",
    "below_autograd",
    "deterministic",
    "deterministic_warn_only",
    "destroy_library",
    "disable_current_modes",
    "dispatch_key_for_device",
    "dispatch_stack_len",
    "function_mode_enabled",
    "function_stack_len",
    "get_dispatch_mode",
    "intercepted",
    "is_alias_of",
    "is_traceable_wrapper_subclass",
    "library_impls",
    "overload_name",
    "parse_schema",
    "schema_of",
    "profiler_enabled",
]

# -- guards: run a kernel below a dispatch key ----------------------------------------------
below_autograd: Callable[[], Any] = torch._C._AutoDispatchBelowAutograd
"""A guard (``with below_autograd():``) under which calls skip the Autograd keys."""
below_ad_inplace_or_view: Callable[[], Any] = torch._C._AutoDispatchBelowADInplaceOrView
"""A guard under which calls skip Autograd and ``ADInplaceOrView``."""
DispatchKeySet = torch._C.DispatchKeySet
"""The dispatcher's set of keys (what an ``ADInplaceOrView`` kernel registered with
``with_keyset=True`` receives first)."""
AFTER_AD_INPLACE_OR_VIEW: DispatchKeySet = torch._C._after_ADInplaceOrView_keyset
"""The keys below ``ADInplaceOrView`` (``keyset & AFTER_AD_INPLACE_OR_VIEW`` to redispatch)."""


def dispatch_key_for_device(device_type: str) -> str:
    """The backend dispatch key of ``device_type`` ("cpu" → "CPU"); raises RuntimeError or
    ValueError for an unknown device type."""
    return str(torch._C._dispatch_key_for_device(device_type))


parse_schema: Callable[[str], Any] = torch._C.parse_schema
"""Parse ``"name(args) -> outs"`` into a ``FunctionSchema`` (RuntimeError when it can't)."""


def schema_of(op: OpOverload) -> torch._C.FunctionSchema:
    """The ``FunctionSchema`` of an op overload (``OpOverload._schema``: its ``name``,
    ``arguments``, ``is_mutable``, ...)."""
    return op._schema


def overload_name(op: OpOverload) -> str:
    """The overload's name (``"default"``, ``"Tensor"``, ...: ``OpOverload._overloadname``)."""
    return op._overloadname


# -- torch.library's registrations ----------------------------------------------------------
_impls: Any = getattr(torch.library, "_impls", None)
_IMPLS: Set[str] | None = _impls if isinstance(_impls, set) else None


def library_impls() -> Set[str] | None:
    """The ``"ns/op/DispatchKey"`` of every kernel registered through ``torch.library``
    (``torch.library._impls``, a live set: read it at each call), or None when this torch does
    not keep one (then the dispatcher decides every call)."""
    return _IMPLS


def destroy_library(lib: torch.library.Library) -> None:
    """Remove ``lib``'s definitions and registrations (``Library._destroy``), for good: the
    library's finalizer, when it is collected, would clear ``torch.ops``' cache of its names
    again and forget them as defined, by then a redefinition's (whose ``torch.ops.ns.name``
    would change identity, out of FLOP counters' tables). Its names are forgotten now
    (``Library._op_defs``, which the finalizer reads)."""
    lib._destroy()
    lib._op_defs.clear()


# -- what would see a dispatcher call made now ----------------------------------------------
dispatch_stack_len: Callable[[], int] = torch._C._len_torch_dispatch_stack
"""How many ``TorchDispatchMode``s are on the stack."""
function_mode_enabled: Callable[[], bool] = torch._C._is_torch_function_mode_enabled
"""Whether a ``TorchFunctionMode`` is active."""
function_stack_len: Callable[[], int] = torch._C._len_torch_function_stack
"""How many ``TorchFunctionMode``s are on the stack."""
get_dispatch_mode: Callable[[Any], Any] = torch._C._get_dispatch_mode
"""The infrastructure mode (fake, proxy, functional) active under a ``_TorchDispatchModeKey``."""
INFRA_MODES: tuple[Any, ...] = tuple(torch._C._TorchDispatchModeKey.__members__.values())
"""The keys of torch's infrastructure modes (fake, proxy, functional)."""


def active_flop_tables() -> list[dict[Any, Any]]:
    """The formula tables of the ``torch.utils.flop_counter.FlopCounterMode``\\ s running on
    this thread (each copies torch's table when it is made; its dispatch mode,
    ``_FlopCounterMode``, is on the mode stack while it counts), innermost last."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    from torch.utils.flop_counter import _FlopCounterMode

    return [
        mode.counter.flop_registry
        for mode in _get_current_dispatch_mode_stack()
        if isinstance(mode, _FlopCounterMode)
    ]


@contextlib.contextmanager
def flops_uncounted() -> Iterator[None]:
    """Run a block the ``FlopCounterMode``\\ s on this thread do not count (torch's own work, such
    as a pipeline stage's shape inference): their counts are put back as they were after it,
    as ``FlopCounterMode`` does for the branch of a ``cond`` it does not take."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    from torch.utils.flop_counter import _FlopCounterMode

    counts = [
        mode.counter.flop_counts
        for mode in _get_current_dispatch_mode_stack()
        if isinstance(mode, _FlopCounterMode)
    ]
    before = [{module: dict(by_op) for module, by_op in c.items()} for c in counts]
    try:
        yield
    finally:
        for c, was in zip(counts, before):
            c.clear()
            for module, by_op in was.items():
                c[module].update(by_op)


def profiler_enabled() -> bool:
    """Whether ``torch.profiler``/``torch.autograd.profiler`` records now."""
    return bool(_profiler._is_profiler_enabled)


def intercepted() -> bool:
    """Whether anything besides an op's kernels would see a dispatcher call made now: a
    dispatch or function mode, a functorch transform, the profiler. Calling a kernel directly
    gives exactly what the dispatcher would only when this is False."""
    return bool(
        _profiler._is_profiler_enabled
        or dispatch_stack_len()
        or function_mode_enabled()
        or functorch_active()
    )


# -- ambient state a kernel's result depends on ---------------------------------------------
any_autocast_enabled: Callable[[], bool] = torch._C._is_any_autocast_enabled
"""Whether autocast is on for any device type."""
deterministic: Callable[[], bool] = torch._C._get_deterministic_algorithms
"""``torch.are_deterministic_algorithms_enabled()`` without the Python wrapper."""
deterministic_warn_only: Callable[[], bool] = torch._C._get_deterministic_algorithms_warn_only
"""``torch.is_deterministic_algorithms_warn_only_enabled()`` without the Python wrapper."""


# -- aliasing --------------------------------------------------------------------------------
def _no_alias_check(args: Any, kwargs: Any, outputs: Any) -> bool:
    """The alias check's fallback on a torch without it: no alias is seen."""
    return False


alias_check: Callable[..., bool] = getattr(
    torch._C, "_any_output_is_alias_to_input_or_output", _no_alias_check
)
"""``(args, kwargs, outputs) -> bool``: whether an output aliases an input or another output
(the check ``torch.library.custom_op`` makes); on a torch without it, always False."""
is_alias_of: Callable[[torch.Tensor, torch.Tensor], bool] = torch._C._is_alias_of  # type: ignore[attr-defined]
"""Whether two tensors share storage."""


def aten_callables(name: str) -> tuple[Any, Any]:
    """The ``torch`` function and the ``Tensor`` method named ``name`` (None when absent),
    looked up on their C bindings (``torch._C._VariableFunctions``, ``torch._C.TensorBase``)."""
    return (
        getattr(torch._C._VariableFunctions, name, None),
        getattr(torch._C.TensorBase, name, None),
    )
