"""AOTAutograd and inductor (``torch._functorch``, ``torch._inductor``, ``torch._guards``):
what a split-aware compile backend reads and sets while compiling.

Imported lazily.

- :func:`config_patch`: ``torch._functorch.config.patch(**changes)`` (e.g.
  ``donated_buffer=False``, ``enable_autograd_cache=False``);
- :func:`tracing_metadata`: the ``fw_metadata`` of the running trace
  (``torch._guards.TracingContext.try_get().fw_metadata``), or None;
- :func:`inductor_compilers`: ``(compile_fx, compile_fx_inner)`` of
  ``torch._inductor.compile_fx``;
- :func:`compiled_backward`: the compiled backward a ``CompiledFunctionBackward`` node runs
  (``node._forward_cls.compiled_bw``, set at its first backward), or None;
- :func:`is_tangent`: whether a placeholder of a backward graph is an output gradient
  (AOTAutograd's own ``partitioners._is_tangent``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from customgrad._torch.functions import forward_cls

__all__ = [
    "compiled_backward",
    "config_patch",
    "inductor_compilers",
    "is_tangent",
    "tracing_metadata",
]


def config_patch(**changes: Any) -> AbstractContextManager[Any]:
    """AOTAutograd's configuration changed inside a ``with`` block."""
    import torch._functorch.config

    patch: AbstractContextManager[Any] = torch._functorch.config.patch(**changes)
    return patch


def tracing_metadata() -> Any:
    """The ``ViewAndMutationMeta`` of the graph AOTAutograd traces now, or None."""
    import torch._guards

    ctx = torch._guards.TracingContext.try_get()
    return getattr(ctx, "fw_metadata", None)


def inductor_compilers() -> tuple[Any, Any]:
    """``(compile_fx, compile_fx_inner)``: inductor's graph compiler and its inner compiler."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    return compile_fx, compile_fx_inner


def compiled_backward(node: Any) -> Any:
    """The backward AOTAutograd compiled for the region whose backward ``node`` runs (its
    Function's ``compiled_bw``, possibly wrapped), or None (not compiled yet, another node)."""
    return getattr(forward_cls(node), "compiled_bw", None)


def is_tangent(node: Any) -> bool:
    """Whether ``node``, a placeholder of an AOTAutograd backward graph, is an output gradient
    (``torch._functorch.partitioners._is_tangent``; its naming rule where torch lacks it)."""
    try:
        from torch._functorch.partitioners import _is_tangent  # type: ignore[attr-defined]
    except ImportError:  # pragma: no cover - another torch
        return bool(node.op == "placeholder" and str(node.target).startswith("tangents"))
    return bool(_is_tangent(node))
