"""dynamo (``torch._dynamo``): its import, backends and compiled modules.

Imported lazily (dynamo is large).

- :func:`load`: import ``torch._dynamo`` now (a first import inside a backward keeps that
  backward's frames alive);
- :func:`aot_autograd_type`: ``torch._dynamo.backends.common.AotAutograd``, what
  ``aot_autograd(...)`` makes;
- :func:`lookup_backend`: a registered backend by name;
- :func:`eager_backends`: ``aot_eager`` and ``boxed_nop`` (dynamo's debugging backends);
- :func:`optimized_module_type`: ``torch._dynamo.eval_frame.OptimizedModule``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "aot_autograd_type",
    "eager_backends",
    "load",
    "lookup_backend",
    "optimized_module_type",
]


def load() -> None:
    """Import ``torch._dynamo``."""
    import torch._dynamo  # noqa: F401


def aot_autograd_type() -> type[Any]:
    """``torch._dynamo.backends.common.AotAutograd``."""
    from torch._dynamo.backends.common import AotAutograd

    return AotAutograd


def lookup_backend(name: str) -> Any:
    """The backend registered as ``name`` (raises for an unknown one)."""
    from torch._dynamo.backends.registry import lookup_backend as lookup

    return lookup(name)


def eager_backends() -> tuple[Any, Any]:
    """``(aot_eager, boxed_nop)`` of ``torch._dynamo.backends.debugging``."""
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    return aot_eager, boxed_nop


def optimized_module_type() -> type[Any]:
    """``torch._dynamo.eval_frame.OptimizedModule`` (what ``torch.compile(module)`` returns)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return OptimizedModule
