"""dynamo (``torch._dynamo``): its import, backends and compiled modules.

Imported lazily (dynamo is large).

- :func:`load`: import ``torch._dynamo`` now (a first import inside a backward keeps that
  backward's frames alive);
- :func:`aot_autograd_type`: ``torch._dynamo.backends.common.AotAutograd``, what
  ``aot_autograd(...)`` makes;
- :func:`lookup_backend`: a registered backend by name;
- :func:`eager_backends`: ``aot_eager`` and ``boxed_nop`` (dynamo's debugging backends);
- :func:`optimized_module_type`: ``torch._dynamo.eval_frame.OptimizedModule``;
- :func:`compile_options`: the ``torch.compile`` options a compiled function or module was made
  with (read from dynamo's context);
- :func:`compiling_locals`: the locals of the frame dynamo compiles now;
- :func:`compiled_call`, :func:`set_compiled_call`: the compiled ``_call_impl`` that
  ``nn.Module.compile`` installs (``module._compiled_call_impl``);
- :func:`inductor_config`: the inductor config ``torch.compile(mode=, options=)`` gives
  (``torch._TorchCompileInductorWrapper``);
- :func:`compiled_autograd_on`: whether compiled autograd is on (it runs AOTAutograd's
  backward graphs itself).
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = [
    "aot_autograd_type",
    "compile_options",
    "compiled_call",
    "compiled_autograd_on",
    "compiling_locals",
    "eager_backends",
    "inductor_config",
    "load",
    "lookup_backend",
    "optimized_module_type",
    "set_compiled_call",
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


def compile_options(compiled: Any) -> dict[str, Any] | None:
    """The ``torch.compile`` keyword arguments (``backend``, ``options``, ``dynamic``,
    ``fullgraph``) that made ``compiled``: a function compiled by ``torch.compile`` (what
    ``nn.Module.compile`` stores in ``_compiled_call_impl``) or an ``OptimizedModule``. Read
    from dynamo's context (``OptimizeContext``) and its backend wrapper; inductor's ``mode`` comes
    back resolved into ``options``. None when they cannot be read."""
    ctx = getattr(compiled, "dynamo_ctx", None)  # an OptimizedModule
    if ctx is None:
        code, cells = getattr(compiled, "__code__", None), getattr(compiled, "__closure__", None)
        if code is None or not cells:
            return None
        try:
            ctx = dict(zip(code.co_freevars, (c.cell_contents for c in cells))).get("self")
        except ValueError:  # an empty cell
            return None
    backend: Any = getattr(ctx, "callback", None)
    for _ in range(3):  # CatchErrorsWrapper -> ConvertFrame(Assert) -> WrapBackendDebug -> it
        backend = getattr(backend, "_torchdynamo_orig_backend", backend)
    if backend is None or not hasattr(ctx, "fullgraph"):
        return None
    found: dict[str, Any] = {
        "fullgraph": bool(getattr(ctx, "fullgraph", False)),
        "dynamic": getattr(ctx, "_dynamic", None),
    }
    if type(backend).__name__ == "_TorchCompileInductorWrapper":
        found["backend"] = "inductor"
        found["options"] = dict(getattr(backend, "config", {})) or None
    elif type(backend).__name__ == "_TorchCompileWrapper":
        found["backend"] = backend.compiler_name
        found.update(getattr(backend, "kwargs", None) or {})
    else:
        found["backend"] = backend
    return found


def compiled_autograd_on() -> bool:
    """Whether compiled autograd is on (``torch._dynamo.compiled_autograd``'s flag): it then
    traces and runs each backward itself, AOTAutograd's compiled backwards included."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(getattr(module, "compiled_autograd_enabled", False))


def compiling_locals() -> dict[str, Any]:
    """The locals of the frame dynamo is compiling now (read from the running
    ``InstructionTranslator``, while a backend is called); empty when none."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        found = InstructionTranslator.current_tx().output.root_tx.f_locals
    except Exception:  # no frame being compiled, or a torch that keeps it elsewhere
        return {}
    return found if isinstance(found, dict) else {}


def compiled_call(module: Any) -> Any:
    """The compiled ``_call_impl`` ``nn.Module.compile`` installed on ``module``, or None."""
    return getattr(module, "_compiled_call_impl", None)


def set_compiled_call(module: Any, call: Any) -> None:
    """Install ``call`` as ``module``'s compiled ``_call_impl`` (None removes it), as
    ``nn.Module.compile`` does."""
    module._compiled_call_impl = call


def inductor_config(mode: str | None, options: Any, dynamic: Any) -> dict[str, Any]:
    """The inductor config ``torch.compile(backend="inductor", mode=, options=, dynamic=)``
    compiles with."""
    from torch import _TorchCompileInductorWrapper

    config: dict[str, Any] = _TorchCompileInductorWrapper(mode, options, dynamic).config
    return config
